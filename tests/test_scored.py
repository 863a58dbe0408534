"""A batch's rewards in one shape (``rl.rewards.scored``): the extra values' order and their concatenation."""

from __future__ import annotations

import math

import torch

from splitproof.rl.rewards.dapo import OverlongBuffer, RewardManager, apply_manager
from splitproof.rl.rewards.scored import Rewards, present_extra

NAN = math.nan


def test_extra_values_are_listed_in_the_order_they_first_hold_a_number():
    """Sample by sample; within a sample in the function's order; a name no sample has is dropped."""
    extra = {"a": [NAN, 2.0, NAN], "b": [1.0, NAN, 3.0], "c": [NAN, 5.0, NAN], "never": [NAN, NAN, NAN]}
    assert list(present_extra(extra)) == ["b", "a", "c"]
    assert present_extra(extra)["a"] is extra["a"]


def test_the_dapo_manager_puts_its_values_where_each_sample_would_list_them():
    """``acc`` first on a sample without extra values, the overlong values after a sample's own."""
    buffer = OverlongBuffer(length=2, penalty_factor=1.0, max_resp_len=4, log=True)
    given = Rewards(torch.tensor([1.0, 0.5], dtype=torch.float64), {"pred": [NAN, 3.0]})
    out = apply_manager(RewardManager("dapo", buffer), given, [4, 1])
    assert list(out.extra) == ["acc", "overlong_reward", "overlong", "pred"]
    # a sample whose function returned its answer (``pred``) and no other value scores ``acc`` too
    assert out.scores.tolist() == [0.0, 0.5] and out.extra["acc"] == [1.0, 0.5]
    later = apply_manager(RewardManager("dapo", buffer), Rewards(given.scores, {"pred": [3.0, NAN]}), [4, 1])
    assert list(later.extra) == ["acc", "pred", "overlong_reward", "overlong"]


def test_concatenated_parts_keep_every_name_with_nan_where_a_part_lacks_it():
    first = Rewards(torch.tensor([1.0], dtype=torch.float64), {"x": [2.0]})
    second = Rewards(torch.tensor([0.0, 3.0], dtype=torch.float64), {"y": [NAN, 4.0]})
    both = Rewards.concat([first, second])
    assert both.scores.tolist() == [1.0, 0.0, 3.0] and list(both.extra) == ["x", "y"]
    assert both.extra["x"][0] == 2.0 and all(math.isnan(v) for v in both.extra["x"][1:])
    assert both.rows(slice(1, 3)).extra["y"][1] == 4.0 and len(both.rows(slice(1, 3))) == 2
