"""Order-free statistics.

Every sum here is ``math.fsum`` (the correctly rounded sum), so a statistic is a function of the multiset
of its inputs: permuting the rows of a batch permutes the advantages and changes no bit of them. Means are
taken around the smallest value c, c + Σ(v − c)/n, which is exactly c when all values equal c — a group of
equal rewards is centred to exactly zero.

verl counts tokens in the mask's dtype, or in PyTorch's default float dtype (float32) for bool/integer
masks; ``count_dtype`` and ``counts_plus_eps`` reproduce that rounding, which is part of verl's numbers
(docs/advantages.md, "Agreement with verl").
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .errors import AdvantageError


def count_dtype(mask_dtype: torch.dtype) -> torch.dtype:
    """The dtype verl's masked statistics count tokens in.

    The mask's own floating dtype; for bool/integer masks, PyTorch's default float dtype (the result type
    of ``int_tensor + 1e-8`` and of integer true division).
    """
    return mask_dtype if mask_dtype.is_floating_point else torch.get_default_dtype()


def counts_plus_eps(counts: Tensor, counts_in: torch.dtype) -> Tensor:
    """N + 1e-8 evaluated in ``counts_in``, as verl's ``masked_mean`` denominator; returned in float64."""
    return (counts.to(counts_in) + 1e-8).to(torch.float64)


def row_sums(x: Tensor) -> list[float]:
    """Σ_t x[i, t] for every row i, correctly rounded."""
    return [math.fsum(row) for row in x.tolist()]


def centred_mean(values: Sequence[float]) -> float:
    """mean = c + Σ(v − c)/n with c = min(values)."""
    c = min(values)
    return c + math.fsum(v - c for v in values) / len(values)


def centred_weighted_mean(values: Sequence[float], weights: Sequence[float]) -> float:
    """Σ w v / Σ w, computed as c + Σ w (v − c) / Σ w with c = min(values). Needs Σ w ≠ 0."""
    c = min(values)
    return c + math.fsum(w * (v - c) for v, w in zip(values, weights)) / math.fsum(weights)


def sample_std(values: Sequence[float], mean: float) -> float:
    """Unbiased standard deviation √(Σ(v − mean)² / (n − 1)), as ``torch.std``. Needs n ≥ 2."""
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1))


def masked_whiten(estimator: str, x: Tensor, mask: Tensor, counts_in: torch.dtype) -> Tensor:
    """verl's ``masked_whiten`` over the whole batch, applied at every position (masked ones too).

    With N = Σ m the number of valid tokens (N ≥ 2) and N̂ = N + 1e-8 (in ``counts_in``, as verl):

        μ = Σ m x / N̂,   σ² = Σ m (x − μ)² / N̂ · N/(N − 1),   x̂ = (x − μ) / √(σ² + 1e-8)
    """
    valid = x[mask.bool()]
    n = valid.numel()
    if n < 2:
        raise AdvantageError(
            estimator, f"whitens over the valid tokens of the batch and needs at least 2; response_mask has {n}"
        )
    count = torch.tensor(float(n), dtype=counts_in, device="cpu")
    n_hat = float(counts_plus_eps(count, counts_in))
    bessel = float(count / (count - 1))
    mu = math.fsum(valid.tolist()) / n_hat
    var = math.fsum(((valid - mu) ** 2).tolist()) / n_hat * bessel
    return (x - mu) * torch.tensor(var + 1e-8, dtype=torch.float64, device=x.device).rsqrt()
