"""The oracle's view of a minibatch: the valid tokens of each non-empty sequence, in float64, and the
minibatch normalisers and aggregations every objective of the oracle shares.

Padding never reaches the arithmetic: every per-token quantity is taken as ``x[i][mask[i]]`` (boolean
indexing of the valid entries of sequence i), so NaN/inf at masked positions cannot leak into the loss
or its gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig

LOG_RATIO_CLAMP = 20.0  # δ̂ = clamp(δ, ±20) where a loss asks for the clamped ratio


class Seq:
    """The valid tokens of one non-empty sequence, float64, in response order."""

    def __init__(
        self,
        row: int,
        seq_id: int,
        group: int | None,
        positions: list[int],
        lp: Tensor,
        old: Tensor,
        adv: Tensor,
        ref: Tensor | None,
        w: Tensor | None,
        ent: Tensor | None,
    ):
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


def prepare(
    log_prob,
    old_log_prob,
    advantages,
    response_mask,
    *,
    ref_log_prob=None,
    rollout_is_weights=None,
    entropy=None,
    seq_ids=None,
    index=None,
):
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask: must be [B, T], got shape {tuple(response_mask.shape)}")
    batch, width = response_mask.shape
    mask = response_mask.bool()
    if advantages.dim() == 1:
        if advantages.shape[0] != batch:
            raise ValueError(f"advantages: shape {tuple(advantages.shape)} must be [B] or [B, T]")
        advantages = advantages[:, None].expand(batch, width)
    for name, value in (
        ("log_prob", log_prob),
        ("old_log_prob", old_log_prob),
        ("advantages", advantages),
        ("ref_log_prob", ref_log_prob),
        ("rollout_is_weights", rollout_is_weights),
        ("entropy", entropy),
    ):
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
        seqs.append(
            Seq(
                row,
                ids[row],
                groups[row],
                positions,
                pick(log_prob, row, valid),
                pick(old_log_prob, row, valid),
                pick(advantages, row, valid),
                pick(ref_log_prob, row, valid),
                pick(rollout_is_weights, row, valid),
                pick(entropy, row, valid),
            )
        )
    if not seqs:
        raise ValueError("response_mask: empty minibatch: no valid response token (N = 0)")
    return seqs, mask, width


class Norm:
    """The minibatch normalisers: N valid tokens, G non-empty sequences, S the norm-mode scale, and n_g,
    the valid tokens of each prompt group (only groups with a non-empty sequence appear)."""

    def __init__(self, seqs: list[Seq], width: int, config: LossConfig):
        self.N = sum(s.n for s in seqs)
        self.G = len(seqs)
        self.S = float(config.loss_scale_factor) if config.loss_scale_factor is not None else float(width)
        self.group_n: dict[int, int] = {}
        for s in seqs:
            if s.group is not None:
                self.group_n[s.group] = self.group_n.get(s.group, 0) + s.n


def aggregate(per_seq: list[Tensor], seqs: list[Seq], mode: str, norm: Norm) -> Tensor:
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


def token_mean(values: list[Tensor], norm: Norm) -> float:
    """Σ m·x / N as a python float (metrics); values are detached per-sequence tensors."""
    return math.fsum(float(v) for x in values for v in x.detach().double().flatten().tolist()) / norm.N


def clip_ratio(x: Tensor, config: LossConfig) -> Tensor:
    return torch.clamp(x, 1.0 - config.eps_low, 1.0 + config.eps_high)
