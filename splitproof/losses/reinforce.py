"""Ratio-free policy gradients: GPG and DRO."""

from __future__ import annotations

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs, log_ratio, zeros_like_mask


def gpg(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = −A·log π_θ."""
    zero = zeros_like_mask(x)
    return LossTerms(-x.advantages * x.log_prob, None, zero, zero, -log_ratio(x, clamp=False))


def dro(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = −(A·log π_θ − ½β δ²): a quadratic trust region instead of a clip."""
    delta = log_ratio(x, clamp=False)
    zero = zeros_like_mask(x)
    loss = -(x.advantages * x.log_prob - 0.5 * cfg.dro_beta * delta.square())
    return LossTerms(loss, None, zero, zero, -delta)
