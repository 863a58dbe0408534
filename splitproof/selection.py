"""Batch-coupled token selection for KL-Cov and Clip-Cov (docs/semantics.md, "Cov selection"), made once per minibatch.

c_j = (A_j − Ā)(log π_j − L̄) with Ā, L̄ token means over every valid token of the minibatch. The sums
behind them are exactly rounded (``math.fsum``), so they are functions of the minibatch's values alone —
not of the row order, the microbatches or the DP size (a balanced batch's Ā is exactly 0, never ±1e-16,
which would let rounding decide the zero-advantage tokens' scores). Both losses take a "global top-k under a
deterministic order": KL-Cov the k largest c_j, Clip-Cov the k candidates with the smallest priority hash(seed, step,
key);
ties are broken by the canonical key (sequence id, position). Each rank proposes its local top-k,
the proposals are gathered (O(k·D)), merged, and each rank marks its own chosen tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .collective import LOCAL
from .loss_config import LossConfig
from .losses.common import PolicyInputs
from .losses.cov import clip_cov_base

_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, const: int) -> Tensor:
    """(x · const) mod 2^32 for int64 tensors in [0, 2^32), without int64 overflow."""
    low, high = const & 0xFFFF, const >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def priority_hash(seed: int, step: int, seq_ids: Tensor, positions: Tensor) -> Tensor:
    """A 32-bit hash of (seed, step, sequence id, position): Clip-Cov's reproducible random order."""
    h = _mix32(torch.tensor(seed & _MASK32, dtype=torch.int64))
    h = _mix32(h ^ (step & _MASK32))
    h = _mix32(h ^ (seq_ids.to(torch.int64) & _MASK32))
    return _mix32(h ^ (positions.to(torch.int64) & _MASK32))


def exact_sum(values: Tensor) -> float:
    """Σ values in float64, exactly rounded (``math.fsum``): the same float whatever their order."""
    return math.fsum(values.detach().double().flatten().tolist())


def exact_sum_terms(values: Tensor) -> list[float]:
    """Floats whose exact sum is the exact sum of ``values``: the rounded sum, then the rounded remainders.

    ``math.fsum`` over such lists from several parts is the exactly rounded sum of all the parts' values,
    which is what one process computes with :func:`exact_sum` over the whole: ranks send a few floats,
    never their tokens. Each term is at most 2^-53 of the one before, so a handful suffice.
    """
    work = values.detach().double().flatten().tolist()
    terms: list[float] = []
    while True:
        term = math.fsum(work)
        if term == 0.0:  # the remainder is a multiple of 2^-1074 that rounds to 0: it is 0
            return terms
        terms.append(term)
        work.append(-term)


@dataclass(frozen=True)
class CovSums:
    """Σ A, Σ log π (each exactly rounded) and N over the valid tokens of the minibatch."""

    adv_sum: float
    logp_sum: float
    num_tokens: int


@dataclass(frozen=True)
class CovTerms:
    """One part's exact sums as :func:`exact_sum_terms`; parts merge exactly with :func:`combine_terms`."""

    adv: list[float]
    logp: list[float]
    num_tokens: int


def cov_terms(advantages: Tensor | None, log_prob: Tensor, mask: Tensor) -> CovTerms:
    """A part's terms (``advantages`` None: the advantage sum is taken elsewhere)."""
    valid = mask.bool()
    adv = [] if advantages is None else exact_sum_terms(advantages[valid])
    return CovTerms(adv, exact_sum_terms(log_prob[valid]), int(valid.sum()))


def combine_terms(parts: list[CovTerms]) -> CovSums:
    """The CovSums of the union of the parts: exactly rounded, whatever the parts are."""
    return CovSums(
        math.fsum(t for p in parts for t in p.adv),
        math.fsum(t for p in parts for t in p.logp),
        sum(p.num_tokens for p in parts),
    )


def cov_sums(advantages: Tensor, log_prob: Tensor, mask: Tensor, collective=LOCAL) -> CovSums:
    """The CovSums of the union of every rank's ``[b, T]`` part (one process: of this part)."""
    return combine_terms(collective.gather_objects(cov_terms(advantages, log_prob, mask)))


def shard_cov_sums(
    advantages: Tensor, mask: Tensor, shard_log_prob: Tensor, shard_mask: Tensor, collective=LOCAL
) -> CovSums:
    """The minibatch's CovSums when every rank holds all its advantages (``advantages``, ``mask``: summed
    here, no communication) but only its own shard's log-probs (gathered as a few exact terms per rank)."""
    logp = combine_terms(collective.gather_objects(cov_terms(None, shard_log_prob, shard_mask)))
    return CovSums(exact_sum(advantages[mask.bool()]), logp.logp_sum, int(mask.sum()))


def cov_scores(advantages: Tensor, log_prob: Tensor, sums: CovSums) -> Tensor:
    """c_j = (A_j − Ā)(log π_j − L̄) in float64, log π detached."""
    mean_adv = sums.adv_sum / sums.num_tokens
    mean_logp = sums.logp_sum / sums.num_tokens
    return (advantages.detach().double() - mean_adv) * (log_prob.detach().double() - mean_logp)


def quota(num_tokens: int, ratio: float) -> int:
    """k = max(1, ⌊N·ratio⌋)."""
    return max(1, math.floor(num_tokens * ratio))


def _local_proposals(primary: Tensor, eligible: Tensor, seq_ids: Tensor, k: int) -> list[tuple]:
    """This part's k best (primary, seq_id, position) keys, smallest first, ties included then cut."""
    rows, cols = eligible.nonzero(as_tuple=True)
    if rows.numel() == 0:
        return []
    values = primary[rows, cols]
    if values.numel() > k:
        threshold = torch.kthvalue(values, k).values
        keep = values <= threshold
        rows, cols, values = rows[keep], cols[keep], values[keep]
    ids = seq_ids[rows]
    keys = sorted(zip(values.tolist(), ids.tolist(), cols.tolist()))
    return keys[:k]


def propose(
    x: PolicyInputs, config: LossConfig, seq_ids: Tensor, sums: CovSums, step: int = 0
) -> tuple[int, list[tuple]]:
    """The quota k and this part's k best candidate keys (primary, seq_id, position), smallest first.

    ``sums`` are the minibatch's CovSums (all parts, all ranks): the scores, and so the proposals, of a
    token do not depend on which part holds it.
    """
    scores = cov_scores(x.advantages, x.log_prob, sums)
    if config.loss_mode == "kl_cov":
        k = quota(sums.num_tokens, config.kl_cov_ratio)
        primary, eligible = -scores, x.mask
    else:
        k = quota(sums.num_tokens, config.clip_cov_ratio)
        with torch.no_grad():
            _, clipped = clip_cov_base(x, config)
        eligible = x.mask & ~clipped & (scores > config.clip_cov_lb) & (scores < config.clip_cov_ub)
        positions = torch.arange(x.mask.shape[1], device=x.mask.device).expand_as(x.mask)
        primary = priority_hash(config.seed, step, seq_ids[:, None].expand_as(x.mask), positions).double()
    return k, _local_proposals(primary, eligible, seq_ids, k)


def merge_proposals(proposals: list[list[tuple]], k: int) -> list[tuple]:
    """The global top-k: the k smallest keys over every part's proposals."""
    return sorted(key for part in proposals for key in part)[:k]


def mark(chosen: list[tuple], seq_ids: Tensor, shape: torch.Size, device=None) -> Tensor:
    """Bool mask of the chosen (·, seq_id, position) keys that belong to the rows ``seq_ids``."""
    selection = torch.zeros(shape, dtype=torch.bool, device=device)
    row_of = {s: r for r, s in enumerate(seq_ids.tolist())}
    for _, seq, pos in chosen:
        row = row_of.get(seq)
        if row is not None:
            selection[row, pos] = True
    return selection


def select_tokens(
    x: PolicyInputs,
    config: LossConfig,
    seq_ids: Tensor,
    *,
    step: int = 0,
    sums: CovSums | None = None,
    collective=LOCAL,
) -> Tensor:
    """The bool [B, T] mask of this rank's tokens chosen over the whole minibatch.

    ``x`` holds this rank's shard of the minibatch (all its microbatches). ``sums`` are the minibatch's
    CovSums over all ranks; computed and reduced here when not given.
    """
    if sums is None:
        sums = cov_sums(x.advantages, x.log_prob, x.mask, collective)
    k, proposals = propose(x, config, seq_ids, sums, step)
    chosen = merge_proposals(collective.gather_objects(proposals), k)
    return mark(chosen, seq_ids, x.mask.shape, x.mask.device)
