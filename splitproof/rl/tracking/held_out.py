"""Held-out metrics with several samples per prompt, under verl's names, computed exactly.

For each data source and each variable (``reward``, the reward manager's score, and every numeric extra
value of the reward function, e.g. ``acc``), over the prompts' N samples each:

- ``mean@N``: the mean over prompts of each prompt's mean; ``std@N``: of each prompt's std (ddof 0);
- ``best@k/mean``, ``best@k/std`` (and ``worst@k``), k = 2, 4, 8, ... < N and N: the mean and std of the
  best (worst) of k samples drawn *with replacement* from a prompt's N, averaged over prompts. verl
  estimates them with 1000 bootstrap draws; here they are the exact expectations: with the prompt's values
  sorted v_(1) ≤ ... ≤ v_(N), P(best = v_(i)) = (i/N)^k − ((i−1)/N)^k and
  P(worst = v_(i)) = ((N−i+1)/N)^k − ((N−i)/N)^k (ties telescope);
- ``maj@k/mean``, ``maj@k/std`` when the reward function returns a numeric ``pred`` (the built-in rules
  do; NaN, no answer, counts as one prediction): the value of the
  most common prediction among k samples drawn with replacement (ties: the prediction seen first; its
  first sample's value), over 1000 draws from a generator seeded 42, as verl;
- ``pass@k`` (ours, k as above): the unbiased estimator of the chance that at least one of k samples
  drawn *without* replacement is correct, 1 − C(N−c, k) / C(N, k) with c the prompt's samples whose value
  is > 0 (Chen et al. 2021), averaged over prompts; for the core variable only.

The core variable is ``acc`` when the reward function reports it, else ``reward`` (verl's rule); its
``mean``, ``best``, ``maj`` (and here ``pass``) at k = N go under ``val-core/<source>/<var>/``, everything
else under ``val-aux/``. With N = 1 only ``mean@1`` exists.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

BOOTSTRAP_DRAWS, BOOTSTRAP_SEED = 1000, 42


def subset_sizes(n: int) -> list[int]:
    """verl's k values for N samples: 2, 4, 8, ... below N, then N (none for N = 1)."""
    if n <= 1:
        return []
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _moments(values: list[float], weights: list[float]) -> tuple[float, float]:
    mean = sum(w * v for v, w in zip(values, weights))
    second = sum(w * v * v for v, w in zip(values, weights))
    return mean, math.sqrt(max(second - mean * mean, 0.0))


def best_of(values: list[float], k: int) -> tuple[float, float]:
    """Mean and std of the max of k draws with replacement from ``values`` (exact)."""
    v, n = sorted(values), len(values)
    return _moments(v, [(i / n) ** k - ((i - 1) / n) ** k for i in range(1, n + 1)])


def worst_of(values: list[float], k: int) -> tuple[float, float]:
    """Mean and std of the min of k draws with replacement from ``values`` (exact)."""
    v, n = sorted(values), len(values)
    return _moments(v, [((n - i + 1) / n) ** k - ((n - i) / n) ** k for i in range(1, n + 1)])


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a prompt with c correct of n samples: 1 − C(n−c, k)/C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


NO_ANSWER = "no answer"  # the vote of every sample whose pred is NaN


def majority_of(values: list[float], preds: list[float], k: int) -> tuple[float, float]:
    """Mean and std over seeded bootstrap draws of k samples of the majority prediction's value."""
    generator = torch.Generator().manual_seed(BOOTSTRAP_SEED)
    picks = torch.randint(len(values), (BOOTSTRAP_DRAWS, k), generator=generator).tolist()
    out = []
    for draw in picks:
        counts: dict[float, list[float]] = {}
        for i in draw:  # NaN (no answer) is one prediction
            counts.setdefault(NO_ANSWER if math.isnan(preds[i]) else preds[i], []).append(values[i])
        top = max(counts, key=lambda p: len(counts[p]))
        out.append(counts[top][0])
    mean = sum(out) / len(out)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in out) / len(out))


def _prompt_metrics(values: list[float], preds: list[float] | None, pass_k: bool) -> dict[str, float]:
    n = len(values)
    mean = sum(values) / n
    metrics = {f"mean@{n}": mean}
    if n == 1:
        return metrics
    metrics[f"std@{n}"] = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    correct = sum(v > 0 for v in values)
    for k in subset_sizes(n):
        metrics[f"best@{k}/mean"], metrics[f"best@{k}/std"] = best_of(values, k)
        metrics[f"worst@{k}/mean"], metrics[f"worst@{k}/std"] = worst_of(values, k)
        if preds is not None:
            metrics[f"maj@{k}/mean"], metrics[f"maj@{k}/std"] = majority_of(values, preds, k)
        if pass_k:
            metrics[f"pass@{k}"] = pass_at_k(n, correct, k)
    return metrics


def _section(var: str, core: str, name: str, n: int) -> str:
    kind, _, rest = name.partition("@")
    at = int(rest.split("/")[0])
    return "val-core" if var == core and kind in ("mean", "best", "maj", "pass") and at == n else "val-aux"


UNKNOWN_SOURCE = "unknown"  # verl's data source for rows without one


def validation_metrics(
    sources: list[str], uids: list[int], scores: list[float], extra: dict[str, list[float]]
) -> dict[str, float]:
    """verl's ``val-core/`` and ``val-aux/`` metrics (module docstring) of samples listed with their data
    source and prompt uid; ``extra`` holds the reward function's extra values, one per sample."""
    variables = {"reward": scores, **{name: v for name, v in extra.items() if name != "pred"}}
    preds = extra.get("pred")
    by_source: dict[str, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for row, (source, uid) in enumerate(zip(sources, uids)):
        by_source[source or UNKNOWN_SOURCE][uid].append(row)
    out: dict[str, float] = {}
    for source in sorted(by_source):
        prompts = by_source[source]
        core = "acc" if "acc" in variables else "reward"
        n = max(len(rows) for rows in prompts.values())
        for var, values in variables.items():
            sums: dict[str, list[float]] = defaultdict(list)
            for rows in prompts.values():
                own = [values[r] for r in rows]
                if any(math.isnan(x) for x in own):
                    continue
                pred = None if preds is None else [preds[r] for r in rows]
                for name, value in _prompt_metrics(own, pred, var == core).items():
                    sums[name].append(value)
            for name, per_prompt in sums.items():
                out[f"{_section(var, core, name, n)}/{source}/{var}/{name}"] = sum(per_prompt) / len(per_prompt)
    return out
