"""`torchrun --standalone --nproc_per_node 2 -m splitproof train ...` under DDP and FSDP2: a rank killed
mid-run takes the run down (no rank left waiting) and is named; the relaunch resumes from the last
checkpoint (FSDP2: written and read through torch.distributed.checkpoint) and ends with the one-process
run's weights and metrics (float64). PPO with a critic: the same, actor and critic."""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitproof.rl.config.load import load_train_config
from splitproof.rl.pause import PAUSE_AT, PAUSE_FILE, PAUSE_RANK
from splitproof.rl.tracking.loggers import read_metrics
from splitproof.rl.tracking.metrics import is_machine_dependent
from splitproof.rl.train import train

from .rl_helpers import PPO, final_weights, relative_update_difference, save_tiny_char_model, train_overrides

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node",
    "2",
    "-m",
    "splitproof",
    "train",
]
STEPS = 2
EVERY_STEP = ["trainer.save_freq=1", "trainer.test_freq=1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


def _args(model_dir, out, extra=()) -> list[str]:
    return train_overrides(model_dir, out, STEPS, dtype="fp64", extra=[*EVERY_STEP, *extra])


def _initial(model_dir) -> dict:
    """The float64 weights a run starts from: the actor's, and the critic's (its head seeded by trainer.seed 0)."""
    from transformers import AutoModelForCausalLM

    from splitproof.value_model import value_model_from_pretrained

    models = {
        "actor": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64),
        "critic": value_model_from_pretrained(model_dir, dtype=torch.float64, seed=0),
    }
    return {name: {k: v.double() for k, v in m.state_dict().items()} for name, m in models.items()}


@pytest.fixture(scope="module")
def one_process(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "out"
    result = train(load_train_config(None, _args(model_dir, out), on_notice=lambda m: None))
    return {
        "weights": final_weights(result.parts.actor.model),
        "records": read_metrics(out / "metrics.jsonl"),
        "initial": _initial(model_dir)["actor"],
    }


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_survives_a_dead_rank_resumes_and_matches_one_process(model_dir, one_process, tmp_path, strategy):
    out, marker = tmp_path / "out", tmp_path / "paused"
    args = _args(
        model_dir,
        out,
        [f"actor_rollout_ref.actor.strategy={strategy}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
    )
    pause = {PAUSE_AT: "step2:trained", PAUSE_RANK: "1", PAUSE_FILE: str(marker)}
    launcher = subprocess.Popen(
        [*TORCHRUN, *args], env=_env(**pause), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert launcher.poll() is None, launcher.stdout.read()
        assert time.monotonic() < deadline, "rank 1 never reached step 2"
        time.sleep(0.1)
    os.kill(int(marker.read_text().split()[0]), signal.SIGKILL)  # rank 1 dies; rank 0 waits on it
    report, _ = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert "rank      : 1" in report and "Signal 9 (SIGKILL)" in report, report

    resumed = subprocess.run([*TORCHRUN, *args], env=_env(), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stderr.count("resuming from") == 1  # rank 0 speaks
    weights = {
        k: v.double() for k, v in load_file(out / f"global_step_{STEPS}" / "actor" / "model.safetensors").items()
    }
    difference = relative_update_difference(weights, one_process["weights"], one_process["initial"])
    print(f"torchrun {strategy} (killed, resumed) vs one process: {difference:.2e} of the update")
    assert difference <= 1e-10
    records, want = read_metrics(out / "metrics.jsonl"), one_process["records"]
    assert [r["step"] for r in records] == [r["step"] for r in want] == [0, 1, 2]
    for a, b in zip(records, want):
        for key in (k for k in b if not is_machine_dependent(k)):
            assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-12), (a["step"], key)


def _saved(out: Path, model: str) -> dict:
    return {k: v.double() for k, v in load_file(out / f"global_step_{STEPS}" / model / "model.safetensors").items()}


@pytest.mark.dist
def test_torchrun_ppo_matches_one_process(model_dir, tmp_path):
    """PPO with a critic: a DDP actor and an FSDP2 critic on two ranks end with the one-process run's actor,
    critic and metrics (the critic's checkpoint written through DCP by both ranks)."""
    one, out = tmp_path / "one", tmp_path / "out"
    result = train(load_train_config(None, _args(model_dir, one, PPO), on_notice=lambda m: None))
    args = _args(
        model_dir,
        out,
        [
            *PPO,
            "actor_rollout_ref.actor.strategy=ddp",
            "critic.strategy=fsdp2",
            "critic.ppo_micro_batch_size_per_gpu=1",
        ],
    )
    done = subprocess.run([*TORCHRUN, *args], env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    initial = _initial(model_dir)
    for model, want in (
        ("actor", final_weights(result.parts.actor.model)),
        ("critic", final_weights(result.parts.critic.model)),
    ):
        difference = relative_update_difference(_saved(out, model), want, initial[model])
        print(f"torchrun PPO {model} vs one process: {difference:.2e} of the update")
        assert difference <= 1e-10
    records, want = read_metrics(out / "metrics.jsonl"), read_metrics(one / "metrics.jsonl")
    assert [r["step"] for r in records] == [r["step"] for r in want] == [0, 1, 2]
    for a, b in zip(records, want):
        for key in (k for k in b if not is_machine_dependent(k)):
            assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-12), (a["step"], key)


@pytest.mark.dist
def test_torchrun_user_mistake_stops_every_rank_with_one_message(model_dir, tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [*TORCHRUN, *_args(model_dir, out, [f"data.train_files={tmp_path}/missing.parquet"])],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("splitproof: error:")]
    want = f"splitproof: error: data.train_files: {tmp_path}/missing.parquet: prompt file not found"
    assert errors == [want], done.stderr
    exits = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\n\s+exitcode\s+: (-?\d+)", done.stderr))
    # torchrun's report: every rank left with the usage status, except that torchrun may stop the last one
    # (SIGTERM) in the instant between the first rank's exit and its own
    assert done.returncode != 0 and set(exits) == {"0", "1"} and "2" in exits.values(), done.stderr
    assert set(exits.values()) <= {"2", "-15"}, done.stderr
    assert not out.exists()
