"""Minibatch statistics: the normalisers every part of a minibatch shares.

Computed from each part (microbatch or DP shard) and merged by addition, so one code path serves
microbatches, ranks and the whole minibatch: ``stats(whole) == sum(stats(part) for part in parts)``.
Group token counts merge the same way, group by group: a prompt group cut across microbatches or ranks
gets the count of the whole group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def group_token_counts(response_mask: Tensor, index: Tensor) -> dict[int, int]:
    """n_g = Σ_{i: g(i) = g} n_i for every group with at least one valid token (others count nowhere)."""
    counts: dict[int, int] = {}
    for group, n in zip(index.tolist(), response_mask.sum(dim=-1).tolist()):
        if n:
            counts[int(group)] = counts.get(int(group), 0) + int(n)
    return counts


@dataclass(frozen=True)
class MinibatchStats:
    """N (valid tokens), G (non-empty sequences), the response width of the rollout batch and, when the
    part carries group ids, n_g per non-empty group as sorted (group id, tokens) pairs."""

    num_tokens: int
    num_sequences: int
    response_width: int
    group_tokens: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(
        cls, response_mask: Tensor, response_width: int | None = None, index: Tensor | None = None
    ) -> MinibatchStats:
        """Statistics of one part; ``response_width`` defaults to the mask's width (the rollout's, if unsliced);
        ``index``: the part's group id per row (needed by group-mean-token-mean only)."""
        lengths = response_mask.sum(dim=-1)
        groups = () if index is None else tuple(sorted(group_token_counts(response_mask, index).items()))
        return cls(
            num_tokens=int(lengths.sum()),
            num_sequences=int((lengths > 0).sum()),
            response_width=response_mask.shape[-1] if response_width is None else response_width,
            group_tokens=groups,
        )

    def __add__(self, other: MinibatchStats) -> MinibatchStats:
        groups = dict(self.group_tokens)
        for group, n in other.group_tokens:
            groups[group] = groups.get(group, 0) + n
        return MinibatchStats(
            self.num_tokens + other.num_tokens,
            self.num_sequences + other.num_sequences,
            max(self.response_width, other.response_width),
            tuple(sorted(groups.items())),
        )

    @property
    def num_groups(self) -> int:
        """G_groups: groups of the minibatch with at least one valid token."""
        return len(self.group_tokens)

    def group_sizes(self, index: Tensor, dtype: torch.dtype) -> Tensor:
        """n_{g(i)} for each row of a part with group ids ``index`` (0 for a group with no valid token)."""
        counts = dict(self.group_tokens)
        return torch.tensor([counts.get(int(g), 0) for g in index.tolist()], dtype=dtype, device=index.device)

    def as_tensor(self, group_keys: list[int] | tuple[int, ...] = ()) -> Tensor:
        """[N, G, n_g for g in group_keys] (0 for a key this part lacks): what ranks sum."""
        counts = dict(self.group_tokens)
        values = [self.num_tokens, self.num_sequences] + [counts.get(g, 0) for g in group_keys]
        return torch.tensor(values, dtype=torch.int64, device="cpu")  # summed over ranks on the host

    @classmethod
    def from_tensor(
        cls, values: Tensor, response_width: int, group_keys: list[int] | tuple[int, ...] = ()
    ) -> MinibatchStats:
        """The inverse of :meth:`as_tensor` (the response width is not summed: every part knows it)."""
        n, g, *counts = (int(v) for v in values.tolist())
        return cls(n, g, response_width, tuple(sorted((int(k), c) for k, c in zip(group_keys, counts) if c)))

    def seq_scale(self, loss_scale_factor: float | None) -> float:
        """S of seq-mean-token-sum-norm: the configured constant, else the rollout's response width."""
        return float(self.response_width if loss_scale_factor is None else loss_scale_factor)
