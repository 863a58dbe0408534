"""GMPO (geo_mean): a per-sequence loss on the geometric mean of log-space-clipped token ratios."""

from __future__ import annotations

import torch

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs, log_ratio, sequence_mean


def geo_mean(x: PolicyInputs, cfg: LossConfig) -> LossTerms:
    """ℓ_i = −Ā_i·exp(mean_t δ̃) (× geometric mean of w); δ̃ = δ clipped to [−ε_low, ε_high], pessimistic by sign(A).

    The objective is J = (1/G) Σ_i ℓ_i over the minibatch — a sequence mean by definition.
    """
    delta = log_ratio(x, clamp=False)
    clipped = delta.clamp(-cfg.eps_low, cfg.eps_high)
    sign = torch.sign(x.advantages)
    pessimistic = sign * torch.minimum(sign * delta, sign * clipped)
    seq_ratio = sequence_mean(pessimistic, x.mask).exp()
    seq_adv = sequence_mean(x.advantages, x.mask)
    loss = -seq_adv * seq_ratio
    if x.rollout_is_weights is not None:
        loss = loss * sequence_mean(torch.log(x.rollout_is_weights + 1e-10), x.mask).exp()
    was_clipped = delta != clipped
    return LossTerms(
        None, loss, was_clipped & (x.advantages > 0), was_clipped & (x.advantages < 0), -delta, applies_is_weights=False
    )
