"""How the RL step divides work over data-parallel ranks, and puts it back together.

Each rank generates, scores and computes no-grad log-probs for a contiguous share of the rollout
batch's rows; the shares are gathered so that every rank holds the whole batch in canonical order.
None of these stages depends on how rows are shared out, so the gathered result is the same for any
number of ranks. A failure on one rank is raised on every rank, with the same message, so no rank is
left waiting in a collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


class RankFailure(RuntimeError):
    """A stage failed on some rank; every rank raises this with the first failing rank's message."""

    def __init__(self, kind: str, message: str, rank: int):
        super().__init__(message)
        self.kind = kind
        self.rank = rank


def rank_rows(count: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s contiguous share of ``count`` rows: sizes differ by at most one."""
    start = count * rank // world_size
    stop = count * (rank + 1) // world_size
    return range(start, stop)


def run_on_share(
    collective, count: int, work: Callable[[range], list[T]], errors: tuple[type[BaseException], ...] = (Exception,)
) -> list[T]:
    """``work(rows)`` on this rank's share; the shares gathered in rank order (= canonical row order).

    An exception of the given kinds on any rank is re-raised on every rank: the original exception on
    the rank where it happened when it is alone, else a ``RankFailure`` carrying its type and message.
    """
    rows = rank_rows(count, collective.rank, collective.world_size)
    outcome: tuple[str, Any]
    caught: BaseException | None = None
    try:
        outcome = ("ok", work(rows))
    except errors as exc:
        caught = exc
        outcome = ("error", (type(exc).__name__, str(exc)))
    gathered = collective.gather_objects(outcome)
    for rank, (status, value) in enumerate(gathered):
        if status == "error":
            if caught is not None and rank == collective.rank:
                raise caught
            if collective.world_size == 1:  # pragma: no cover - caught above
                raise RuntimeError(value[1])
            raise RankFailure(value[0], value[1], rank)
    return [item for _, part in gathered for item in part]


def gather_rows(collective, count: int, work: Callable[[range], Tensor]) -> Tensor:
    """Like ``run_on_share`` for a tensor of rows: each rank computes ``work(rows) -> [len(rows), ...]``,
    the result is the [count, ...] concatenation in row order on every rank, on the device of this rank's
    part (the shares travel through the host only between ranks)."""
    mine: list[Tensor] = []

    def share(rows):
        part = work(rows)
        mine.append(part)
        return [part.cpu() if collective.world_size > 1 else part]

    parts = run_on_share(collective, count, share)
    return torch.cat([p.to(mine[0].device) for p in parts], dim=0)


def first_rank_only(collective) -> bool:
    return collective.rank == 0


def flatten(groups: Sequence[Sequence[T]]) -> list[T]:
    return [item for group in groups for item in group]
