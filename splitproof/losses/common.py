"""Inputs, outputs and the ratio/clip helpers every policy loss shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

LOG_RATIO_CLAMP = 20.0


@dataclass
class PolicyInputs:
    """Per-token tensors ``[B, T]`` of one part. Padding positions hold finite values (zeros)."""

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    mask: Tensor  # bool
    rollout_is_weights: Tensor | None = None
    selection: Tensor | None = None  # bool, Cov losses only: tokens chosen over the whole minibatch


@dataclass
class LossTerms:
    """A loss's output. Exactly one of ``token_loss`` [B, T] / ``seq_loss`` [B] is set.

    ``clipfrac``, ``clipfrac_lower`` and ``kl`` are per-token metric values (0/1 indicators and the
    k1 estimate −δ); the objective turns them into token means over the minibatch.
    """

    token_loss: Tensor | None
    seq_loss: Tensor | None
    clipfrac: Tensor
    clipfrac_lower: Tensor
    kl: Tensor
    applies_is_weights: bool = True  # False when the loss folds the IS weights in itself (GMPO)


def log_ratio(x: PolicyInputs, clamp: bool) -> Tensor:
    """δ = log π_θ − log π_old, clamped to ±20 when ``clamp`` (before exp)."""
    delta = x.log_prob - x.old_log_prob
    return delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) if clamp else delta


def ppo_clip(ratio: Tensor, adv: Tensor, eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """max(−Aρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) and the indicator of tokens where the clip binds."""
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


def dual_clip(loss: Tensor, adv: Tensor, clip_c: float) -> tuple[Tensor, Tensor]:
    """For A < 0 cap the loss at −A·C (dual-clip PPO); returns the loss and where the cap binds."""
    cap = -adv * clip_c
    negative = adv < 0
    return torch.where(negative, torch.minimum(loss, cap), loss), negative & (loss > cap)


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ_t m·x / n_i per sequence (0 for empty sequences)."""
    total = torch.where(mask, values, torch.zeros_like(values)).sum(dim=-1)
    return total / mask.sum(dim=-1).clamp(min=1).to(values.dtype)


def zeros_like_mask(x: PolicyInputs) -> Tensor:
    """A per-token metric of zeros (a loss without that kind of clipping)."""
    return torch.zeros_like(x.log_prob, requires_grad=False)
