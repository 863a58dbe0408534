"""The rewards of a batch of samples, in one shape from the reward function to the advantages.

``scores`` holds one float64 number per sample; ``extra`` the reward function's other values by name, one
per sample, NaN where a sample has none for the name. A name is listed in the order it first holds a
number, sample by sample (within a sample, in the order the function's results list them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rewards:
    """Every sample's score (float64 [B]) and extra values ``{name: [B values], NaN where missing}``;
    ``stats``: the scoring's own metrics (``timing_s/...`` seconds, the longest share's; counts, summed)."""

    scores: Tensor
    extra: dict[str, list[float]]
    stats: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.scores)

    def rows(self, part: slice) -> Rewards:
        """The samples ``part`` (every name kept, even one with no number there)."""
        return Rewards(self.scores[part], {name: values[part] for name, values in self.extra.items()}, self.stats)

    @staticmethod
    def concat(parts: Sequence[Rewards]) -> Rewards:
        """The parts one after the other; a name one part lacks is NaN on its samples."""
        names = dict.fromkeys(name for part in parts for name in part.extra)
        extra = {name: [v for part in parts for v in part.extra.get(name, [math.nan] * len(part))] for name in names}
        stats: dict[str, float] = {}
        for part in parts:
            for name, value in part.stats.items():
                merge = max if name.startswith("timing_s/") else (lambda a, b: a + b)
                stats[name] = merge(stats[name], value) if name in stats else value
        return Rewards(torch.cat([part.scores for part in parts]), extra, stats)


@dataclass
class ScoredSamples:
    """A step's scored samples in canonical order: their rewards, each sample's group id (its prompt's
    uid, + k × rows for the k-th repeat of a prompt within a dynamic-sampling step), the step's prompts,
    and (dynamic sampling) the prompts it consumed and its ``train/`` and ``training/filter_groups/``
    metrics; ``pipelined``: the pipeline's batch they came from (``async_training.staleness_steps`` > 0)."""

    samples: list
    rewards: Rewards
    uids: list[int]
    group_ids: list[int]
    consumed: list[int] | None = None
    metrics: dict = field(default_factory=dict)
    pipelined: object = None


def present_extra(extra: dict[str, list[float]], position=None) -> dict[str, list[float]]:
    """``extra`` without the names no sample has a number for, in the order of first appearance: by the
    first sample holding a number, then by ``position(name, row)`` (default: the order of ``extra``)."""
    first = {name: next((i for i, v in enumerate(values) if not math.isnan(v)), None) for name, values in extra.items()}
    order = {name: k for k, name in enumerate(extra)}
    held = [name for name in extra if first[name] is not None]
    rank = position or (lambda name, row: order[name])
    held.sort(key=lambda name: (first[name], rank(name, first[name])))
    return {name: extra[name] for name in held}
