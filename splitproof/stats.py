"""Minibatch statistics: the normalisers every part of a minibatch shares.

Computed from each part (microbatch or DP shard) and merged by addition, so one code path serves
microbatches, ranks and the whole minibatch: ``stats(whole) == sum(stats(part) for part in parts)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class MinibatchStats:
    """N (valid tokens), G (non-empty sequences) and the response width of the rollout batch."""

    num_tokens: int
    num_sequences: int
    response_width: int

    @classmethod
    def of(cls, response_mask: Tensor, response_width: int | None = None) -> "MinibatchStats":
        """Statistics of one part; ``response_width`` defaults to the mask's width (the rollout's, if unsliced)."""
        lengths = response_mask.sum(dim=-1)
        return cls(
            num_tokens=int(lengths.sum()),
            num_sequences=int((lengths > 0).sum()),
            response_width=response_mask.shape[-1] if response_width is None else response_width,
        )

    def __add__(self, other: "MinibatchStats") -> "MinibatchStats":
        return MinibatchStats(
            self.num_tokens + other.num_tokens,
            self.num_sequences + other.num_sequences,
            max(self.response_width, other.response_width),
        )

    def as_tensor(self) -> Tensor:
        return torch.tensor([self.num_tokens, self.num_sequences, self.response_width], dtype=torch.int64)

    @classmethod
    def from_tensor(cls, values: Tensor) -> "MinibatchStats":
        n, g, width = (int(v) for v in values.tolist())
        return cls(n, g, width)

    def seq_scale(self, loss_scale_factor: float | None) -> float:
        """S of seq-mean-token-sum-norm: the configured constant, else the rollout's response width."""
        return float(self.response_width if loss_scale_factor is None else loss_scale_factor)
