"""The step's metrics under verl's names, computed on the whole rollout batch (so on every rank alike).

Timings (``timing_s/*``) and throughput (``perf/*``) are the only metrics that depend on the machine;
everything else is a function of the data, the seed and the settings.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import Tensor

from ...value_objective import explained_variance


def _stats(prefix: str, values: Tensor) -> dict[str, float]:
    values = values.double()
    if values.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": float(values.mean()),
        f"{prefix}/max": float(values.max()),
        f"{prefix}/min": float(values.min()),
    }


def _masked_stats(prefix: str, values: Tensor, mask: Tensor) -> dict[str, float]:
    return _stats(prefix, values[mask])


def data_metrics(
    *,
    token_level_scores: Tensor,
    token_level_rewards: Tensor,
    advantages: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    prompt_lengths: Tensor,
    max_response_length: int,
    max_prompt_length: int,
    values: Tensor | None = None,
    response_lengths: Tensor | None = None,
) -> dict[str, float]:
    """verl's ``compute_data_metrics``: sequence scores/rewards, token advantages/returns, lengths.
    ``response_lengths``: every token after the prompt, as verl counts them (default: the masked tokens;
    they differ when a multi-turn response holds tool tokens)."""
    response_lengths = response_mask.sum(dim=1) if response_lengths is None else response_lengths
    metrics = {}
    metrics.update(_stats("critic/score", token_level_scores.double().sum(dim=1)))
    metrics.update(_stats("critic/rewards", token_level_rewards.double().sum(dim=1)))
    metrics.update(_masked_stats("critic/advantages", advantages, response_mask))
    metrics.update(_masked_stats("critic/returns", returns, response_mask))
    if values is not None:
        metrics.update(_masked_stats("critic/values", values, response_mask))
        metrics["critic/vf_explained_var"] = explained_variance(values, returns, response_mask)
    metrics.update(_stats("response_length", response_lengths))
    metrics["response_length/clip_ratio"] = float((response_lengths >= max_response_length).double().mean())
    metrics.update(_stats("prompt_length", prompt_lengths))
    metrics["prompt_length/clip_ratio"] = float((prompt_lengths >= max_prompt_length).double().mean())
    return metrics


def reward_extra_metrics(extra: dict[str, list[float]]) -> dict[str, float]:
    """``reward/<key>/mean`` for each extra value a reward function returned: the mean over the samples
    of the whole batch that have a number for ``key`` (NaN counts as missing); a key no sample has is
    left out. ``extra[key]`` holds one value per sample of the batch, NaN where it is missing. ``pred`` is
    the answer a sample votes for (held-out ``maj@k``), not a quantity: it is not averaged."""
    metrics = {}
    for name, values in extra.items():
        if name == "pred":
            continue
        present = [v for v in values if not math.isnan(v)]
        if present:
            metrics[f"reward/{name}/mean"] = math.fsum(present) / len(present)
    return metrics


ENGINE_METRICS = {  # engine name -> verl's
    "pg_loss": "actor/pg_loss",
    "pg_clipfrac": "actor/pg_clipfrac",
    "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "kl_loss": "actor/kl_loss",
    "entropy_loss": "actor/entropy_loss",
    "cov_selected": "actor/cov_selected",
    "grad_norm": "actor/grad_norm",
    "step_skipped": "actor/step_skipped",
}


# the critic update's metrics (the engine reports them under verl's names)
CRITIC_METRICS = {
    name: name
    for name in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/step_skipped")
}


def step_means(step_metrics: Iterable[dict[str, float]], names: dict[str, str]) -> dict[str, float]:
    """The mean over the step's optimizer steps of each engine metric (each already global over its
    minibatch), under verl's names (``names``: engine name -> verl's)."""
    steps = list(step_metrics)
    out = {}
    for name, verl_name in names.items():
        values = [m[name] for m in steps if name in m]
        if values:
            out[verl_name] = sum(values) / len(values)
    return out


def actor_metrics(step_metrics: Iterable[dict[str, float]]) -> dict[str, float]:
    """The policy update's metrics (``actor/*``): ``step_means`` over ``ENGINE_METRICS``."""
    return step_means(step_metrics, ENGINE_METRICS)


class StageTimer:
    """Wall time per stage, reported as ``timing_s/<stage>``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{stage}": seconds for stage, seconds in self.seconds.items()}


def throughput_metrics(total_tokens: int, step_seconds: float, world_size: int) -> dict[str, float]:
    """verl's ``perf/*``: tokens (prompt + response) per second per rank."""
    return {
        "perf/total_num_tokens": float(total_tokens),
        "perf/time_per_step": step_seconds,
        "perf/throughput": total_tokens / max(step_seconds, 1e-12) / world_size,
    }


def is_machine_dependent(name: str) -> bool:
    """Metrics that measure the machine rather than the training (excluded from invariance checks)."""
    return name.startswith(("timing_s/", "perf/time_per_step", "perf/throughput", "timing_per_token_ms/"))
