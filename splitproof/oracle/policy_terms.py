"""The per-sequence policy losses: each returns ℓ on the valid tokens of one sequence (a scalar per sequence for
GMPO) and the metric indicators clipfrac, clipfrac_lower and −δ on the same tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig
from splitproof.oracle.rows import LOG_RATIO_CLAMP, Seq, clip_ratio

_GSPO_LOG_MAX = 10.0
_GMPO_W_EPS = 1e-10
_DPPO_EPS = 1e-8


def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros_like(x.detach())


def policy_vanilla(s: Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv
    l1 = -a * ratio
    l2 = -a * clip_ratio(ratio, c)
    lc = torch.maximum(l1, l2)
    dual = -a * c.clip_ratio_c
    loss = torch.where(a < 0, torch.minimum(lc, dual), lc)
    clipfrac = (l2 > l1).detach()
    lower = ((lc > dual) & (a < 0)).detach()
    return loss, clipfrac, lower, -delta


def policy_gspo(s: Seq, c: LossConfig):
    delta = s.lp - s.old
    log_seq = delta.sum() / s.n
    log_tok = torch.clamp(s.lp - s.lp.detach() + log_seq.detach(), max=_GSPO_LOG_MAX)
    ratio = torch.exp(log_tok)
    a = s.adv
    l1 = -a * ratio
    l2 = -a * clip_ratio(ratio, c)
    loss = torch.maximum(l1, l2)
    return loss, (l2 > l1).detach(), _zeros_like(delta).bool(), -delta


def policy_sapo(s: Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv
    tau = torch.where(a > 0, torch.full_like(ratio, c.tau_pos), torch.full_like(ratio, c.tau_neg)).detach()
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    none = _zeros_like(delta).bool()
    return -gate * a, none, none, -delta


def policy_gpg(s: Seq, c: LossConfig):
    none = _zeros_like(s.lp).bool()
    return -s.adv * s.lp, none, none, -(s.lp - s.old)


def policy_cispo(s: Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    loss = -clip_ratio(ratio, c).detach() * s.adv * s.lp
    clipfrac = ((ratio < 1.0 - c.eps_low) | (ratio > 1.0 + c.eps_high)).detach()
    return loss, clipfrac, _zeros_like(delta).bool(), -delta


def policy_dro(s: Seq, c: LossConfig):
    delta = s.lp - s.old
    loss = -(s.adv * s.lp - 0.5 * c.dro_beta * delta * delta)
    none = _zeros_like(delta).bool()
    return loss, none, none, -delta


def policy_dppo(s: Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv.detach()
    with torch.no_grad():
        p = torch.exp(s.lp)
        p_old = torch.exp(s.old)
        if c.loss_mode == "dppo_tv":
            diff = p - p_old
            valid = torch.where(a > 0, diff <= c.eps_high, diff >= -c.eps_low)
        else:
            d_bin = p_old * (s.old - s.lp) + (1.0 - p_old) * torch.log(
                (1.0 - p_old + _DPPO_EPS) / (1.0 - p + _DPPO_EPS)
            )
            valid = torch.where(a > 0, (d_bin <= c.eps_high) | (p <= p_old), (d_bin <= c.eps_low) | (p >= p_old))
    trunc = torch.clamp(ratio, max=c.clip_ratio_c).detach()
    loss = 0.0 * s.lp  # zero, and still a function of log_prob: a sequence with no valid token has zero gradient
    if bool(valid.any()):
        loss = loss.index_put((valid.nonzero().flatten(),), -s.adv[valid] * trunc[valid] * s.lp[valid])
    lower = valid & (ratio.detach() > c.clip_ratio_c)
    return loss, ~valid, lower, -delta


def policy_kl_cov(s: Seq, c: LossConfig, sel: Tensor):
    delta = s.lp - s.old
    base = -s.adv * torch.exp(delta)
    loss = base
    if bool(sel.any()):
        idx = sel.nonzero().flatten()
        loss = base.index_put((idx,), base[sel] + c.ppo_kl_coef * delta[sel].abs())
    none = _zeros_like(delta).bool()
    return loss, none, none, -delta


def policy_clip_cov(s: Seq, c: LossConfig, sel: Tensor):
    delta = s.lp - s.old
    a = s.adv
    with torch.no_grad():
        ratio_d = torch.exp(delta)
        clipfrac = (-a * clip_ratio(ratio_d, c)) > (-a * ratio_d)
    keep = ~sel
    loss = 0.0 * s.lp  # zero, and still a function of log_prob (zero gradient where every token is selected)
    if bool(keep.any()):
        ratio = torch.exp(delta[keep])  # computed on kept tokens only: selected ones get no loss, no gradient
        kept = torch.maximum(-a[keep] * ratio, -a[keep] * clip_ratio(ratio, c))
        loss = loss.index_put((keep.nonzero().flatten(),), kept)
    return loss, clipfrac, _zeros_like(delta).bool(), -delta


def policy_geo_mean_seq(s: Seq, c: LossConfig):
    """GMPO: one scalar ℓ_i per sequence, plus token indicators."""
    delta = s.lp - s.old
    delta_c = torch.clamp(delta, -c.eps_low, c.eps_high)
    sign = torch.sign(s.adv)
    delta_t = sign * torch.minimum(sign * delta, sign * delta_c)
    seq_ratio = torch.exp(delta_t.sum() / s.n)
    seq_adv = s.adv.sum() / s.n
    loss = -seq_adv * seq_ratio
    if s.w is not None:
        loss = loss * torch.exp(torch.log(s.w + _GMPO_W_EPS).sum() / s.n)
    moved = (delta != delta_c).detach()
    return loss, moved & (s.adv > 0), moved & (s.adv < 0), -delta


TOKEN_LOSSES = {
    "vanilla": policy_vanilla,
    "gspo": policy_gspo,
    "sapo": policy_sapo,
    "gpg": policy_gpg,
    "cispo": policy_cispo,
    "dro": policy_dro,
    "dppo_tv": policy_dppo,
    "dppo_kl": policy_dppo,
}

POLICY_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}
