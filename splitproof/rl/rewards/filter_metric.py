"""Checking ``algorithm.filter_groups.metric`` against what the reward function returns, before any model.

``reward`` / ``seq_reward`` / ``seq_final_reward`` are the sequence score and always exist. Any other name
must be one of the extra values the reward function (through the reward manager) returns: the function is
called once on the first training row with an empty response, and the names it returns are the ones it
offers. A function that fails on that probe is checked at the first generation round instead (before any
update), with a warning saying so.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from ...loss_config import ConfigError
from ..data.dynamic_sampling import SCORE_METRICS
from .dapo import RewardManager, apply_manager
from .functions import RewardError, score
from .scored import Rewards


@dataclass(frozen=True)
class _Probe:
    uid: int
    sample_index: int = 0
    response_ids: tuple = ()
    finished: bool = False


def reward_extra_names(manager: RewardManager, reward_fn, dataset, tokenizer) -> frozenset[str]:
    """The extra values a sample's score comes with (raises ``RewardError`` when the probe call fails)."""
    record = dataset[0]
    result = score(reward_fn, [record], [_Probe(uid=record.uid)], tokenizer, step=0, max_steps=1)
    managed = apply_manager(manager, Rewards(result.scores, result.extra), [0])
    return frozenset(name for name, values in managed.extra.items() if not math.isnan(values[0]))


def check_filter_metric(metric: str, manager: RewardManager, reward_fn, dataset, tokenizer) -> None:
    """A ``ConfigError`` naming ``algorithm.filter_groups.metric`` when the reward function does not produce it."""
    if metric in SCORE_METRICS:
        return
    try:
        names = reward_extra_names(manager, reward_fn, dataset, tokenizer)
    except RewardError as err:
        warnings.warn(
            f"algorithm.filter_groups.metric={metric!r}: cannot check it before training, the reward "
            f"function failed on an empty response ({err}); it is checked at the first generation round",
            stacklevel=2,
        )
        return
    if metric not in names:
        offered = ", ".join(sorted(set(SCORE_METRICS) | names))
        raise ConfigError(
            "algorithm.filter_groups.metric",
            f"{metric!r} is not produced by the reward function (with reward manager "
            f"{manager.name!r}); it offers: {offered}",
        )
