"""Aggregation modes (docs/semantics.md, "Aggregation") as per-token weights over the whole minibatch.

Every mode is linear in the per-token loss: J = Σ_{i,t} c_{i,t} ℓ_{i,t}, where c depends only on the
token's own sequence and the minibatch statistics. A part's share is the same sum over its own tokens,
so shares of any split add up to J exactly (up to float re-association).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .stats import MinibatchStats


def token_weights(mask: Tensor, mode: str, stats: MinibatchStats, loss_scale_factor: float | None, dtype: torch.dtype) -> Tensor:
    """c_{i,t} of `mode` for the tokens of one part: zero off the mask.

    token-mean m/N · token-sum m · seq-mean-token-sum m/G · seq-mean-token-mean m/(n_i G) ·
    seq-mean-token-sum-norm m/(G S).
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
    raise ValueError(f"loss_agg_mode: unknown {mode!r}")


def aggregate(values: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
    """Σ c·ℓ over valid tokens; padding never leaks (NaN at a masked position stays out)."""
    return torch.where(mask, weights * values, torch.zeros((), dtype=weights.dtype, device=weights.device)).sum()


def sequence_weights(mask: Tensor, stats: MinibatchStats, dtype: torch.dtype) -> Tensor:
    """1/G for each non-empty sequence of the part, 0 for empty ones: J = Σ_i ℓ_i / G (GMPO)."""
    nonempty = mask.any(dim=-1)
    return nonempty.to(dtype) / stats.num_sequences
