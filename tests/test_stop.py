"""Ctrl-C: a first one stops within seconds at a stop point (a decode step, an optimizer step, between
steps), discards the unfinished step, saves the run after the last finished step where that is exact,
and a rerun continues to the uninterrupted run's result, bitwise."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitproof.rl.checkpoint.resume import latest_checkpoint
from splitproof.rl.config.load import load_train_config
from splitproof.rl.loop import Interrupted
from splitproof.rl.tracking.loggers import read_metrics
from splitproof.rl.tracking.metrics import is_machine_dependent
from splitproof.rl.train import train

from .rl_helpers import save_tiny_char_model, train_overrides

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4
# no validation after step 0 (its decode steps would be stop points too), a checkpoint at the last step only
EXTRA = ["trainer.test_freq=0", "trainer.save_freq=4", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp64"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


@pytest.fixture(scope="module")
def whole(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    result = train(load_train_config(None, train_overrides(model_dir, out, STEPS, extra=EXTRA), on_notice=lambda m: 0))
    return result, out


def _same_result(out: Path, whole, steps: int = STEPS) -> None:
    result, whole_out = whole
    want = read_metrics(whole_out / "metrics.jsonl")
    got = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        keys = {k for k in b if not is_machine_dependent(k)}
        assert {k: a.get(k) for k in keys} == {k: b[k] for k in keys}, a["step"]
    from safetensors.torch import load_file

    a = load_file(out / f"global_step_{steps}" / "actor" / "model.safetensors")
    b = load_file(whole_out / f"global_step_{steps}" / "actor" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in b)


class _WishAt:
    """A stop wished from the first stop point of kind ``where`` ("decode_point" or "before_optimizer_step")
    reached after step ``after`` was trained."""

    def __init__(self, where: str, after: int):
        self.where, self.after, self.armed = where, after, False

    def on_step(self, step, output) -> None:
        self.armed = self.armed or step == self.after

    def __call__(self) -> bool:
        return self.armed and sys._getframe(1).f_code.co_name == self.where


@pytest.mark.parametrize("where, saved", [("decode_point", True), ("before_optimizer_step", False)])
def test_a_stop_inside_a_step_discards_it_and_resumes_to_the_same_result(where, saved, model_dir, whole, tmp_path):
    """Stopped in step 3's rollout, the run after step 2 is saved (exact: sampler and RNGs put back); stopped
    before one of its optimizer steps, nothing is saved. Either way the rerun ends where the whole run did."""
    out = tmp_path / "out"
    cfg = load_train_config(None, train_overrides(model_dir, out, STEPS, extra=EXTRA), on_notice=lambda m: 0)
    wish = _WishAt(where, 2)
    with pytest.raises(Interrupted) as stopped:
        train(cfg, stop_requested=wish, on_step=wish.on_step)
    stage = "rollout" if saved else "update"
    assert stopped.value.step == 2 and f"stopped in step 3's {stage}; step 3 is discarded" in str(stopped.value)
    assert ("saved global_step_2 at the stop" in str(stopped.value)) == saved
    assert latest_checkpoint(out) == (out / "global_step_2" if saved else None)
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    resumed = train(cfg)
    assert resumed.start_step == (2 if saved else 0)
    _same_result(out, whole)


def test_a_stop_between_steps_saves_the_last_finished_one(model_dir, whole, tmp_path):
    out = tmp_path / "out"
    cfg = load_train_config(None, train_overrides(model_dir, out, STEPS, extra=EXTRA), on_notice=lambda m: 0)
    asked = []  # the loop's checks after step 1 was trained: after it (0), before step 2 (1)

    def wish() -> bool:
        if asked and sys._getframe(1).f_code.co_name == "should_stop":
            asked.append(len(asked))
        return len(asked) > 2

    with pytest.raises(Interrupted, match=r"stopped after step 1 \(saved global_step_1 at the stop\)"):
        train(cfg, stop_requested=wish, on_step=lambda step, output: asked.append(step) if step == 1 else None)
    assert latest_checkpoint(out) == out / "global_step_1"
    assert train(cfg).start_step == 1
    _same_result(out, whole)


def test_sigint_mid_run_stops_within_seconds_and_resumes_to_the_same_result(model_dir, tmp_path):
    """A real Ctrl-C (SIGINT to `python -m splitproof train`) once step 1 is logged (of 12: the signal comes
    well before the end, even on a busy machine): exit 130 within seconds, saying where the run resumes; the
    rerun's metrics and final weights equal the whole run's."""
    steps, out, whole = 12, tmp_path / "out", tmp_path / "whole"
    train(load_train_config(None, train_overrides(model_dir, whole, steps, extra=EXTRA), on_notice=lambda m: 0))
    args = train_overrides(model_dir, out, steps, extra=EXTRA)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitproof", "train", *args], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or len(read_metrics(out / "metrics.jsonl")) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 1"
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    print(f"exit {time.monotonic() - sent:.2f} s after SIGINT; {err.strip().splitlines()[-1]}")
    assert time.monotonic() - sent < 20, "the stop took too long"
    # where the signal lands decides what is kept: in the rollout, step 1 is saved and the run resumes after it;
    # in the update, nothing is (no checkpoint yet) and the rerun starts over; either way the message says so
    assert "stopped after step" in err, err
    assert ("To resume: " in err and "so the run resumes after step" in err) or "rerunning starts over" in err, err
    done = subprocess.run(
        [sys.executable, "-m", "splitproof", "train", *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    _same_result(out, (None, whole), steps)


def test_ctrl_c_at_the_terminal_stops_a_pipelined_run_and_it_resumes_to_the_same_result(model_dir, tmp_path):
    """SIGINT to the whole process group (as a terminal sends it: the rollout process gets it too): exit 130,
    nothing saved at the stop (rollouts in flight), and the rerun ends as the uninterrupted pipelined run."""
    extra = [*EXTRA, "async_training.staleness_steps=1", "trainer.save_freq=2"]
    steps = 8  # the signal comes once step 3 is logged: steps remain after it, even on a busy machine
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    whole, out = tmp_path / "whole", tmp_path / "out"
    command = [sys.executable, "-m", "splitproof", "train"]
    done = subprocess.run(
        [*command, *train_overrides(model_dir, whole, steps, extra=extra)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    args = train_overrides(model_dir, out, steps, extra=extra)
    proc = subprocess.Popen([*command, *args], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 240
    while not (out / "metrics.jsonl").is_file() or len(read_metrics(out / "metrics.jsonl")) < 4:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 3"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert re.search(r"so the run resumes after step [24]\b", err), err  # the newest checkpoint: 2, or 4
    done = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    _same_result(out, (None, whole), steps)


def _stop_on_rank_0_in_step_3(model_dir, out):
    """One rank wishes a stop before one of step 3's optimizer steps; the ranks agree there, without a hang."""
    import torch.distributed as dist

    cfg = load_train_config(
        None,
        train_overrides(model_dir, out, STEPS, extra=[*EXTRA, "actor_rollout_ref.actor.strategy=ddp"]),
        on_notice=lambda m: 0,
    )
    wish = _WishAt("before_optimizer_step" if dist.get_rank() == 0 else "nowhere", 2)
    stopped = None
    try:
        train(cfg, stop_requested=wish, on_step=wish.on_step)
    except Interrupted as e:
        stopped = (e.step, str(e))
    resumed = train(cfg)
    return stopped, resumed.start_step, [r.get("critic/score/mean") for r in resumed.records]


@pytest.mark.dist
def test_a_stop_wished_on_one_rank_stops_every_rank_at_the_same_optimizer_step(model_dir, tmp_path):
    from splitproof.engine.launch import run_data_parallel

    ranks = run_data_parallel(_stop_on_rank_0_in_step_3, 2, model_dir, tmp_path / "out")
    assert [r[0][0] for r in ranks] == [2, 2]
    assert all("stopped in step 3's update; step 3 is discarded" in r[0][1] for r in ranks)
    assert [r[1] for r in ranks] == [0, 0] and ranks[0][2] == ranks[1][2]
