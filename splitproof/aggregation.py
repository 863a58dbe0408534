"""Aggregation modes (docs/semantics.md, "Aggregation") as per-token weights over the whole minibatch.

Every mode is linear in the per-token loss: J = Σ_{i,t} c_{i,t} ℓ_{i,t}, where c depends only on the
token's own sequence (and its prompt group) and the minibatch statistics. A part's share is the same sum over its
own tokens, so shares of any split add up to J exactly (up to float re-association).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .loss_config import GROUP_AGG
from .stats import MinibatchStats


def token_weights(
    mask: Tensor,
    mode: str,
    stats: MinibatchStats,
    loss_scale_factor: float | None,
    dtype: torch.dtype,
    index: Tensor | None = None,
) -> Tensor:
    """c_{i,t} of `mode` for the tokens of one part: zero off the mask.

    token-mean m/N · token-sum m · seq-mean-token-sum m/G · seq-mean-token-mean m/(n_i G) ·
    seq-mean-token-sum-norm m/(G S) · group-mean-token-mean m/(n_{g(i)} G_groups), with ``index`` the
    part's group id per row and n_g, G_groups from ``stats``.
    """
    m = mask.to(dtype)
    if mode == "token-mean":
        return m / stats.num_tokens
    if mode == "token-sum":
        return m
    if mode == "seq-mean-token-sum":
        return m / stats.num_sequences
    if mode == "seq-mean-token-mean":
        lengths = m.sum(dim=-1, keepdim=True)
        return torch.where(mask, 1.0 / (lengths.clamp(min=1) * stats.num_sequences), torch.zeros_like(m))
    if mode == "seq-mean-token-sum-norm":
        return m / (stats.num_sequences * stats.seq_scale(loss_scale_factor))
    if mode == GROUP_AGG:
        return _group_weights(mask, stats, dtype, index)
    raise ValueError(f"loss_agg_mode: unknown {mode!r}")


def _group_weights(mask: Tensor, stats: MinibatchStats, dtype: torch.dtype, index: Tensor | None) -> Tensor:
    if index is None:
        raise ValueError(f"index: loss_agg_mode {GROUP_AGG!r} needs a group id per sequence")
    sizes = stats.group_sizes(index, dtype).to(mask.device)
    counted = mask.any(dim=-1)
    if bool((counted & (sizes == 0)).any()):
        row = int((counted & (sizes == 0)).nonzero()[0, 0])
        raise ValueError(f"index: group {int(index[row])} of row {row} is missing from the minibatch statistics")
    per_row = 1.0 / (sizes.clamp(min=1) * stats.num_groups)
    return torch.where(mask, per_row[:, None].expand(mask.shape), torch.zeros((), dtype=dtype, device=mask.device))


def aggregate(values: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """Σ c·ℓ over valid tokens; padding never leaks (NaN at a masked position stays out)."""
    return torch.where(mask, weights * values, torch.zeros((), dtype=weights.dtype, device=weights.device)).sum()


def sequence_weights(mask: Tensor, stats: MinibatchStats, dtype: torch.dtype) -> Tensor:
    """1/G for each non-empty sequence of the part, 0 for empty ones: J = Σ_i ℓ_i / G (GMPO)."""
    nonempty = mask.any(dim=-1)
    return nonempty.to(dtype) / stats.num_sequences
