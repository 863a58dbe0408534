"""Ratio-based losses: PPO clip with dual-clip (vanilla), GSPO-token, SAPO, CISPO."""

from __future__ import annotations

import torch

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs, dual_clip, log_ratio, ppo_clip, sequence_mean, zeros_like_mask


def vanilla(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = max(−Aρ, −A·clip(ρ)); for A < 0 also ≤ −A·C. ρ = exp(clamp(δ, ±20))."""
    delta = log_ratio(x, clamp=True)
    loss, clipped = ppo_clip(delta.exp(), x.advantages, cfg.eps_low, cfg.eps_high)
    loss, lower = dual_clip(loss, x.advantages, cfg.clip_ratio_c)
    return LossTerms(loss, None, clipped, lower, -delta)


def gspo(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """GSPO-token: s_{i,t} has the value s_i = exp(mean_t δ) and the gradient s_i·∇log π; PPO clip on it."""
    delta = log_ratio(x, clamp=False)
    seq_log_ratio = sequence_mean(delta, x.mask).detach()
    token_log_ratio = x.log_prob - x.log_prob.detach() + seq_log_ratio[:, None]
    ratio = token_log_ratio.clamp(max=10.0).exp()
    loss, clipped = ppo_clip(ratio, x.advantages, cfg.eps_low, cfg.eps_high)
    return LossTerms(loss, None, clipped, zeros_like_mask(x), -delta)


def sapo(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = −f(ρ)·A with the soft gate f(ρ) = σ(τ(ρ−1))·4/τ, τ = tau_pos (A > 0) or tau_neg."""
    delta = log_ratio(x, clamp=True)
    tau = torch.where(x.advantages > 0, torch.full_like(delta, cfg.tau_pos), torch.full_like(delta, cfg.tau_neg))
    gate = torch.sigmoid(tau * (delta.exp() - 1.0)) * (4.0 / tau)
    zero = zeros_like_mask(x)
    return LossTerms(-gate * x.advantages, None, zero, zero, -delta)


def cispo(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ = −sg(clip(ρ))·A·log π_θ: every token keeps a REINFORCE gradient with a bounded IS weight."""
    delta = log_ratio(x, clamp=True)
    ratio = delta.exp()
    weight = ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high).detach()
    clipped = (ratio < 1.0 - cfg.eps_low) | (ratio > 1.0 + cfg.eps_high)
    return LossTerms(-weight * x.advantages * x.log_prob, None, clipped, zeros_like_mask(x), -delta)
