"""The end-to-end promise: K training steps give the same rollouts, weights and metrics whatever the
generation batch size, the log-prob and update micro-batching, token budgets with packing, and the
data-parallel size (DDP and FSDP2) — float64, tiny model, built-in task, a reward with spread. GRPO, and
PPO with a critic (GAE): the critic's weights too, whatever its values pass's and its update's split."""

from __future__ import annotations

import pytest
import torch

from splitproof.engine.launch import run_data_parallel

from .rl_helpers import (
    LAYOUTS,
    PPO,
    assert_same_trajectory,
    relative_update_difference,
    run_trajectory,
    trajectory_config,
)

STEPS = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from .rl_helpers import save_tiny_char_model

    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


@pytest.fixture(scope="module")
def baseline(model_dir):
    return run_trajectory(trajectory_config(model_dir, STEPS, LAYOUTS["one-piece"]))


@pytest.fixture(scope="module")
def ppo_baseline(model_dir):
    return run_trajectory(trajectory_config(model_dir, STEPS, PPO))


def test_baseline_learns_something(baseline):
    """The comparison is not vacuous: rewards vary, advantages are non-zero, weights move."""
    first = baseline["records"][0]
    assert first["critic/score/max"] > first["critic/score/min"]
    assert first["critic/advantages/max"] > 0
    assert relative_update_difference(baseline["initial"], baseline["weights"], baseline["initial"]) == 1.0


@pytest.mark.invariance
@pytest.mark.parametrize("layout", ["ones", "budget-packed"])
def test_layouts_give_the_same_trajectory(model_dir, baseline, layout):
    got = run_trajectory(trajectory_config(model_dir, STEPS, LAYOUTS[layout]))
    assert_same_trajectory(got, baseline)


def test_group_mean_token_mean_trajectory_is_layout_free(model_dir, baseline):
    """The step hands the engine each sample's prompt uid as its group id: with group-mean-token-mean the
    run trains (no missing-index error), a token budget with packing that cuts the groups changes nothing,
    and the groups are really used (the first step's entropy metric, aggregated by the mode, differs from
    the token-mean baseline's on the same samples)."""
    group = ["actor_rollout_ref.actor.loss_agg_mode=group-mean-token-mean"]
    one = run_trajectory(trajectory_config(model_dir, 2, group))
    packed = run_trajectory(trajectory_config(model_dir, 2, group + LAYOUTS["budget-packed"]))
    assert_same_trajectory(packed, one)
    first, base_first = one["records"][0], baseline["records"][0]
    assert [s.response_ids for s in one["samples"][0]] == [s.response_ids for s in baseline["samples"][0]]
    assert abs(first["actor/entropy"] - base_first["actor/entropy"]) > 1e-9 * abs(base_first["actor/entropy"])


def test_ppo_baseline_trains_the_critic_then_the_actor(ppo_baseline):
    """The PPO comparison is not vacuous either: the critic moves from step 1, the actor from step 2 (one
    step of critic warm-up), GAE's advantages vary along a response, the value clip binds."""
    first, second = ppo_baseline["records"][:2]
    assert "actor/pg_loss" not in first and "timing_s/update_actor" not in first
    assert {"actor/pg_loss", "actor/lr", "timing_s/update_actor"} <= second.keys()
    for record in (first, second):
        assert {
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/lr",
            "critic/values/mean",
            "critic/vf_explained_var",
            "timing_s/values",
            "timing_s/update_critic",
        } <= record.keys()
    assert second["critic/vf_clipfrac"] > 0 and first["critic/lr"] == 0.02
    assert first["critic/returns/max"] > first["critic/returns/min"]
    assert (
        relative_update_difference(
            ppo_baseline["critic_initial"], ppo_baseline["critic_weights"], ppo_baseline["critic_initial"]
        )
        == 1.0
    )
    assert relative_update_difference(ppo_baseline["initial"], ppo_baseline["weights"], ppo_baseline["initial"]) == 1.0


@pytest.mark.parametrize("layout", ["ones", "budget-packed"])
def test_ppo_layouts_give_the_same_trajectory(model_dir, ppo_baseline, layout):
    got = run_trajectory(trajectory_config(model_dir, STEPS, PPO + LAYOUTS[layout]))
    assert_same_trajectory(got, ppo_baseline)


def _dp_worker(model_dir, strategy, extra=()):
    overrides = [
        f"actor_rollout_ref.actor.strategy={strategy}",
        "actor_rollout_ref.rollout.max_num_seqs=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        *extra,
    ]
    return run_trajectory(trajectory_config(model_dir, STEPS, overrides))


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_data_parallel_gives_the_same_trajectory(model_dir, baseline, strategy):
    ranks = run_data_parallel(_dp_worker, 2, model_dir, strategy)
    for got in ranks:
        assert_same_trajectory(got, baseline)


@pytest.mark.dist
def test_ppo_on_three_ranks_gives_the_same_trajectory(model_dir, ppo_baseline):
    """An FSDP2 critic beside a DDP actor, over three ranks (shares of 5 or 6 rows, a minibatch of 8 rows)."""
    extra = [
        *PPO,
        "critic.strategy=fsdp2",
        "critic.forward_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
    ]
    for got in run_data_parallel(_dp_worker, 3, model_dir, "ddp", extra):
        assert_same_trajectory(got, ppo_baseline)


def test_float32_drift_is_within_the_precision_floor(model_dir):
    """float32: layouts drift apart by rounding only — measured against a float32-vs-float64 control."""
    f32 = ["actor_rollout_ref.actor.fsdp_config.model_dtype=fp32"]
    base32 = run_trajectory(trajectory_config(model_dir, STEPS, f32))
    ones32 = run_trajectory(trajectory_config(model_dir, STEPS, f32 + LAYOUTS["ones"]))
    base64 = run_trajectory(trajectory_config(model_dir, STEPS, []))
    same = [
        [s.response_ids for s in a] == [s.response_ids for s in b] for a, b in zip(base32["samples"], ones32["samples"])
    ]
    assert same[0], "identical weights must sample identical first-step tokens"
    same_tokens = all(same)
    drift = relative_update_difference(ones32["weights"], base32["weights"], base32["initial"])
    control = relative_update_difference(base32["weights"], base64["weights"], base32["initial"])
    print(f"float32 layout drift {drift:.3e} vs float32-vs-float64 control {control:.3e}; same tokens: {same_tokens}")
    if same_tokens:
        assert drift <= 10 * control
