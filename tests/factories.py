"""Random minibatches of per-token policy tensors for loss-level tests (no model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitproof import LossConfig
from splitproof.loss_config import AGG_MODES, LOSS_MODES


@dataclass
class Minibatch:
    log_prob: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    response_mask: torch.Tensor
    ref_log_prob: torch.Tensor | None
    rollout_is_weights: torch.Tensor | None
    entropy: torch.Tensor | None
    seq_ids: torch.Tensor
    index: torch.Tensor  # prompt-group ids: random groups of random sizes, ids not 0..k-1


def random_minibatch(
    seed: int,
    batch: int,
    width: int,
    *,
    with_ref=True,
    with_weights=True,
    with_entropy=True,
    quantized=False,
    nan_padding=True,
    dtype=torch.float64,
) -> Minibatch:
    """Random lengths (some sequences empty, at least one token valid), NaN on padding when asked; random
    prompt groups (any number from one to one per sequence, uneven sizes, rows of a group not adjacent)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (batch,), generator=g)
    if int(lengths.sum()) == 0:
        lengths[0] = 1
    mask = torch.arange(width)[None, :] < lengths[:, None]
    if batch > 2:  # a multi-turn style hole in one sequence
        mask[1, ::3] = False
        if not mask.any():
            mask[0, 0] = True
    log_prob = -torch.rand(batch, width, generator=g, dtype=dtype) * 4.0
    if quantized:  # many exact ties in the covariance scores
        log_prob = (log_prob * 2).round() / 2
    old_log_prob = log_prob + 0.3 * torch.randn(batch, width, generator=g, dtype=dtype)
    advantages = 2.0 * torch.randn(batch, generator=g, dtype=dtype)
    if seed % 2:
        advantages = advantages[:, None] + 0.5 * torch.randn(batch, width, generator=g, dtype=dtype)
    ref = old_log_prob + 0.2 * torch.randn(batch, width, generator=g, dtype=dtype) if with_ref else None
    weights = torch.rand(batch, width, generator=g, dtype=dtype) * 1.5 if with_weights else None
    entropy = torch.rand(batch, width, generator=g, dtype=dtype) * 3.0 if with_entropy else None
    if nan_padding:
        for t in (log_prob, old_log_prob, ref, entropy):
            if t is not None:
                t[~mask] = float("nan")
    seq_ids = torch.randperm(1000, generator=g)[:batch]
    num_groups = int(torch.randint(1, batch + 1, (1,), generator=g))
    labels = torch.randperm(1000, generator=g)[:num_groups] - 500
    index = labels[torch.randint(0, num_groups, (batch,), generator=g)]
    return Minibatch(log_prob, old_log_prob, advantages, mask, ref, weights, entropy, seq_ids, index)


def config_for(loss_mode: str, agg_mode: str, **overrides) -> LossConfig:
    values = dict(loss_mode=loss_mode, loss_agg_mode=agg_mode)
    if loss_mode == "dro":
        values["dro_beta"] = 0.1
    values.update(overrides)
    return LossConfig(**values)


ALL_MODES = [(loss, agg) for loss in LOSS_MODES for agg in AGG_MODES]
