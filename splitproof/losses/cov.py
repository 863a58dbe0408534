"""Clip-Cov and KL-Cov given the tokens selected over the whole minibatch (``splitproof.selection``).

Each is a base loss plus a correction on the selected tokens; the `deferred` strategy backpropagates the
two separately, `prepass` in one go. ρ = exp(δ) unclamped, as in the paper's code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs, log_ratio, ppo_clip, zeros_like_mask


def _selected(x: PolicyInputs) -> Tensor:
    return x.selection if x.selection is not None else torch.zeros_like(x.mask)


def kl_cov_correction(x: PolicyInputs, cfg: LossConfig) -> Tensor:
    """+κ|δ| on the selected tokens."""
    penalty = cfg.ppo_kl_coef * log_ratio(x, clamp=False).abs()
    return torch.where(_selected(x), penalty, torch.zeros_like(penalty))


def kl_cov(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = −Aρ, plus κ|δ| on the selected (highest-covariance) tokens."""
    delta = log_ratio(x, clamp=False)
    loss = -x.advantages * delta.exp() + kl_cov_correction(x, cfg)
    zero = zeros_like_mask(x)
    return LossTerms(loss, None, zero, zero, -delta)


def clip_cov_base(x: PolicyInputs, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """PPO clip without dual-clip on unclamped ρ, and where the clip binds."""
    return ppo_clip(log_ratio(x, clamp=False).exp(), x.advantages, cfg.eps_low, cfg.eps_high)


def clip_cov_correction(x: PolicyInputs, cfg: LossConfig) -> Tensor:
    """−ℓ on the selected tokens: removes their loss and gradient from the base loss."""
    base, _ = clip_cov_base(x, cfg)
    return torch.where(_selected(x), -base, torch.zeros_like(base))


def clip_cov(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """PPO clip loss; the selected tokens contribute neither loss nor gradient."""
    base, clipped = clip_cov_base(x, cfg)
    loss = torch.where(_selected(x), torch.zeros_like(base), base)
    return LossTerms(loss, None, clipped, zeros_like_mask(x), -log_ratio(x, clamp=False))
