"""The policy objective J of one whole optimizer minibatch, in a single float64 pass: the policy term
aggregated by ``loss_agg_mode``, minus the entropy bonus, plus the KL loss against the reference policy."""

from __future__ import annotations

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig
from splitproof.oracle.cov_choice import select_tokens
from splitproof.oracle.policy_terms import POLICY_AGG, TOKEN_LOSSES, policy_clip_cov, policy_geo_mean_seq, policy_kl_cov
from splitproof.oracle.rows import LOG_RATIO_CLAMP, Norm, Seq, aggregate, prepare, token_mean


def _kl_base(lp: Tensor, ref: Tensor, kind: str) -> Tensor:
    if kind in ("k1", "kl"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (lp - ref) ** 2
    if kind in ("k3", "low_var_kl"):
        x = torch.clamp(ref - lp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_loss_type: unknown {kind!r}")


def _kl_token(lp: Tensor, ref: Tensor, kind: str) -> Tensor:
    if kind.endswith("+"):
        value = _kl_base(lp, ref, kind[:-1])
        k2 = 0.5 * (lp - ref) ** 2
        return value.detach() + k2 - k2.detach()  # value of the estimator, gradient of k2
    return _kl_base(lp, ref, kind)


def _policy_term(seqs: list[Seq], config: LossConfig, norm: Norm, step: int):
    """The aggregated policy loss and, per sequence, its clipfrac, clipfrac_lower and −δ indicators; the number
    of tokens a Cov loss selects (0 otherwise)."""
    mode = config.loss_mode
    clipfracs, lowers, kls = [], [], []
    n_selected = 0.0
    if mode == "geo_mean":
        per_seq = []
        for s in seqs:
            loss_i, cf, lo, kl = policy_geo_mean_seq(s, config)
            per_seq.append(loss_i)
            clipfracs.append(cf), lowers.append(lo), kls.append(kl)
        pg_loss = torch.stack(per_seq).sum() / norm.G
    else:
        if config.is_cov:
            selection = select_tokens(seqs, config, step)
            n_selected = float(sum(int(x.sum()) for x in selection))
        per_tok = []
        for k, s in enumerate(seqs):
            if mode == "kl_cov":
                loss, cf, lo, kl = policy_kl_cov(s, config, selection[k])
            elif mode == "clip_cov":
                loss, cf, lo, kl = policy_clip_cov(s, config, selection[k])
            else:
                loss, cf, lo, kl = TOKEN_LOSSES[mode](s, config)
            if s.w is not None:
                loss = loss * s.w
            per_tok.append(loss)
            clipfracs.append(cf), lowers.append(lo), kls.append(kl)
        pg_loss = aggregate(per_tok, seqs, POLICY_AGG.get(mode, config.loss_agg_mode), norm)
    return pg_loss, clipfracs, lowers, kls, n_selected


def oracle_objective(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    config: LossConfig,
    *,
    ref_log_prob=None,
    rollout_is_weights=None,
    entropy=None,
    seq_ids=None,
    index=None,
    step: int = 0,
) -> tuple[Tensor, dict[str, float]]:
    """The minibatch objective J (float64 scalar, differentiable w.r.t. log_prob and entropy) and its metrics.

    ``index``: a group id per sequence, required by group-mean-token-mean."""
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("ref_log_prob: required when use_kl_loss is set")
    if config.loss_agg_mode == "group-mean-token-mean" and index is None:
        raise ValueError("index: group-mean-token-mean needs a group id per sequence")
    seqs, _, width = prepare(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        ref_log_prob=ref_log_prob,
        rollout_is_weights=rollout_is_weights,
        entropy=entropy,
        seq_ids=seq_ids,
        index=index,
    )
    norm = Norm(seqs, width, config)
    metrics: dict[str, float] = {}
    pg_loss, clipfracs, lowers, kls, n_selected = _policy_term(seqs, config, norm, step)
    total = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["pg_clipfrac"] = token_mean([x.double() for x in clipfracs], norm)
    metrics["pg_clipfrac_lower"] = token_mean([x.double() for x in lowers], norm)
    metrics["ppo_kl"] = token_mean(kls, norm)

    if entropy is not None:
        entropy_loss = aggregate([s.ent for s in seqs], seqs, config.loss_agg_mode, norm)
        total = total - config.entropy_coeff * entropy_loss
        metrics["entropy"] = token_mean([s.ent for s in seqs], norm)
        metrics["entropy_loss"] = float(entropy_loss.detach())

    if config.use_kl_loss:
        kl_tokens = [_kl_token(s.lp, s.ref, config.kl_loss_type) for s in seqs]
        kl_loss = aggregate(kl_tokens, seqs, config.loss_agg_mode, norm)
        total = total + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())

    if config.is_cov:
        metrics["cov_selected"] = n_selected
    metrics["loss"] = float(total.detach())
    return total, metrics
