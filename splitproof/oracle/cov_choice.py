"""The tokens KL-Cov and Clip-Cov select over a whole minibatch, and the priority hash that orders Clip-Cov's
candidates, written in plain Python ints and per-token loops."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig
from splitproof.oracle.rows import Seq, clip_ratio, prepare

_MASK32 = 0xFFFFFFFF


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


def select_tokens(seqs: list[Seq], config: LossConfig, step: int) -> list[Tensor]:
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
            clipped = ((-adv * clip_ratio(ratio, config)) > (-adv * ratio)).tolist()
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


def oracle_selection(
    log_prob, old_log_prob, advantages, response_mask, config: LossConfig, *, seq_ids=None, step: int = 0
) -> Tensor:
    """The [B, T] bool mask of the tokens KL-Cov / Clip-Cov select over the whole minibatch passed in."""
    if not config.is_cov:
        raise ValueError(f"loss_mode: {config.loss_mode!r} has no token selection (only clip_cov, kl_cov)")
    seqs, mask, _ = prepare(log_prob.detach(), old_log_prob, advantages, response_mask, seq_ids=seq_ids)
    out = torch.zeros(mask.shape, dtype=torch.bool)
    for s, sel in zip(seqs, select_tokens(seqs, config, step)):
        for j, t in enumerate(s.positions):
            if bool(sel[j]):
                out[s.row, t] = True
    return out.to(response_mask.device)
