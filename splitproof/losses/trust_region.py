"""DPPO: truncated-IS policy gradient inside a binary TV or binary-KL trust region."""

from __future__ import annotations

import torch
from torch import Tensor

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs, log_ratio


def _masked_pg(x: PolicyInputs, cfg: LossConfig, inside: Tensor) -> LossTerms:
    """ℓ = −A·sg(min(ρ, C))·log π_θ on tokens inside the region, 0 elsewhere."""
    delta = log_ratio(x, clamp=True)
    ratio = delta.exp()
    inside = inside.detach()
    weight = ratio.clamp(max=cfg.clip_ratio_c).detach()
    loss = torch.where(inside, -x.advantages * weight * x.log_prob, torch.zeros_like(ratio))
    return LossTerms(loss, None, ~inside, inside & (ratio > cfg.clip_ratio_c), -delta)


def dppo_tv(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """Inside iff p − p_old ≤ ε_high (A > 0) or p − p_old ≥ −ε_low (A ≤ 0)."""
    diff = x.log_prob.exp() - x.old_log_prob.exp()
    inside = torch.where(x.advantages > 0, diff <= cfg.eps_high, diff >= -cfg.eps_low)
    return _masked_pg(x, cfg, inside)


def dppo_kl(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """Binary KL D_b = p_old·log(p_old/p) + (1−p_old)·log((1−p_old)/(1−p)); moves against A always allowed."""
    p, p_old = x.log_prob.exp(), x.old_log_prob.exp()
    kl = p_old * (x.old_log_prob - x.log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
    inside = torch.where(x.advantages > 0, (kl <= cfg.eps_high) | (p <= p_old), (kl <= cfg.eps_low) | (p >= p_old))
    return _masked_pg(x, cfg, inside)
