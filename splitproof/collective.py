"""The few collectives the update needs, so that one code path runs with and without torch.distributed.

``LOCAL`` is the single-process identity; ``ProcessGroupCollective`` reduces over a DP group.
Float reductions run in float64 on CPU tensors (gloo and NCCL both handle them; results are tiny).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class LocalCollective:
    """One process: every reduction is the identity."""

    world_size = 1
    rank = 0

    def sum(self, values: Tensor) -> Tensor:
        return values

    def max_int(self, value: int) -> int:
        return value

    def gather_objects(self, obj: Any) -> list[Any]:
        return [obj]


@dataclass
class ProcessGroupCollective:
    """Reductions over a torch.distributed process group (default: the world)."""

    group: Any = None
    device: torch.device = torch.device("cpu")

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def sum(self, values: Tensor) -> Tensor:
        out = values.to(self.device).clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out.to(values.device)

    def max_int(self, value: int) -> int:
        out = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return int(out.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out


LOCAL = LocalCollective()


def default_collective(device: torch.device | str = "cpu"):
    """The world group when torch.distributed is initialised with more than one rank, else LOCAL."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        backend = dist.get_backend()
        dev = torch.device(device) if backend == "nccl" else torch.device("cpu")
        return ProcessGroupCollective(device=dev)
    return LOCAL
