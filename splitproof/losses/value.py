"""The critic's clipped value loss (PPO), per token: a pure function of the predictions and the config.

    v̂ = clamp(v, V_old − c, V_old + c)          c = ``cliprange_value``
    ℓ_t = ½ · max((v − R)², (v̂ − R)²)
    clipfrac_t = 1[(v̂ − R)² > (v − R)²]

v: the value head's prediction now, V_old: its prediction before the update (the batch's ``values``),
R: the return (the batch's ``returns``). verl applies the ½ after aggregating; aggregation is linear, so
it is the same number. Like the policy losses it never sees minibatch statistics: the objective weights
ℓ by the aggregation mode's per-token constants.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class ValueTerms:
    loss: Tensor  # [B, T] ℓ_t, differentiable w.r.t. the predictions
    clipfrac: Tensor  # [B, T] bool: the clipped error is the larger one


def value_loss(vpreds: Tensor, values: Tensor, returns: Tensor, cliprange_value: float) -> ValueTerms:
    """ℓ_t = ½·max((v − R)², (clamp(v, V_old ± c) − R)²) on every position (mask afterwards)."""
    clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped_error = (vpreds - returns) ** 2
    clipped_error = (clipped - returns) ** 2
    return ValueTerms(0.5 * torch.maximum(unclipped_error, clipped_error), clipped_error > unclipped_error)
