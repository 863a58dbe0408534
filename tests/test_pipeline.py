"""Pipelined rollouts (async_training.staleness_steps = k): the trajectory is a function of the config,
never of timing — identical with random delays in generation and training and with another generation
batch size; with a policy that does not move, k = 1 generates exactly the synchronous run's tokens; the
lag is reported; a dead rollout process stops the run, named; a run killed with SIGKILL and resumed
(resume_mode=auto) continues the uninterrupted trajectory bitwise; tied weights travel once and stay tied.
float64, the tiny model (its output layer tied to its input embedding, as in the built-in model), few steps."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import time

import pytest
import torch

from splitproof.loss_config import ConfigError
from splitproof.rl.config.load import load_train_config
from splitproof.rl.loop import StepFailed, fit
from splitproof.rl.rollout.pipeline import batch_version
from splitproof.rl.rollout.worker import DELAY_ENV
from splitproof.rl.run import build_parts
from splitproof.rl.tracking.metrics import is_machine_dependent

from .rl_helpers import run_trajectory, save_tiny_char_model, trajectory_config

STEPS = 3
K1 = ["async_training.staleness_steps=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), tied=True)


@pytest.fixture(scope="module")
def k1(model_dir):
    return run_trajectory(trajectory_config(model_dir, STEPS, K1), versions=True)


def _tokens(out) -> list:
    return [[(s.uid, s.sample_index, s.response_ids, s.log_probs) for s in step] for step in out["samples"]]


def _metrics(out, drop=()) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not is_machine_dependent(k) and not k.startswith(drop)} for r in out["records"]
    ]


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


def test_the_rollout_process_generates_with_its_version_s_weights(k1):
    """Batch 3 comes from the weights after step 1, tied output layer included: generated again here, in
    the training process, from those weights, its tokens and log-probs are the rollout process's, bitwise."""
    from splitproof.hf_models import unwrap

    run, batch = k1["run"], k1["samples"][2]
    assert batch_version(3, 1) == 1
    policy = unwrap(run.actor.model)
    assert policy.lm_head.weight is policy.model.embed_tokens.weight
    _assert_generated_again(run, batch, k1["versions"][1], step=3)


def _assert_generated_again(run, batch, weights: dict, *, step: int) -> None:
    """``batch`` generated again in this process from ``weights`` (one torch thread, as the rollout
    process): the same tokens and log-probs, bitwise."""
    from splitproof.hf_models import unwrap

    policy = unwrap(run.actor.model)
    with torch.no_grad():
        for name, tensor in weights.items():
            policy.state_dict()[name].copy_(tensor)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the rollout process's
    try:
        again = run.generation.engine.generate(
            [(s.uid, s.sample_index, s.prompt_ids) for s in batch], run.generation.sampling, step=step
        )
    finally:
        torch.set_num_threads(threads)
    assert [(s.uid, s.sample_index, s.response_ids, s.log_probs) for s in again] == [
        (s.uid, s.sample_index, s.response_ids, s.log_probs) for s in batch
    ]


def test_tied_weights_travel_once_and_stay_tied(model_dir):
    """The buffer holds the tied embedding once; the rollout model, loaded untied or tied, ends tied, with
    the trainer's values."""
    from splitproof.hf_models import tiny_causal_lm
    from splitproof.rl.config.schema import ModelConfig
    from splitproof.rl.models.policy import load_policy
    from splitproof.rl.rollout.handover import aliases, copy_weights, shared_buffer, tie

    trainer = load_policy(ModelConfig(path=model_dir), dtype=torch.float64)
    with torch.no_grad():
        trainer.model.embed_tokens.weight.add_(1.0)  # an update: the output layer moves with it
    weights = trainer.state_dict()
    tied = aliases(weights)
    assert tied == {"lm_head.weight": "model.embed_tokens.weight"}
    buffer = shared_buffer(weights, tied)
    assert buffer.keys() == weights.keys() - {"lm_head.weight"}
    untied = tiny_causal_lm(
        vocab_size=trainer.config.vocab_size,
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        dtype=torch.float64,
    )
    for rollout in (load_policy(ModelConfig(path=model_dir), dtype=torch.float64), untied):
        tie(rollout, tied)
        copy_weights(rollout.state_dict(), buffer)
        assert rollout.lm_head.weight is rollout.model.embed_tokens.weight
        assert all(torch.equal(t, weights[n]) for n, t in rollout.state_dict().items())


def test_random_delays_and_generation_batch_size_change_nothing(model_dir, k1, monkeypatch):
    monkeypatch.setenv(DELAY_ENV, "0.3")  # the rollout process inherits it
    got = run_trajectory(trajectory_config(model_dir, STEPS, [*K1, "actor_rollout_ref.rollout.max_num_seqs=3"]))
    _assert_identical(got, k1)


@pytest.mark.slow
def test_a_policy_that_does_not_move_generates_the_synchronous_tokens(model_dir):
    """No actor update (trainer.critic_warmup past the last step): every version is the initial policy, so
    the rollout process must sample exactly the tokens (and log-probs) the synchronous step samples — the
    weights arrive whole, the streams are the step's — and every metric but the lag's is the same."""
    frozen = [f"trainer.critic_warmup={STEPS + 1}"]
    sync = run_trajectory(trajectory_config(model_dir, STEPS, frozen))
    pipelined = run_trajectory(trajectory_config(model_dir, STEPS, [*frozen, *K1]))
    _assert_identical(pipelined, sync, drop=("rollout/",))


def test_k0_is_the_synchronous_step():
    """staleness_steps = 0 starts no rollout process and leaves ``run.pipeline`` None: the step generates
    in-process, the code path of every synchronous run (which the other tests pin down)."""
    from types import SimpleNamespace

    from splitproof.rl.rollout.pipeline import pipelined

    run = SimpleNamespace(config=SimpleNamespace(async_training=SimpleNamespace(staleness_steps=0)), pipeline=None)
    children = multiprocessing.active_children()
    with pipelined(run, 0, None) as pipeline:
        assert pipeline is None and run.pipeline is None and multiprocessing.active_children() == children


def test_bad_staleness_is_named():
    def load(*overrides):
        return load_train_config(None, list(overrides), on_notice=lambda m: None)

    with pytest.raises(ConfigError, match=r"async_training.staleness_steps: must be an integer >= 0"):
        load("async_training.staleness_steps=-1")
    with pytest.raises(ConfigError, match=r"async_training.staleness_steps.*remax"):
        load("async_training.staleness_steps=1", "algorithm.adv_estimator=remax")
    assert load("async_training.staleness_steps=2").async_training.staleness_steps == 2


def test_a_checkpoint_without_the_rollouts_in_flight_is_refused_before_any_model():
    from splitproof.rl.rollout.pipeline import check_resumable

    def state(*steps):
        return {"staleness_steps": 1, "batches": [{"step": s} for s in steps]}

    check_resumable(None, 0, 4, 1)  # a fresh start
    check_resumable(state(3, 4), 2, 4, 1)  # batches 3 and 4 in flight at step 2
    check_resumable(state(), 4, 4, 1)  # a finished run
    with pytest.raises(ConfigError, match=r"async_training.staleness_steps: the checkpoint at step 2 holds no"):
        check_resumable(None, 2, 4, 1)  # written with k = 0
    with pytest.raises(ConfigError, match=r"trainer.total_training_steps: .* batch 5 would need weights"):
        check_resumable(state(), 4, 6, 1)  # a finished pipelined run extended


def test_a_dead_rollout_process_stops_the_run_named(model_dir):
    run = build_parts(trajectory_config(model_dir, STEPS, K1))
    killed = []

    def rollout_processes():
        return [p for p in multiprocessing.active_children() if p.name == "splitproof-rollout-rank0"]

    def kill_rollout_process(step, output):
        if step == 1:
            (process,) = rollout_processes()
            killed.append(process.pid)
            os.kill(process.pid, signal.SIGKILL)

    with pytest.raises(
        StepFailed,
        match=r"step [23]: the rollout process splitproof-rollout-rank0 \(pid \d+\) died "
        r"with exit code -9",
    ):
        fit(run, on_step=kill_rollout_process)
    assert killed and not rollout_processes()  # the loop let go of it


# ------------------------------------------------------------------------------- kill -9 and resume_mode=auto


def _train_paused_at(args: list[str], point: str, marker: str) -> None:
    from splitproof.cli import main
    from splitproof.rl.pause import PAUSE_AT, PAUSE_FILE

    os.environ.update({PAUSE_AT: point, PAUSE_FILE: marker})
    os._exit(main(["train", *args]))


@pytest.mark.slow
def test_killed_and_resumed_continues_the_pipelined_trajectory(model_dir, tmp_path):
    """SIGKILL in step 3 (its batch taken, the next one in flight); the newest checkpoint (step 2) holds the
    batches in flight then (3 and 4); the relaunch ends with the uninterrupted run's weights and metrics."""
    from safetensors.torch import load_file

    from splitproof.cli import main
    from splitproof.rl.checkpoint.resume import latest_checkpoint
    from splitproof.rl.tracking.loggers import read_metrics

    from .rl_helpers import train_overrides

    def args(out):
        return train_overrides(model_dir, out, 4, dtype="fp64", extra=[*K1, "trainer.save_freq=2"])

    whole, killed, marker = tmp_path / "whole", tmp_path / "killed", tmp_path / "paused"
    assert main(["train", *args(whole)]) == 0
    proc = multiprocessing.get_context("fork").Process(
        target=_train_paused_at, args=(args(killed), "step3:trained", str(marker))
    )
    proc.start()
    deadline = time.monotonic() + 600
    while not marker.exists():
        assert proc.exitcode is None and time.monotonic() < deadline, "never reached step 3"
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert latest_checkpoint(killed) == killed / "global_step_2"
    assert main(["train", *args(killed)]) == 0  # resume_mode=auto

    a = load_file(killed / "global_step_4" / "actor" / "model.safetensors")
    b = load_file(whole / "global_step_4" / "actor" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in b)
    got, want = read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert [{k: v for k, v in r.items() if not is_machine_dependent(k)} for r in got] == [
        {k: v for k, v in r.items() if not is_machine_dependent(k)} for r in want
    ]
    assert [r["rollout/param_version"] for r in want if r["step"] > 0] == [0, 0, 1, 2]


# ------------------------------------------------------------------------------- torchrun: one rollout process per rank


@pytest.mark.dist
def test_two_ranks_continue_the_one_process_pipelined_trajectory(model_dir, tmp_path):
    """torchrun with 2 ranks (DDP), each with its own rollout process generating its share of every batch,
    against one process: the same float64 trajectory (weights within 1e-10 of the update, metrics 1e-9)."""
    import math
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from splitproof.rl.tracking.loggers import read_metrics
    from splitproof.rl.train import train

    from .rl_helpers import relative_update_difference, train_overrides

    def args(out, extra=()):
        return train_overrides(model_dir, out, STEPS, dtype="fp64", extra=[*K1, "trainer.save_freq=3", *extra])

    one, two = tmp_path / "one", tmp_path / "two"
    train(load_train_config(None, args(one), on_notice=lambda m: None))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "splitproof",
            "train",
            *args(two, ["actor_rollout_ref.actor.strategy=ddp"]),
        ],
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    def weights(out):
        return {
            k: v.double() for k, v in load_file(out / f"global_step_{STEPS}" / "actor" / "model.safetensors").items()
        }

    from transformers import AutoModelForCausalLM

    initial = {
        k: v.double()
        for k, v in AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict().items()
    }
    difference = relative_update_difference(weights(two), weights(one), initial)
    print(f"pipelined, 2 ranks vs one process: {difference:.2e} of the update")
    assert difference <= 1e-10
    got, want = read_metrics(two / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        for key in (k for k in b if not is_machine_dependent(k)):
            assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-12), (a["step"], key)


@pytest.mark.dist
def test_a_dead_rollout_process_under_torchrun_stops_every_rank(model_dir, tmp_path):
    """Rank 1's rollout process dies (SIGKILL) when asked for batch 4; the checkpoint after step 2, which
    waits for batches 3 and 4, fails on both ranks with the process named; global_step_1 stays the newest;
    every rank exits non-zero."""
    import subprocess
    import sys
    from pathlib import Path

    from splitproof.rl.checkpoint.resume import latest_checkpoint
    from splitproof.rl.rollout.worker import DIE_AT_ENV, DIE_RANK_ENV

    from .rl_helpers import train_overrides

    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[1]
    args = train_overrides(
        model_dir, out, 4, dtype="fp64", extra=[*K1, "trainer.save_freq=1", "actor_rollout_ref.actor.strategy=ddp"]
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "splitproof",
            "train",
            *args,
        ],
        env=dict(os.environ, PYTHONPATH=str(root), **{DIE_AT_ENV: "4", DIE_RANK_ENV: "1"}),
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = done.stdout + done.stderr
    assert done.returncode != 0
    assert "the rollout process splitproof-rollout-rank1" in report and "died with exit code -9" in report, report
    assert "step 2:" in report and "checkpoint not saved" in report, report
    # torchrun's report: every rank failed (status 1; torchrun may stop the last one with SIGTERM first)
    exits = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", done.stderr))
    assert set(exits) == {"0", "1"} and "1" in exits.values() and set(exits.values()) <= {"1", "-15"}, report
    assert latest_checkpoint(out) == out / "global_step_1"


def test_a_dead_rollout_process_s_error_is_the_last_thing_on_stderr(model_dir, tmp_path):
    """`splitproof train` whose rollout process dies (SIGKILL when asked for batch 2): exit 1, the error line
    last on stderr — no progress bar of the rollout process's weight loading before it, no resource tracker
    warning of a leaked semaphore after it (the stderr pipe is read until every writer, the tracker
    included, has closed it)."""
    import subprocess
    import sys
    from pathlib import Path

    from splitproof.rl.rollout.worker import DIE_AT_ENV

    from .rl_helpers import train_overrides

    root = Path(__file__).resolve().parents[1]
    args = train_overrides(
        model_dir, tmp_path / "out", 3, extra=[*K1, "data.val_files=null", "trainer.val_before_train=false"]
    )
    done = subprocess.run(
        [sys.executable, "-m", "splitproof", "train", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(root), **{DIE_AT_ENV: "2"}),
        timeout=600,
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 1, done.stderr
    # step 1 or 2: batch 1's answer may die with the process, unsent
    assert re.match(r"splitproof: error: step [12]: the rollout process .* died", lines[-1]), lines
    assert "Loading weights" not in done.stderr and "leaked" not in done.stderr, done.stderr


LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.model.target_modules=all-linear",
]


def test_lora_the_rollout_process_holds_the_adapter(model_dir):
    """LoRA with staleness_steps=1: the rollout process holds the trainer's PEFT model; batch 3 (the weights
    after step 1, the adapter moved) generated again here from those weights is the rollout process's,
    bitwise, and the lag is the config's."""
    from splitproof.hf_models import unwrap
    from splitproof.lora import is_lora

    out = run_trajectory(trajectory_config(model_dir, STEPS, [*K1, *LORA]), versions=True)
    run, batch = out["run"], out["samples"][2]
    assert [r["rollout/param_version"] for r in out["records"]] == [0, 0, 1]
    assert out["records"][0]["rollout_corr/kl"] == 0.0 and out["records"][2]["rollout_corr/kl"] != 0.0
    moved = [k for k in out["initial"] if not torch.equal(out["versions"][1][k], out["initial"][k])]
    assert moved and all("lora_" in k for k in moved)  # only the adapter trains
    assert is_lora(unwrap(run.actor.model))
    _assert_generated_again(run, batch, out["versions"][1], step=3)
