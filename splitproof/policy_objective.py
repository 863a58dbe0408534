"""The policy's minibatch objective J(ℬ) and each part's share of it.

``objective`` computes J(ℬ) and the step's metrics in one pass over padded [B, T] tensors.
``minibatch_share`` is what the engine calls per microbatch: the part's contribution to J and to every
metric, given the minibatch statistics (and, for the Cov losses, the part's slice of the selection).
Contract: for any partition of ℬ into parts, Σ shares = J and Σ metric shares = the metrics, because
every term is linear in per-token (or per-sequence) values weighted by minibatch-global constants.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .aggregation import aggregate, sequence_weights, token_weights
from .batch import BatchError, check_group_index, check_policy_tensors, require_group_index
from .collective import LOCAL
from .loss_config import LossConfig
from .losses import COV_CORRECTIONS, POLICY_LOSSES, PolicyInputs, kl_estimate
from .selection import select_tokens
from .stats import MinibatchStats


def zero_padding(value: Tensor | None, mask: Tensor) -> Tensor | None:
    """Zero the padding positions so that NaN/inf there reaches neither the loss nor its gradient."""
    if value is None:
        return None
    return torch.where(mask, value, torch.zeros((), dtype=value.dtype, device=value.device))


def policy_inputs(log_prob, old_log_prob, advantages, mask, rollout_is_weights=None, selection=None) -> PolicyInputs:
    """One part's per-token loss inputs, padding zeroed."""
    return PolicyInputs(
        log_prob=zero_padding(log_prob, mask),
        old_log_prob=zero_padding(old_log_prob, mask),
        advantages=zero_padding(advantages, mask),
        mask=mask,
        rollout_is_weights=zero_padding(rollout_is_weights, mask),
        selection=selection,
    )


def minibatch_share(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: LossConfig,
    stats: MinibatchStats,
    *,
    ref_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    selection: Tensor | None = None,
    index: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """This part's share of J(ℬ) (differentiable) and of each metric (detached scalars).

    Inputs are one part's [b, T] tensors, already validated: ``response_mask`` bool, ``advantages``
    [b, T]. ``stats`` are the minibatch's (all parts, all ranks). For kl_cov/clip_cov, ``selection`` is
    this part's slice of the minibatch selection (None = no token selected: the `deferred` base loss).
    ``index``: the part's group id per row (group-mean-token-mean; its n_g come from ``stats``).
    The part never needs to know how ℬ was split.
    """
    mask = response_mask
    dtype = log_prob.dtype
    if config.use_kl_loss and ref_log_prob is None:
        raise BatchError("ref_log_prob", "use_kl_loss is set but no reference log-probs were given")
    x = policy_inputs(log_prob, old_log_prob, advantages, mask, rollout_is_weights, selection)
    terms = POLICY_LOSSES[config.loss_mode](x, config)

    per_token = token_weights(mask, config.loss_agg_mode, stats, config.loss_scale_factor, dtype, index)
    if terms.seq_loss is not None:
        pg = (sequence_weights(mask, stats, dtype) * terms.seq_loss).sum()
    else:
        token_loss = terms.token_loss
        if terms.applies_is_weights and x.rollout_is_weights is not None:
            token_loss = token_loss * x.rollout_is_weights
        policy_weights = (
            per_token
            if config.policy_agg_mode == config.loss_agg_mode
            else token_weights(mask, config.policy_agg_mode, stats, config.loss_scale_factor, dtype, index)
        )
        pg = aggregate(token_loss, policy_weights, mask)

    mean_weights = token_weights(mask, "token-mean", stats, None, dtype)
    metrics = {
        "pg_loss": pg.detach(),
        "pg_clipfrac": aggregate(terms.clipfrac.to(dtype), mean_weights, mask),
        "pg_clipfrac_lower": aggregate(terms.clipfrac_lower.to(dtype), mean_weights, mask),
        "ppo_kl": aggregate(terms.kl.detach(), mean_weights, mask),
    }
    loss = pg
    if entropy is not None:
        entropy = zero_padding(entropy, mask)
        entropy_loss = aggregate(entropy, per_token, mask)
        loss = loss - config.entropy_coeff * entropy_loss
        metrics["entropy"] = aggregate(entropy.detach(), mean_weights, mask)
        metrics["entropy_loss"] = entropy_loss.detach()
    if config.use_kl_loss:
        kl = kl_estimate(config.kl_loss_type, x.log_prob, zero_padding(ref_log_prob, mask))
        kl_loss = aggregate(kl, per_token, mask)
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss.detach()
    if config.is_cov:
        chosen = selection if selection is not None else torch.zeros_like(mask)
        metrics["cov_selected"] = (chosen & mask).sum().to(dtype)
    metrics["loss"] = loss.detach()
    return loss, metrics


def correction_share(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: LossConfig,
    stats: MinibatchStats,
    selection: Tensor,
    *,
    rollout_is_weights: Tensor | None = None,
    index: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The `deferred` strategy's second pass: the selection's change to J (KL-Cov +κ|δ|, Clip-Cov −ℓ).

    Base share (selection=None) + correction share = the share with the selection.
    """
    mask = response_mask
    dtype = log_prob.dtype
    x = policy_inputs(log_prob, old_log_prob, advantages, mask, rollout_is_weights, selection)
    delta = COV_CORRECTIONS[config.loss_mode](x, config)
    if x.rollout_is_weights is not None:
        delta = delta * x.rollout_is_weights
    weights = token_weights(mask, config.loss_agg_mode, stats, config.loss_scale_factor, dtype, index)
    share = aggregate(delta, weights, mask)
    metrics = {"loss": share.detach(), "pg_loss": share.detach(), "cov_selected": (selection & mask).sum().to(dtype)}
    return share, metrics


def metric_names(config: LossConfig, with_entropy: bool) -> list[str]:
    """The metrics ``minibatch_share`` reports for this config, sorted."""
    names = ["loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"]
    names += ["entropy", "entropy_loss"] if with_entropy else []
    names += ["kl_loss"] if config.use_kl_loss else []
    names += ["cov_selected"] if config.is_cov else []
    return sorted(names)


def finalize_metrics(shares: dict[str, Tensor]) -> dict[str, float]:
    """Merged shares are already the metric values (every share is pre-normalised by ℬ's statistics)."""
    return {name: float(value) for name, value in shares.items()}


def merge_metric_shares(into: dict[str, Tensor], shares: dict[str, Tensor]) -> dict[str, Tensor]:
    """Add one part's metric shares into a float64 running sum."""
    for name, value in shares.items():
        value = value.detach().to(torch.float64)
        into[name] = into[name] + value if name in into else value
    return into


def objective(
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    config: LossConfig,
    ref_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    *,
    seq_ids: Tensor | None = None,
    index: Tensor | None = None,
    step: int = 0,
) -> tuple[Tensor, dict[str, float]]:
    """J(ℬ) over a whole minibatch of padded [B, T] tensors, and the step's metrics.

    Differentiable w.r.t. ``log_prob`` and ``entropy``. For kl_cov/clip_cov it makes the minibatch-wide
    selection itself (``seq_ids``: canonical keys, default row index; ``step``: Clip-Cov's hash input).
    ``index``: a group id per sequence ([B] integers), required by group-mean-token-mean, ignored otherwise.
    """
    mask, advantages = check_policy_tensors(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        ref_log_prob=ref_log_prob,
        rollout_is_weights=rollout_is_weights,
        entropy=entropy,
        seq_ids=seq_ids,
    )
    if config.use_kl_loss and ref_log_prob is None:
        raise BatchError("ref_log_prob", "use_kl_loss is set but no reference log-probs were given")
    index = check_group_index(index, mask.shape[0], seq_ids)
    require_group_index(index, config.loss_agg_mode)
    if index is not None:
        index = index.to(mask.device)
    stats = MinibatchStats.of(mask, index=index)
    selection = None
    if config.is_cov:
        if seq_ids is None:
            seq_ids = torch.arange(mask.shape[0], device=mask.device)
        x = policy_inputs(log_prob.detach(), old_log_prob, advantages, mask, rollout_is_weights)
        selection = select_tokens(x, config, seq_ids, step=step, collective=LOCAL)
    loss, shares = minibatch_share(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        config,
        stats,
        ref_log_prob=ref_log_prob,
        rollout_is_weights=rollout_is_weights,
        entropy=entropy,
        selection=selection,
        index=index,
    )
    return loss, finalize_metrics(shares)
