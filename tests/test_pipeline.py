"""Pipelined rollouts (async_training.staleness_steps = k): the trajectory is a function of the config,
never of timing — identical with random delays in generation and training and with another generation
batch size; with a policy that does not move, k = 1 generates exactly the synchronous run's tokens; the
lag is reported; a dead rollout process stops the run, named; a run killed with SIGKILL and resumed
(resume_mode=auto) continues the uninterrupted trajectory bitwise. float64, the tiny model, few steps."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from splitproof.loss_config import ConfigError
from splitproof.rl.config.load import load_train_config
from splitproof.rl.loop import StepFailed, fit
from splitproof.rl.rollout.pipeline import batch_version
from splitproof.rl.rollout.worker import DELAY_ENV
from splitproof.rl.run import build_run
from splitproof.rl.tracking.metrics import is_machine_dependent

from .rl_helpers import final_weights, run_trajectory, save_tiny_char_model, trajectory_config

STEPS = 3
K1 = ["async_training.staleness_steps=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def k1(model_dir):
    return run_trajectory(trajectory_config(model_dir, STEPS, K1))


def _tokens(out) -> list:
    return [[(s.uid, s.index, s.response_ids, s.log_probs) for s in step] for step in out["samples"]]


def _metrics(out, drop=()) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_machine_dependent(k) and not k.startswith(drop)}
            for r in out["records"]]


def _assert_identical(got, want, drop=()) -> None:
    assert _tokens(got) == _tokens(want)
    assert all(torch.equal(got["weights"][k], want["weights"][k]) for k in want["weights"])
    assert _metrics(got, drop) == _metrics(want, drop)


def test_the_lag_is_the_config_s(k1):
    """Batch s comes from the weights after step max(0, s - 2); the mismatch KL shows it (0 at step 1, where
    the rollout and training policies are the same weights in two processes)."""
    records = k1["records"]
    assert [r["rollout/param_version"] for r in records] == [batch_version(s, 1) for s in (1, 2, 3)] == [0, 0, 1]
    assert [r["rollout/staleness"] for r in records] == [0, 1, 1]
    assert records[0]["rollout_corr/kl"] == 0.0
    assert all(r["rollout_corr/kl"] != 0.0 for r in records[1:])
    assert k1["weights"].keys() and any(not torch.equal(k1["weights"][k], k1["initial"][k]) for k in k1["initial"])


def test_random_delays_and_generation_batch_size_change_nothing(model_dir, k1, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.3")  # the rollout process inherits it
    got = run_trajectory(trajectory_config(model_dir, STEPS, [*K1, "actor_rollout_ref.rollout.max_num_seqs=3"]))
    _assert_identical(got, k1)


@pytest.mark.slow
def test_a_policy_that_does_not_move_generates_the_synchronous_tokens(model_dir):
    """lr = 0: every version is the initial policy, so the rollout process must sample exactly the tokens
    (and log-probs) the synchronous step samples: the weights arrive whole, the streams are the step's."""
    frozen = ["actor_rollout_ref.actor.optim.lr=0", "actor_rollout_ref.actor.optim.weight_decay=0"]
    sync = run_trajectory(trajectory_config(model_dir, STEPS, frozen))
    pipelined = run_trajectory(trajectory_config(model_dir, STEPS, [*frozen, *K1]))
    _assert_identical(pipelined, sync, drop=("rollout/",))


def test_bad_staleness_is_named():
    def load(*overrides):
        return load_train_config(None, list(overrides), on_notice=lambda m: None)

    with pytest.raises(ConfigError, match=r"async_training.staleness_steps: must be an integer >= 0"):
        load("async_training.staleness_steps=-1")
    with pytest.raises(ConfigError, match=r"async_training.staleness_steps.*remax"):
        load("async_training.staleness_steps=1", "algorithm.adv_estimator=remax")
    assert load("async_training.staleness_steps=2").async_training.staleness_steps == 2


def test_a_dead_rollout_process_stops_the_run_named(model_dir):
    run = build_run(trajectory_config(model_dir, STEPS, K1))
    killed = []

    def kill_rollout_process(step, output):
        if step == 1:
            killed.append(run.pipeline.process.pid)
            os.kill(run.pipeline.process.pid, signal.SIGKILL)

    with pytest.raises(StepFailed, match=r"step [23]: the rollout process splitproof-rollout-rank0 \(pid \d+\) died "
                                         r"with exit code -9"):
        fit(run, on_step=kill_rollout_process)
    assert killed and run.pipeline is None  # the loop let go of it
