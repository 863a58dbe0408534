"""Small policy-loss functions in verl's calling convention, for the audit tests.

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (pg_loss, metrics)

Importable by spec from the repository root, e.g. ``--loss-fn tests.audit_examples:microbatch_mean``.
"""

from __future__ import annotations

import torch


def _clip_range(config):
    return config.get("clip_ratio_low", 0.2), config.get("clip_ratio_high", 0.2)


def correct_token_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """PPO clip, token mean with the minibatch-global token count, compensated for DP averaging: invariant."""
    info = config.global_batch_info
    eps_low, eps_high = _clip_range(config)
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    mask = response_mask.bool()
    pg_loss = torch.where(mask, loss, torch.zeros_like(loss)).sum() / info["batch_num_tokens"] * info["dp_size"]
    return pg_loss, {"actor/pg_clipfrac": 0.0}


def missing_dp_size(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """A per-token sum over the minibatch's N, not multiplied by dp_size: exact except under DP (x 1/D)."""
    info = config.global_batch_info
    loss = -advantages * torch.exp(log_prob - old_log_prob)
    return torch.where(response_mask.bool(), loss, torch.zeros_like(loss)).sum() / info["batch_num_tokens"], {}


def microbatch_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GMPO-like: a per-sequence loss, then torch.mean over the microbatch's rows (no global info)."""
    mask = response_mask.to(log_prob.dtype)
    n = mask.sum(dim=-1)
    delta = (log_prob - old_log_prob) * mask
    seq_ratio = torch.exp(delta.sum(dim=-1) / (n + 1e-8))
    seq_adv = (advantages * mask).sum(dim=-1) / (n + 1e-8)
    pg_loss = torch.mean(-seq_adv * seq_ratio)
    return pg_loss, {"actor/ppo_kl": torch.tensor(0.0)}


def microbatch_topk(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """KL-Cov-like: top-k tokens by covariance chosen inside the microbatch get a |δ| penalty.

    k = max(1, int(N_local * kl_cov_ratio)); aggregated with the global token count (so only the
    selection is per microbatch).
    """
    info = config.global_batch_info
    ratio_k = config.policy_loss.get("kl_cov_ratio", 2e-4)
    coef = config.policy_loss.get("ppo_kl_coef", 0.1)
    mask = response_mask.bool()
    delta = log_prob - old_log_prob
    ratio = torch.exp(delta)
    loss = -advantages * ratio
    n_local = int(mask.sum())
    if n_local > 0:
        adv_v = advantages[mask].detach()
        lp_v = log_prob[mask].detach()
        cov = (adv_v - adv_v.mean()) * (lp_v - lp_v.mean())
        k = max(1, int(n_local * ratio_k))
        chosen = torch.topk(cov, k).indices
        selected = torch.zeros(n_local, dtype=torch.bool)
        selected[chosen] = True
        penalty = torch.zeros_like(loss)
        penalty[mask] = selected.to(loss.dtype)
        loss = loss + coef * penalty * delta.abs()
    pg_loss = torch.where(mask, loss, torch.zeros_like(loss)).sum() / info["batch_num_tokens"] * info["dp_size"]
    return pg_loss, {}


NOT_CALLABLE = 42
