"""An independent, deliberately plain float64 reference of every objective (docs/semantics.md).

This module shares no code with the rest of the package except :class:`LossConfig`. It computes the
objective of one whole optimizer minibatch in a single pass: per-sequence Python loops, vectorised
per-token work inside a sequence, everything in float64. It exists to check the fast path, so clarity
wins over speed.

Padding never reaches the arithmetic: every per-token quantity is taken as ``x[i][mask[i]]`` (boolean
indexing of the valid entries of sequence i), so NaN/inf at masked positions cannot leak into the loss
or its gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig

__all__ = ["reference_objective", "reference_selection", "reference_value_objective", "priority_hash"]

_MASK32 = 0xFFFFFFFF
_LOG_RATIO_CLAMP = 20.0  # δ̂ = clamp(δ, ±20) where a loss asks for the clamped ratio
_GSPO_LOG_MAX = 10.0
_GMPO_W_EPS = 1e-10
_DPPO_EPS = 1e-8


# ----------------------------------------------------------------------------------------------
# Priority hash (Clip-Cov)
# ----------------------------------------------------------------------------------------------

def _mix(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _MASK32
    x ^= x >> 16
    return x


def priority_hash(seed: int, step: int, seq_id: int, pos: int) -> int:
    """A 32-bit pseudo-random priority of token (seq_id, pos) at (seed, step); pure Python ints."""
    h = _mix(seed & _MASK32)
    h = _mix(h ^ (step & _MASK32))
    h = _mix(h ^ (seq_id & _MASK32))
    h = _mix(h ^ (pos & _MASK32))
    return h


# ----------------------------------------------------------------------------------------------
# Input handling
# ----------------------------------------------------------------------------------------------

class _Seq:
    """The valid tokens of one non-empty sequence, float64, in response order."""

    def __init__(self, row: int, seq_id: int, group: int | None, positions: list[int], lp: Tensor, old: Tensor,
                 adv: Tensor, ref: Tensor | None, w: Tensor | None, ent: Tensor | None):
        self.row = row
        self.seq_id = seq_id
        self.group = group  # prompt-group id (group-mean-token-mean), None if not given
        self.positions = positions  # response positions t of the valid tokens
        self.n = len(positions)
        self.lp = lp
        self.old = old
        self.adv = adv
        self.ref = ref
        self.w = w
        self.ent = ent


def _prepare(log_prob, old_log_prob, advantages, response_mask, *, ref_log_prob=None,
             rollout_is_weights=None, entropy=None, seq_ids=None, index=None):
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: must be [B, T], got shape {tuple(response_mask.shape)}")
    batch, width = response_mask.shape
    mask = response_mask.bool()
    if advantages.dim() == 1:
        if advantages.shape[0] != batch:
            raise ValueError(f"advantages: shape {tuple(advantages.shape)} must be [B] or [B, T]")
        advantages = advantages[:, None].expand(batch, width)
    for name, value in (("log_prob", log_prob), ("old_log_prob", old_log_prob), ("advantages", advantages),
                        ("ref_log_prob", ref_log_prob), ("rollout_is_weights", rollout_is_weights),
                        ("entropy", entropy)):
        if value is not None and tuple(value.shape) != (batch, width):
            raise ValueError(f"{name}: shape {tuple(value.shape)} does not match response_mask {(batch, width)}")
    if seq_ids is None:
        ids = list(range(batch))
    else:
        ids = [int(s) for s in (seq_ids.tolist() if isinstance(seq_ids, Tensor) else seq_ids)]
        if len(ids) != batch:
            raise ValueError(f"seq_ids: expected {batch} ids, got {len(ids)}")
    groups = [None] * batch
    if index is not None:
        groups = [int(g) for g in (index.tolist() if isinstance(index, Tensor) else index)]
        if len(groups) != batch:
            raise ValueError(f"index: expected {batch} group ids, got {len(groups)}")

    def pick(x: Tensor | None, row: int, valid: Tensor) -> Tensor | None:
        return None if x is None else x[row][valid].to(torch.float64)

    seqs = []
    for row in range(batch):
        valid = mask[row]
        n = int(valid.sum())
        if n == 0:
            continue  # an empty sequence contributes nothing and counts nowhere
        positions = [int(t) for t in valid.nonzero().flatten().tolist()]
        seqs.append(_Seq(row, ids[row], groups[row], positions, pick(log_prob, row, valid), pick(old_log_prob, row, valid),
                         pick(advantages, row, valid), pick(ref_log_prob, row, valid),
                         pick(rollout_is_weights, row, valid), pick(entropy, row, valid)))
    if not seqs:
        raise ValueError("response_mask: empty minibatch: no valid response token (N = 0)")
    return seqs, mask, width


class _Norm:
    """The minibatch normalisers: N valid tokens, G non-empty sequences, S the norm-mode scale, and n_g,
    the valid tokens of each prompt group (only groups with a non-empty sequence appear)."""

    def __init__(self, seqs: list[_Seq], width: int, config: LossConfig):
        self.N = sum(s.n for s in seqs)
        self.G = len(seqs)
        self.S = float(config.loss_scale_factor) if config.loss_scale_factor is not None else float(width)
        self.group_n: dict[int, int] = {}
        for s in seqs:
            if s.group is not None:
                self.group_n[s.group] = self.group_n.get(s.group, 0) + s.n


def _aggregate(per_seq: list[Tensor], seqs: list[_Seq], mode: str, norm: _Norm) -> Tensor:
    """agg_mode(ℓ) over the minibatch; per_seq[k] holds ℓ on the valid tokens of seqs[k]."""
    sums = [x.sum() for x in per_seq]
    if mode == "token-mean":
        return torch.stack(sums).sum() / norm.N
    if mode == "token-sum":
        return torch.stack(sums).sum()
    if mode == "seq-mean-token-sum":
        return torch.stack(sums).sum() / norm.G
    if mode == "seq-mean-token-mean":
        return torch.stack([s / seq.n for s, seq in zip(sums, seqs)]).sum() / norm.G
    if mode == "seq-mean-token-sum-norm":
        return torch.stack(sums).sum() / (norm.G * norm.S)
    if mode == "group-mean-token-mean":
        # the token mean of each group, then the mean over the groups
        group_sums: dict[int, list[Tensor]] = {}
        for s, seq in zip(sums, seqs):
            group_sums.setdefault(seq.group, []).append(s)
        means = [torch.stack(parts).sum() / norm.group_n[g] for g, parts in group_sums.items()]
        return torch.stack(means).sum() / len(means)
    raise ValueError(f"loss_agg_mode: unknown {mode!r}")


def _token_mean(values: list[Tensor], norm: _Norm) -> float:
    """Σ m·x / N as a python float (metrics); values are detached per-sequence tensors."""
    return math.fsum(float(v) for x in values for v in x.detach().double().flatten().tolist()) / norm.N


def _clip(x: Tensor, config: LossConfig) -> Tensor:
    return torch.clamp(x, 1.0 - config.eps_low, 1.0 + config.eps_high)


# ----------------------------------------------------------------------------------------------
# Cov selection
# ----------------------------------------------------------------------------------------------

def _select(seqs: list[_Seq], config: LossConfig, step: int) -> list[Tensor]:
    """Per sequence, a bool tensor over its valid tokens: True where the Cov loss selects the token."""
    n_total = sum(s.n for s in seqs)
    adv_mean = math.fsum(float(v) for s in seqs for v in s.adv.detach().tolist()) / n_total
    lp_mean = math.fsum(float(v) for s in seqs for v in s.lp.detach().tolist()) / n_total

    # (seq index k, token index j, seq_id, t, c)
    tokens = []
    for k, s in enumerate(seqs):
        adv = s.adv.detach()
        lp = s.lp.detach()
        cov = ((adv - adv_mean) * (lp - lp_mean)).tolist()
        if config.loss_mode == "clip_cov":
            ratio = torch.exp(lp - s.old.detach())
            clipped = ((-adv * _clip(ratio, config)) > (-adv * ratio)).tolist()
        for j, t in enumerate(s.positions):
            c = cov[j]
            if config.loss_mode == "clip_cov":
                if clipped[j] or not (config.clip_cov_lb < c < config.clip_cov_ub):
                    continue
            tokens.append((k, j, s.seq_id, t, c))

    if config.loss_mode == "kl_cov":
        quota = max(1, math.floor(n_total * config.kl_cov_ratio))
        tokens.sort(key=lambda x: (-x[4], x[2], x[3]))  # largest c first, ties by smaller key
    elif config.loss_mode == "clip_cov":
        quota = max(1, math.floor(n_total * config.clip_cov_ratio))
        tokens.sort(key=lambda x: (priority_hash(config.seed, step, x[2], x[3]), x[2], x[3]))
    else:
        raise ValueError(f"loss_mode: {config.loss_mode!r} has no token selection (only clip_cov, kl_cov)")

    chosen: list[list[int]] = [[] for _ in seqs]
    for k, j, _, _, _ in tokens[:quota]:
        chosen[k].append(j)
    selected = []
    for s, js in zip(seqs, chosen):
        sel = torch.zeros(s.n, dtype=torch.bool)
        sel[js] = True
        selected.append(sel.to(s.lp.device))
    return selected


def reference_selection(log_prob, old_log_prob, advantages, response_mask, config: LossConfig, *,
                        seq_ids=None, step: int = 0) -> Tensor:
    """The [B, T] bool mask of the tokens KL-Cov / Clip-Cov select over the whole minibatch passed in."""
    if not config.is_cov:
        raise ValueError(f"loss_mode: {config.loss_mode!r} has no token selection (only clip_cov, kl_cov)")
    seqs, mask, _ = _prepare(log_prob.detach(), old_log_prob, advantages, response_mask, seq_ids=seq_ids)
    out = torch.zeros(mask.shape, dtype=torch.bool)
    for s, sel in zip(seqs, _select(seqs, config, step)):
        for j, t in enumerate(s.positions):
            if bool(sel[j]):
                out[s.row, t] = True
    return out.to(response_mask.device)


# ----------------------------------------------------------------------------------------------
# Policy losses: each returns per-sequence ℓ (token tensors, or sequence scalars for geo_mean) and
# per-sequence metric indicators on the valid tokens.
# ----------------------------------------------------------------------------------------------

def _zeros_like(x: Tensor) -> Tensor:
    return torch.zeros_like(x.detach())


def _policy_vanilla(s: _Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv
    l1 = -a * ratio
    l2 = -a * _clip(ratio, c)
    lc = torch.maximum(l1, l2)
    dual = -a * c.clip_ratio_c
    loss = torch.where(a < 0, torch.minimum(lc, dual), lc)
    clipfrac = (l2 > l1).detach()
    lower = ((lc > dual) & (a < 0)).detach()
    return loss, clipfrac, lower, -delta


def _policy_gspo(s: _Seq, c: LossConfig):
    delta = s.lp - s.old
    log_seq = delta.sum() / s.n
    log_tok = torch.clamp(s.lp - s.lp.detach() + log_seq.detach(), max=_GSPO_LOG_MAX)
    ratio = torch.exp(log_tok)
    a = s.adv
    l1 = -a * ratio
    l2 = -a * _clip(ratio, c)
    loss = torch.maximum(l1, l2)
    return loss, (l2 > l1).detach(), _zeros_like(delta).bool(), -delta


def _policy_sapo(s: _Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv
    tau = torch.where(a > 0, torch.full_like(ratio, c.tau_pos), torch.full_like(ratio, c.tau_neg)).detach()
    gate = torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau
    none = _zeros_like(delta).bool()
    return -gate * a, none, none, -delta


def _policy_gpg(s: _Seq, c: LossConfig):
    none = _zeros_like(s.lp).bool()
    return -s.adv * s.lp, none, none, -(s.lp - s.old)


def _policy_cispo(s: _Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    loss = -_clip(ratio, c).detach() * s.adv * s.lp
    clipfrac = ((ratio < 1.0 - c.eps_low) | (ratio > 1.0 + c.eps_high)).detach()
    return loss, clipfrac, _zeros_like(delta).bool(), -delta


def _policy_dro(s: _Seq, c: LossConfig):
    delta = s.lp - s.old
    loss = -(s.adv * s.lp - 0.5 * c.dro_beta * delta * delta)
    none = _zeros_like(delta).bool()
    return loss, none, none, -delta


def _policy_dppo(s: _Seq, c: LossConfig):
    delta = torch.clamp(s.lp - s.old, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(delta)
    a = s.adv.detach()
    with torch.no_grad():
        p = torch.exp(s.lp)
        p_old = torch.exp(s.old)
        if c.loss_mode == "dppo_tv":
            diff = p - p_old
            valid = torch.where(a > 0, diff <= c.eps_high, diff >= -c.eps_low)
        else:
            d_bin = p_old * (s.old - s.lp) + (1.0 - p_old) * torch.log((1.0 - p_old + _DPPO_EPS) / (1.0 - p + _DPPO_EPS))
            valid = torch.where(a > 0, (d_bin <= c.eps_high) | (p <= p_old), (d_bin <= c.eps_low) | (p >= p_old))
    trunc = torch.clamp(ratio, max=c.clip_ratio_c).detach()
    loss = torch.zeros_like(s.lp)
    if bool(valid.any()):
        loss = loss.index_put((valid.nonzero().flatten(),), -s.adv[valid] * trunc[valid] * s.lp[valid])
    lower = (valid & (ratio.detach() > c.clip_ratio_c))
    return loss, ~valid, lower, -delta


def _policy_kl_cov(s: _Seq, c: LossConfig, sel: Tensor):
    delta = s.lp - s.old
    base = -s.adv * torch.exp(delta)
    loss = base
    if bool(sel.any()):
        idx = sel.nonzero().flatten()
        loss = base.index_put((idx,), base[sel] + c.ppo_kl_coef * delta[sel].abs())
    none = _zeros_like(delta).bool()
    return loss, none, none, -delta


def _policy_clip_cov(s: _Seq, c: LossConfig, sel: Tensor):
    delta = s.lp - s.old
    a = s.adv
    with torch.no_grad():
        ratio_d = torch.exp(delta)
        clipfrac = (-a * _clip(ratio_d, c)) > (-a * ratio_d)
    keep = ~sel
    loss = torch.zeros_like(s.lp)
    if bool(keep.any()):
        ratio = torch.exp(delta[keep])  # computed on kept tokens only: selected ones get no loss, no gradient
        kept = torch.maximum(-a[keep] * ratio, -a[keep] * _clip(ratio, c))
        loss = loss.index_put((keep.nonzero().flatten(),), kept)
    return loss, clipfrac, _zeros_like(delta).bool(), -delta


def _policy_geo_mean_seq(s: _Seq, c: LossConfig):
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


_TOKEN_LOSSES = {
    "vanilla": _policy_vanilla,
    "gspo": _policy_gspo,
    "sapo": _policy_sapo,
    "gpg": _policy_gpg,
    "cispo": _policy_cispo,
    "dro": _policy_dro,
    "dppo_tv": _policy_dppo,
    "dppo_kl": _policy_dppo,
}

_POLICY_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean"}


# ----------------------------------------------------------------------------------------------
# KL estimators
# ----------------------------------------------------------------------------------------------

def _kl_base(lp: Tensor, ref: Tensor, kind: str) -> Tensor:
    if kind in ("k1", "kl"):
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    if kind in ("k2", "mse"):
        return 0.5 * (lp - ref) ** 2
    if kind in ("k3", "low_var_kl"):
        x = torch.clamp(ref - lp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(x) - x - 1.0, -10.0, 10.0)
    raise ValueError(f"kl_loss_type: unknown {kind!r}")


def _kl_token(lp: Tensor, ref: Tensor, kind: str) -> Tensor:
    if kind.endswith("+"):
        value = _kl_base(lp, ref, kind[:-1])
        k2 = 0.5 * (lp - ref) ** 2
        return value.detach() + k2 - k2.detach()  # value of the estimator, gradient of k2
    return _kl_base(lp, ref, kind)


# ----------------------------------------------------------------------------------------------
# The objective
# ----------------------------------------------------------------------------------------------

def reference_objective(log_prob, old_log_prob, advantages, response_mask, config: LossConfig, *,
                        ref_log_prob=None, rollout_is_weights=None, entropy=None, seq_ids=None, index=None,
                        step: int = 0) -> tuple[Tensor, dict[str, float]]:
    """The minibatch objective J (float64 scalar, differentiable w.r.t. log_prob and entropy) and its metrics.

    ``index``: a group id per sequence, required by group-mean-token-mean."""
    if config.use_kl_loss and ref_log_prob is None:
        raise ValueError("ref_log_prob: required when use_kl_loss is set")
    if config.loss_agg_mode == "group-mean-token-mean" and index is None:
        raise ValueError("index: group-mean-token-mean needs a group id per sequence")
    seqs, _, width = _prepare(log_prob, old_log_prob, advantages, response_mask, ref_log_prob=ref_log_prob,
                              rollout_is_weights=rollout_is_weights, entropy=entropy, seq_ids=seq_ids,
                              index=index)
    norm = _Norm(seqs, width, config)
    mode = config.loss_mode
    metrics: dict[str, float] = {}

    clipfracs, lowers, kls = [], [], []
    n_selected = 0.0
    if mode == "geo_mean":
        per_seq = []
        for s in seqs:
            loss_i, cf, lo, kl = _policy_geo_mean_seq(s, config)
            per_seq.append(loss_i)
            clipfracs.append(cf), lowers.append(lo), kls.append(kl)
        pg_loss = torch.stack(per_seq).sum() / norm.G
    else:
        if config.is_cov:
            selection = _select(seqs, config, step)
            n_selected = float(sum(int(x.sum()) for x in selection))
        per_tok = []
        for k, s in enumerate(seqs):
            if mode == "kl_cov":
                loss, cf, lo, kl = _policy_kl_cov(s, config, selection[k])
            elif mode == "clip_cov":
                loss, cf, lo, kl = _policy_clip_cov(s, config, selection[k])
            else:
                loss, cf, lo, kl = _TOKEN_LOSSES[mode](s, config)
            if s.w is not None:
                loss = loss * s.w
            per_tok.append(loss)
            clipfracs.append(cf), lowers.append(lo), kls.append(kl)
        pg_loss = _aggregate(per_tok, seqs, _POLICY_AGG.get(mode, config.loss_agg_mode), norm)

    total = pg_loss
    metrics["pg_loss"] = float(pg_loss.detach())
    metrics["pg_clipfrac"] = _token_mean([x.double() for x in clipfracs], norm)
    metrics["pg_clipfrac_lower"] = _token_mean([x.double() for x in lowers], norm)
    metrics["ppo_kl"] = _token_mean(kls, norm)

    if entropy is not None:
        entropy_loss = _aggregate([s.ent for s in seqs], seqs, config.loss_agg_mode, norm)
        total = total - config.entropy_coeff * entropy_loss
        metrics["entropy"] = _token_mean([s.ent for s in seqs], norm)
        metrics["entropy_loss"] = float(entropy_loss.detach())

    if config.use_kl_loss:
        kl_tokens = [_kl_token(s.lp, s.ref, config.kl_loss_type) for s in seqs]
        kl_loss = _aggregate(kl_tokens, seqs, config.loss_agg_mode, norm)
        total = total + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = float(kl_loss.detach())

    if config.is_cov:
        metrics["cov_selected"] = n_selected
    metrics["loss"] = float(total.detach())
    return total, metrics


# ----------------------------------------------------------------------------------------------
# The critic's value loss
# ----------------------------------------------------------------------------------------------

def reference_value_objective(vpreds, values, returns, response_mask, *, cliprange_value: float,
                              loss_agg_mode: str = "token-mean", loss_scale_factor: float | None = None,
                              index=None) -> tuple[Tensor, dict[str, float]]:
    """The critic's minibatch objective J_V (float64, differentiable w.r.t. ``vpreds``) and its metrics.

    Per valid token: lo = V_old − c, hi = V_old + c, v̂ = lo if v < lo, hi if v > hi, else v;
    ℓ = ½·max((v − R)², (v̂ − R)²), clipped when (v̂ − R)² > (v − R)². Aggregated like the policy loss
    (``index``: one group id per row, for group-mean-token-mean).
    """
    mask = response_mask.bool()
    if mask.dim() != 2:
        raise ValueError(f"response_mask: must be [B, T], got shape {tuple(mask.shape)}")
    for name, x in (("vpreds", vpreds), ("values", values), ("returns", returns)):
        if tuple(x.shape) != tuple(mask.shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)} does not match response_mask {tuple(mask.shape)}")
    seqs, losses, clipped, preds = [], [], [], []
    for row in range(mask.shape[0]):
        valid = mask[row]
        n = int(valid.sum())
        if n == 0:
            continue
        v = vpreds[row][valid].to(torch.float64)
        old = values[row][valid].to(torch.float64)
        r = returns[row][valid].to(torch.float64)
        lo, hi = old - cliprange_value, old + cliprange_value
        v_clip = torch.where(v < lo, lo, torch.where(v > hi, hi, v))
        err, err_clip = (v - r) ** 2, (v_clip - r) ** 2
        losses.append(0.5 * torch.where(err_clip > err, err_clip, err))
        clipped.append((err_clip > err).double())
        preds.append(v.detach())
        group = None if index is None else int(index[row])
        seqs.append(_Seq(row, row, group, valid.nonzero().flatten().tolist(), v, old, r, None, None, None))
    if not seqs:
        raise ValueError("response_mask: empty minibatch: no valid response token (N = 0)")
    norm = _Norm(seqs, mask.shape[1], LossConfig(loss_scale_factor=loss_scale_factor))
    total = _aggregate(losses, seqs, loss_agg_mode, norm)
    metrics = {"critic/vf_loss": float(total.detach()), "critic/vf_clipfrac": _token_mean(clipped, norm),
               "critic/vpred_mean": _token_mean(preds, norm)}
    return total, metrics
