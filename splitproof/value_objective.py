"""The critic's minibatch objective and each part's share of it (the value-model twin of ``policy_objective``).

J_V(ℬ) = Σ_{i,t} c_{i,t}(n_i, N, G, S) · ℓ_{i,t}, ℓ the clipped value loss (``losses.value``), c the
aggregation mode's weights over the critic's *minibatch* (``aggregation.token_weights``). A part's share
applies the minibatch's weights to its own tokens, so the shares of any split, order or DP layout add up
to J_V — the same argument as for the policy.

Metrics (verl's names), each a share pre-normalised by ℬ's statistics so that merging is a sum:
``critic/vf_loss`` = J_V, ``critic/vf_clipfrac`` and ``critic/vpred_mean`` = token means over ℬ.
"""

from __future__ import annotations

import math

from torch import Tensor

from .aggregation import aggregate, token_weights
from .batch import BatchError, check_binary_mask, check_finite_on, check_per_token_shape, require_group_index
from .loss_config import ValueLossConfig
from .losses.value import value_loss
from .policy_objective import finalize_metrics, zero_padding
from .stats import MinibatchStats

VALUE_METRICS = ("critic/vf_clipfrac", "critic/vf_loss", "critic/vpred_mean")


def value_share(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    config: ValueLossConfig,
    stats: MinibatchStats,
    *,
    index: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This part's share of J_V(ℬ) (differentiable w.r.t. ``vpreds``) and of each metric (detached).

    ``stats`` are the minibatch's (all parts, all ranks); ``index`` the part's group id per row, for
    group-mean-token-mean. Padding never reaches the loss or its gradient.
    """
    mask = response_mask
    dtype = vpreds.dtype
    vpreds = zero_padding(vpreds, mask)
    terms = value_loss(
        vpreds, zero_padding(values, mask).to(dtype), zero_padding(returns, mask).to(dtype), config.cliprange_value
    )
    weights = token_weights(mask, config.loss_agg_mode, stats, config.loss_scale_factor, dtype, index)
    mean_weights = token_weights(mask, "token-mean", stats, None, dtype)
    loss = aggregate(terms.loss, weights, mask)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": aggregate(terms.clipfrac.to(dtype), mean_weights, mask),
        "critic/vpred_mean": aggregate(vpreds.detach(), mean_weights, mask),
    }
    return loss, metrics


def value_objective(
    vpreds: Tensor,
    values: Tensor,
    returns: Tensor,
    response_mask: Tensor,
    config: ValueLossConfig,
    *,
    index: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """J_V(ℬ) over a whole minibatch of padded [B, T] tensors (differentiable w.r.t. ``vpreds``), and its
    metrics. Inputs are checked: shapes, a 0/1 mask, finite values on valid tokens, N > 0."""
    mask = check_binary_mask("response_mask", response_mask)
    for name, value in (("vpreds", vpreds), ("values", values), ("returns", returns)):
        check_per_token_shape(name, value, mask.shape)
        check_finite_on(name, value.detach(), mask)
    if not mask.any():
        raise BatchError("response_mask", "empty minibatch: no valid response token (N = 0)")
    require_group_index(index, config.loss_agg_mode, "index")
    loss, shares = value_share(vpreds, values, returns, mask, config, MinibatchStats.of(mask, index=index), index=index)
    return loss, finalize_metrics(shares)


def explained_variance(values: Tensor, returns: Tensor, response_mask: Tensor) -> float:
    """verl's ``critic/vf_explained_var``: 1 − Var(R − V) / (Var(R) + 1e-5) over the valid tokens (unbiased
    variances in float64, NaN below two tokens, as ``torch.var``), V the critic's predictions before its
    update, R the returns. Sums are exactly rounded, so the row order cannot change it."""
    valid = response_mask.bool()
    r = returns.detach().double()[valid].tolist()
    d = (returns.detach().double() - values.detach().double())[valid].tolist()
    if len(r) < 2:
        return float("nan")
    return 1.0 - _variance(d) / (_variance(r) + 1e-5)


def _variance(xs: list[float]) -> float:
    mean = math.fsum(xs) / len(xs)
    return math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
