"""``reward/<key>/mean``: the mean over the samples of the whole batch that have the key — the same on one
process and on two, when a reward function returns the key for only some samples (here: exactly the
samples that the first rank of two scores)."""

from __future__ import annotations

import math

import pytest
import torch

from splitproof.engine.launch import run_data_parallel
from splitproof.rl.tracking.metrics import reward_extra_metrics

from .rl_helpers import HERE, run_trajectory, trajectory_config


def test_extra_metric_is_the_mean_over_the_samples_that_have_the_key():
    nan = math.nan
    metrics = reward_extra_metrics({"a": [1.0, nan, 3.0, nan], "b": [nan, nan], "c": [0.5, 0.25]})
    assert metrics == {"reward/a/mean": 2.0, "reward/c/mean": 0.375}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from .rl_helpers import save_tiny_char_model

    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


def _config(model_dir):
    return trajectory_config(
        model_dir,
        1,
        [
            f"custom_reward_function.path={HERE / 'partial_key_reward.py'}",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ],
    )


def _records(model_dir):
    return run_trajectory(_config(model_dir))["records"]


@pytest.mark.dist
def test_a_key_some_samples_lack_gives_the_same_metric_on_one_and_two_ranks(model_dir, monkeypatch):
    from splitproof.rl.run import prepare_inputs

    inputs = prepare_inputs(_config(model_dir))
    uids = inputs.sampler.next_batch()
    truths = [str(inputs.train_data[u].columns["reward_model"]["ground_truth"]) for u in uids]
    first, second = truths[: len(truths) // 2], truths[len(truths) // 2 :]  # rank 0's prompts, rank 1's
    assert not set(first) & set(second)
    monkeypatch.setenv("PARTIAL_KEY_TRUTHS", ",".join(first))

    one = _records(model_dir)[0]
    assert 1.0 <= one["reward/first/mean"] < 2.0 and "reward/length/mean" in one
    for ranks in run_data_parallel(_records, 2, model_dir):
        two = ranks[0]
        assert two["reward/first/mean"] == one["reward/first/mean"]
        assert two["reward/length/mean"] == one["reward/length/mean"]
