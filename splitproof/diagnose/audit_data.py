"""The audit's synthetic minibatch (float64 log-probs, GRPO advantages, varied lengths) and the splits it
compares with one microbatch: uneven sizes, one sequence each, a token budget, two ranks."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

SPLIT_KINDS = ("uneven", "many_small", "token_budget", "dp2")


@dataclass
class AuditMinibatch:
    """One minibatch of per-token tensors, padding zeroed."""

    old_log_prob: Tensor  # [B, T] float64
    log_prob: Tensor
    advantages: Tensor
    response_mask: Tensor  # [B, T] bool
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))


def make_minibatch(seed: int, sequences: int, response_length: int, group_size: int = 4) -> AuditMinibatch:
    """Random lengths in [1, T] (one empty sequence), log-probs with noise, GRPO advantages per token."""
    g = torch.Generator().manual_seed(seed)
    B, T = sequences, response_length
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[int(torch.randint(0, B, (1,), generator=g))] = 0  # one empty sequence (multi-turn style mask)
    lengths[int(torch.argmax(lengths))] = T  # and one full-width sequence
    mask = torch.arange(T)[None, :] < lengths[:, None]
    dtype = torch.float64
    old = -(torch.rand(B, T, generator=g, dtype=dtype) * 3.0 + 0.05)
    new = old + 0.25 * torch.randn(B, T, generator=g, dtype=dtype)  # ratios spread over the clip range
    rewards = torch.randint(0, 2, (B,), generator=g).to(dtype) + 0.1 * torch.randn(B, generator=g, dtype=dtype)
    adv = torch.zeros(B, dtype=dtype)
    for start in range(0, B, group_size):
        r = rewards[start : start + group_size]
        std = r.std() if len(r) > 1 else torch.zeros((), dtype=dtype)
        adv[start : start + group_size] = (r - r.mean()) / (std + 1e-6)
    advantages = adv[:, None].expand(B, T).clone()
    zero = torch.zeros((), dtype=dtype)
    return AuditMinibatch(
        old_log_prob=torch.where(mask, old, zero),
        log_prob=torch.where(mask, new, zero),
        advantages=torch.where(mask, advantages, zero),
        response_mask=mask,
        lengths=[int(n) for n in lengths],
    )


@dataclass
class AuditSplit:
    """A split of the minibatch over ranks and microbatches."""

    name: str
    ranks: list[list[list[int]]]  # rank -> microbatches -> sequence indices
    description: str

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def microbatches(self) -> list[list[int]]:
        return [mb for rank in self.ranks for mb in rank]


def _doubling_sizes(n: int) -> list[int]:
    sizes, size = [], 1
    while n > 0:
        take = min(size, n)
        sizes.append(take)
        n -= take
        size *= 2
    return sizes


def _cut(indices: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for s in sizes:
        out.append(list(indices[start : start + s]))
        start += s
    return out


def _token_budget_pack(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """First-fit decreasing by length (ties by index): every microbatch holds <= budget valid tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= budget:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def make_splits(mb: AuditMinibatch) -> tuple[list[AuditSplit], int]:
    """The four splits (``SPLIT_KINDS``) and the token budget of ``token_budget``."""
    B = len(mb.lengths)
    idx = list(range(B))
    uneven = _cut(idx, _doubling_sizes(B))
    many_small = [[i] for i in idx]
    budget = max(max(mb.lengths), math.ceil(mb.num_tokens / 4))
    packed = _token_budget_pack(mb.lengths, budget)
    half = (B + 1) // 2
    r0, r1 = idx[:half], idx[half:]
    rank0 = _cut(r0, [1, len(r0) - 1])
    rank1 = _cut(r1, [len(r1) - len(r1) // 2, len(r1) // 2])
    splits = [
        AuditSplit(
            "uneven", [uneven], f"{len(uneven)} microbatches of {'/'.join(str(len(m)) for m in uneven)} sequences"
        ),
        AuditSplit("many_small", [many_small], f"{B} microbatches of one sequence each"),
        AuditSplit(
            "token_budget", [packed], f"{len(packed)} microbatches of <= {budget} valid tokens (first-fit decreasing)"
        ),
        AuditSplit("dp2", [rank0, rank1], "2 ranks x 2 microbatches, gradients averaged over ranks"),
    ]
    return splits, budget
