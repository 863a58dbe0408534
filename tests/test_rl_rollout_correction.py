"""Rollout correction in the RL step: the truncated IS weights reach the update and, with the
rollout_corr/ metrics, do not depend on the layout; float32 shows the generation-vs-recompute mismatch;
bypass mode skips the old-log-prob pass and trains on the rollout's log-probs.

A real mismatch needs a rollout engine whose log-probs differ from the trainer's (vLLM in bf16, say). In
float64 the hf rollout's log-probs equal the recomputed ones, so ``shifted_rollout`` simulates such an
engine: it moves every rollout log-prob by a fixed function of (prompt uid, sample index, token position),
which keeps the rollout a function of the data alone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

import splitproof.rl.models.learner as learner_module
import splitproof.rl.step as step_module
from splitproof.engine.launch import run_data_parallel
from splitproof.rl.rollout.hf import HFRollout

from .rl_helpers import (
    LAYOUTS,
    assert_same_trajectory,
    relative_update_difference,
    run_trajectory,
    save_tiny_char_model,
    trajectory_config,
)

STEPS = 2
IS = {
    "token": ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=1.3"],
    "sequence": [
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=1.25",
    ],
}
THRESHOLD = {"token": 1.3, "sequence": 1.25}
BYPASS = ["algorithm.rollout_correction.bypass_mode=true"]


def _shift(sample):
    return dataclasses.replace(
        sample,
        log_probs=[
            lp - 0.4 * math.sin(1.7 * sample.uid + 2.3 * sample.sample_index + 0.9 * t + 0.5)
            for t, lp in enumerate(sample.log_probs)
        ],
    )


@contextlib.contextmanager
def observed(shift: bool):
    """Record what every update receives (and the no-grad log-prob passes); optionally shift the rollout."""
    seen = {"batches": [], "log_prob_passes": 0}
    generate, update, passes = HFRollout.generate, learner_module.update_policy, step_module.no_grad_log_probs

    def shifted_generate(self, *args, **kwargs):
        samples = generate(self, *args, **kwargs)
        return [_shift(s) for s in samples] if shift else samples

    def recording_update(policy, optimizer, batch, *args, **kwargs):
        seen["batches"].append(batch)
        return update(policy, optimizer, batch, *args, **kwargs)

    def counting_passes(*args, **kwargs):
        seen["log_prob_passes"] += 1
        return passes(*args, **kwargs)

    HFRollout.generate = shifted_generate
    learner_module.update_policy, step_module.no_grad_log_probs = recording_update, counting_passes
    try:
        yield seen
    finally:
        HFRollout.generate = generate
        learner_module.update_policy, step_module.no_grad_log_probs = update, passes


def run(model_dir, overrides, *, shift=True, dtype="fp64"):
    with observed(shift) as seen:
        result = run_trajectory(trajectory_config(model_dir, STEPS, overrides, dtype=dtype))
    result["batches"], result["log_prob_passes"] = seen["batches"], seen["log_prob_passes"]
    return result


def corr_metrics(result):
    return [{k: v for k, v in r.items() if k.startswith("rollout_corr/")} for r in result["records"]]


def is_weights(result):
    return [b.rollout_is_weights for b in result["batches"]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


@pytest.fixture(scope="module")
def uncorrected(model_dir):
    return run(model_dir, [])


@pytest.fixture(scope="module", params=["token", "sequence"])
def corrected(request, model_dir):
    return request.param, run(model_dir, IS[request.param])


def test_weights_reach_the_update(corrected, uncorrected):
    """Not vacuous: weights vary, some are truncated, and they change the update."""
    level, result = corrected
    first = result["records"][0]
    weights = torch.cat([w[b.response_mask] for w, b in zip(is_weights(result), result["batches"])])
    assert weights.dtype == torch.float64 and weights.min() < 0.9 and weights.max() == THRESHOLD[level]
    assert first["rollout_corr/rollout_is_ratio_fraction_high"] > 0 and first["rollout_corr/kl"] != 0
    assert all(w is None for w in is_weights(uncorrected))
    assert (
        "rollout_corr/kl" in uncorrected["records"][0]
        and "rollout_corr/rollout_is_mean" not in uncorrected["records"][0]
    )
    assert relative_update_difference(result["weights"], uncorrected["weights"], uncorrected["initial"]) > 1e-3


@pytest.mark.invariance
@pytest.mark.parametrize("layout", ["ones", "budget-packed"])
def test_layouts_give_identical_weights_and_metrics(model_dir, corrected, layout):
    """Log-prob micro-batches of 1 / token budgets with packing, generation batches of 1 / 5, update splits:
    the same trajectory; at step 1 (one policy) the same weights and rollout_corr/ metrics to the bit."""
    level, want = corrected
    got = run(model_dir, IS[level] + LAYOUTS[layout])
    _assert_same_correction(got["records"], is_weights(got), want)
    assert_same_trajectory(got, want)


def _assert_same_correction(records, weights, want):
    """Step 1 starts from one policy, so its inputs are identical and so are its weights and metrics. Later
    steps start from updates that differ by round-off (~1e-15 of the update), and so do their log-probs."""
    assert corr_metrics({"records": records})[0] == corr_metrics(want)[0]
    assert torch.equal(weights[0], is_weights(want)[0])
    for a, b in zip(weights[1:], is_weights(want)[1:]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=0)


@pytest.mark.invariance
@pytest.mark.dist
def test_data_parallel_gives_identical_weights_and_metrics(model_dir, corrected):
    level, want = corrected
    overrides = IS[level] + [
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.rollout.max_num_seqs=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    ]
    for got in run_data_parallel(_dp_worker, 2, model_dir, overrides):
        _assert_same_correction(got["records"], got["weights_seen"], want)
        for a, b in zip(corr_metrics(got), corr_metrics(want)):
            assert a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12) for k in a)
        assert relative_update_difference(got["weights"], want["weights"], want["initial"]) <= 1e-10


def _dp_worker(model_dir, overrides):
    result = run(model_dir, overrides)
    return {"records": result["records"], "weights_seen": is_weights(result), "weights": result["weights"]}


def test_float32_weights_show_the_recompute_mismatch(model_dir):
    """Without a simulated mismatch: in float64 the rollout's log-probs are the recomputed ones (weights 1,
    KL 0); in float32 the decode loop and the full forward round differently, and the metrics show it."""
    for dtype in ("fp64", "fp32"):
        result = run(model_dir, IS["token"], shift=False, dtype=dtype)
        weights = result["batches"][0].rollout_is_weights[result["batches"][0].response_mask]
        first = result["records"][0]
        spread = float((weights - 1).abs().max())
        print(f"{dtype}: max |w - 1| {spread:.2e}, rollout_corr/kl {first['rollout_corr/kl']:.2e}")
        if dtype == "fp64":
            assert spread <= 1e-12 and abs(first["rollout_corr/kl"]) <= 1e-14
        else:
            assert 0 < spread < 1e-4 and first["rollout_corr/rollout_is_std"] > 0
            # the signed KL estimate can cancel to exactly 0 over so few tokens (seen with transformers 5.24);
            # the absolute log-perplexity difference cannot
            assert first["rollout_corr/log_ppl_abs_diff"] > 0


def test_bypass_mode_trains_on_the_rollout_log_probs(model_dir, uncorrected):
    """No old-log-prob pass (only the reference's), no timing for it, no rollout_corr/ metrics; the update's
    old log-probs are the rollout's, bit for bit."""
    got = run(model_dir, BYPASS)
    assert got["log_prob_passes"] == STEPS and uncorrected["log_prob_passes"] == 2 * STEPS  # ref (+ old)
    for record in got["records"]:
        assert "timing_s/old_log_prob" not in record and "actor/entropy" not in record
        assert not any(k.startswith("rollout_corr/") for k in record)
    for batch, samples in zip(got["batches"], got["samples"]):
        assert batch.rollout_is_weights is None
        for row, sample in enumerate(samples):
            assert batch.old_log_probs[row, : len(sample.log_probs)].tolist() == sample.log_probs
    # the simulated mismatch moves the old log-probs, so the update differs from the recomputing run
    assert relative_update_difference(got["weights"], uncorrected["weights"], uncorrected["initial"]) > 1e-3


def test_bypass_mode_matches_recompute_when_rollout_and_trainer_agree(model_dir):
    """float64, no simulated mismatch: the rollout's log-probs equal the recomputed ones, so bypass mode gives
    the recomputing run's update. Measured here: max |old - rollout| = 0 and a weight difference of 0; the
    bound 1e-12 of the update leaves room for the round-off of a model whose decode loop and full forward
    round differently (float64 layout changes move the update by ~1e-15)."""
    normal = run(model_dir, [], shift=False)
    bypass = run(model_dir, BYPASS, shift=False)
    gap = max(
        float((n.old_log_probs - b.old_log_probs)[n.response_mask].abs().max())
        for n, b in zip(normal["batches"], bypass["batches"])
    )
    difference = relative_update_difference(bypass["weights"], normal["weights"], normal["initial"])
    print(f"bypass vs recompute: max |old - rollout| {gap:.2e}, update difference {difference:.2e}")
    assert gap <= 1e-12 and difference <= 1e-12
    for a, b in zip(normal["samples"], bypass["samples"]):
        assert [s.response_ids for s in a] == [s.response_ids for s in b]
    shared = set(bypass["records"][-1]) - {"timing_s/step"}
    for k in shared:
        if not k.startswith(("timing_s/", "perf/")):
            assert math.isclose(bypass["records"][-1][k], normal["records"][-1][k], rel_tol=1e-9, abs_tol=1e-12), k
