"""Resume: a `splitproof train` process SIGKILLed anywhere (between steps, mid-step, mid-checkpoint, between
a step's record and its checkpoint) and relaunched ends with the uninterrupted run's weights, bitwise, and
its metrics.jsonl (the killed runs are forked children, the last one a fresh `python -m splitproof train`); a resume
under another layout (micro-batching, generation batch size, token budget,
DP size and strategy) continues the same float64 trajectory; a changed result-affecting key is refused."""

from __future__ import annotations

import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitproof.cli import main
from splitproof.engine.launch import run_data_parallel
from splitproof.rl.checkpoint.resume import TRACKER, is_complete, latest_checkpoint
from splitproof.rl.config.load import load_train_config
from splitproof.rl.pause import PAUSE_AT, PAUSE_FILE
from splitproof.rl.tracking.loggers import read_metrics
from splitproof.rl.tracking.metrics import is_machine_dependent
from splitproof.rl.train import SetupError, train

from .rl_helpers import LAYOUTS, PPO, final_weights, relative_update_difference, save_tiny_char_model, train_overrides

ROOT = Path(__file__).resolve().parents[1]
STEPS = 5
EVERY_2 = ["trainer.save_freq=2"]  # checkpoints at steps 2, 4 and 5 (the last); validation at 0, 2, 4, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


# ------------------------------------------------------------------------------- killed processes (CPU, bitwise)


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def _run_to_the_end(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m splitproof train ARGS` in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-m", "splitproof", "train", *args], env=_env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return done


def _train_paused_at(args: list[str], point: str, marker: str) -> None:
    os.environ.update({PAUSE_AT: point, PAUSE_FILE: marker})
    os._exit(main(["train", *args]))


def _kill_at(args: list[str], point: str, marker: Path) -> None:
    """Start `splitproof train ARGS` in a child process (forked: torch is already imported), wait until it
    sits at ``point``, SIGKILL it."""
    marker.unlink(missing_ok=True)
    proc = multiprocessing.get_context("fork").Process(target=_train_paused_at, args=(args, point, str(marker)))
    proc.start()
    deadline = time.monotonic() + 300
    while not marker.exists():
        assert proc.exitcode is None, f"the run ended (exit {proc.exitcode}) before {point}"
        assert time.monotonic() < deadline, f"never reached {point}"
        time.sleep(0.05)
    assert marker.read_text().split() == [str(proc.pid), point]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL


def _same_metrics(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for a, b in zip(got, want):
        keys = {k for k in b if not is_machine_dependent(k)}
        assert keys == {k for k in a if not is_machine_dependent(k)}
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]


# (where the process is killed, what is on disk then: the newest complete checkpoint)
# (test_checkpoint.py crashes a save after each of its stages; here the process itself is killed)
KILLS = [
    ("step3:reward", 2),  # mid-step: scoring step 3's samples
    ("step4:checkpoint:actor", 2),  # mid-checkpoint: model and optimizer written, the HF directory not yet
    ("step4:checkpoint:renamed", 2),  # mid-checkpoint: global_step_4 in place, the tracker file still names 2
    ("step4:done", 4),  # between steps
    ("step5:logged", 4),  # the last step's record written, its checkpoint not
]


@pytest.mark.slow
def test_killed_anywhere_and_resumed_equals_an_uninterrupted_run(model_dir, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *train_overrides(model_dir, whole, STEPS, extra=EVERY_2)]) == 0  # one thread, as the others
    args = train_overrides(model_dir, killed, STEPS, extra=EVERY_2)
    for point, newest in KILLS:
        _kill_at(args, point, tmp_path / "paused")
        assert latest_checkpoint(killed) == killed / f"global_step_{newest}", point
    assert (killed / TRACKER).read_text().strip() == "4"
    resumed = _run_to_the_end(args)
    assert "resuming from" in resumed.stderr and "global_step_4" in resumed.stderr

    _same_files(killed / f"global_step_{STEPS}", whole / f"global_step_{STEPS}", ["actor"])
    _same_metrics(read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl"))
    assert not [p.name for p in killed.iterdir() if p.name.startswith((".tmp-", ".trash-"))]


def _same_files(got: Path, want: Path, models: list[str]) -> None:
    """The saved weights of each model directory (actor/, critic/) are bitwise equal."""
    for model in models:
        a, b = load_file(got / model / "model.safetensors"), load_file(want / model / "model.safetensors")
        assert a.keys() == b.keys(), model
        for name in b:
            assert torch.equal(a[name], b[name]), (model, name)


# PPO: killed while the critic's half of checkpoint 2 is being written (the critic's HF directory not yet),
# then in the middle of step 3 (the newest checkpoint then is 2)
PPO_KILLS = [("step2:checkpoint:critic_state", 1), ("step3:reward", 2)]


@pytest.mark.slow
def test_ppo_killed_and_resumed_equals_an_uninterrupted_run(model_dir, tmp_path):
    """The critic's weights, optimizer, LR schedule and step count resume too (bitwise)."""
    from transformers import AutoModelForTokenClassification

    steps, extra = 3, [*PPO, "trainer.save_freq=1"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *train_overrides(model_dir, whole, steps, extra=extra)]) == 0
    args = train_overrides(model_dir, killed, steps, extra=extra)
    for point, newest in PPO_KILLS:
        _kill_at(args, point, tmp_path / "paused")
        assert latest_checkpoint(killed) == killed / f"global_step_{newest}", point
    assert "resuming from" in _run_to_the_end(args).stderr
    _same_files(killed / f"global_step_{steps}", whole / f"global_step_{steps}", ["actor", "critic"])
    _same_metrics(read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl"))
    critic = AutoModelForTokenClassification.from_pretrained(whole / f"global_step_{steps}" / "critic")
    assert critic.config.num_labels == 1 and type(critic).__name__ == "LlamaForTokenClassification"


# ------------------------------------------------------------------------------- another layout (float64)

FOUR = 4
# Clip-Cov draws its tokens with a hash of the optimizer step count: a resume that lost the count differs
CLIP_COV = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.2",
    "actor_rollout_ref.actor.policy_loss.clip_cov_lb=-10",
    "actor_rollout_ref.actor.policy_loss.clip_cov_ub=10",
]


def _config(model_dir, out, layout=(), steps=FOUR, extra=()):
    return load_train_config(
        None,
        train_overrides(model_dir, out, steps, dtype="fp64", extra=[*EVERY_2, *CLIP_COV, *layout, *extra]),
        on_notice=lambda m: None,
    )


def _outcome(result, out: Path) -> dict:
    outcome = {"weights": final_weights(result.parts.actor.model), "records": read_metrics(out / "metrics.jsonl")}
    if result.parts.critic is not None:
        outcome["critic_weights"] = final_weights(result.parts.critic.model)
    return outcome


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole") / "out"
    result = train(_config(model_dir, out))
    return {**_outcome(result, out), "initial": _initial(model_dir)}


def _initial(model_dir) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def stopped_at_2(model_dir, tmp_path_factory):
    """The same run stopped right after step 2's checkpoint (the folder to copy and resume)."""
    from splitproof.rl.loop import Interrupted

    out = tmp_path_factory.mktemp("stopped") / "out"
    with pytest.raises(Interrupted) as info:
        train(_config(model_dir, out), stop_requested=lambda: is_complete(out / "global_step_2"))
    assert info.value.step == 2
    return out


def _same_trajectory(got: dict, want: dict) -> None:
    difference = relative_update_difference(got["weights"], want["weights"], want["initial"])
    print(f"resumed vs uninterrupted: {difference:.2e} of the update")
    assert difference <= 1e-10
    if "critic_weights" in want:
        difference = relative_update_difference(got["critic_weights"], want["critic_weights"], want["critic_initial"])
        print(f"critic, resumed vs uninterrupted: {difference:.2e} of its update")
        assert difference <= 1e-10
    assert [r["step"] for r in got["records"]] == [r["step"] for r in want["records"]]
    for a, b in zip(got["records"], want["records"]):
        keys = {k for k in b if not is_machine_dependent(k)}
        assert keys == {k for k in a if not is_machine_dependent(k)}
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), (a["step"], k, a[k], b[k])


def _copy(stopped: Path, tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(stopped, out)
    return out


@pytest.mark.parametrize("layout", ["ones", "budget-packed"])
def test_resume_with_another_layout_continues_the_trajectory(model_dir, uninterrupted, stopped_at_2, tmp_path, layout):
    out = _copy(stopped_at_2, tmp_path)
    result = train(_config(model_dir, out, LAYOUTS[layout]))
    assert result.start_step == 2
    _same_trajectory(_outcome(result, out), uninterrupted)


def test_ppo_resume_with_another_layout_continues_the_trajectory(model_dir, tmp_path):
    """A PPO run stopped after checkpoint 2 and resumed with every micro-batch size 1 (actor, critic,
    log-prob and values passes) ends where the uninterrupted run ends, critic included."""
    from splitproof.rl.loop import Interrupted

    whole, out = tmp_path / "whole", tmp_path / "out"
    result = train(_config(model_dir, whole, extra=PPO))
    want = {**_outcome(result, whole), "initial": _initial(model_dir), "critic_initial": _initial_critic(model_dir)}
    with pytest.raises(Interrupted):
        train(_config(model_dir, out, extra=PPO), stop_requested=lambda: is_complete(out / "global_step_2"))
    resumed = train(_config(model_dir, out, LAYOUTS["ones"], extra=PPO))
    assert resumed.start_step == 2
    _same_trajectory(_outcome(resumed, out), want)


def _initial_critic(model_dir) -> dict:
    from splitproof.value_model import value_model_from_pretrained

    model = value_model_from_pretrained(model_dir, dtype=torch.float64, seed=0)
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}


def test_thread_count_is_a_speed_knob_restored_after_the_run(model_dir, uninterrupted, stopped_at_2, tmp_path):
    """trainer.cpu_threads=2 resumes a one-thread run's trajectory; torch's own setting comes back after."""
    before = torch.get_num_threads()
    seen = []
    out = _copy(stopped_at_2, tmp_path)
    result = train(
        _config(model_dir, out, ["trainer.cpu_threads=2"]), on_step=lambda *a, **k: seen.append(torch.get_num_threads())
    )
    assert result.start_step == 2 and seen and set(seen) == {2}
    assert torch.get_num_threads() == before
    _same_trajectory(_outcome(result, out), uninterrupted)


def _resume_data_parallel(model_dir, out, strategy):
    result = train(
        _config(
            model_dir,
            out,
            [f"actor_rollout_ref.actor.strategy={strategy}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"],
        )
    )
    return {"weights": final_weights(result.parts.actor.model), "start": result.start_step}


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_on_two_ranks_continues_the_trajectory(model_dir, uninterrupted, stopped_at_2, tmp_path, strategy):
    """A one-process checkpoint resumed by two DDP or FSDP2 ranks (the model and optimizer through DCP)."""
    out = _copy(stopped_at_2, tmp_path)
    ranks = run_data_parallel(_resume_data_parallel, 2, model_dir, out, strategy)
    records = read_metrics(out / "metrics.jsonl")
    for rank in ranks:
        assert rank["start"] == 2
        _same_trajectory({"weights": rank["weights"], "records": records}, uninterrupted)


def test_a_critic_cannot_resume_from_a_checkpoint_without_one(model_dir, stopped_at_2, tmp_path):
    out = _copy(stopped_at_2, tmp_path)
    with pytest.raises(SetupError, match=r"critic\.enable.*holds none"):
        train(_config(model_dir, out, extra=[*PPO, "trainer.resume_allow_config_change=true"]))


def test_changed_result_affecting_key_is_refused_by_name(model_dir, stopped_at_2, tmp_path, capsys):
    out = _copy(stopped_at_2, tmp_path)
    with pytest.raises(SetupError, match=r"actor_rollout_ref\.actor\.optim\.lr.*differs from the checkpoint"):
        train(_config(model_dir, out, extra=["actor_rollout_ref.actor.optim.lr=0.01"]))
    before = (out / "metrics.jsonl").read_text()
    args = train_overrides(
        model_dir, out, FOUR, dtype="fp64", extra=[*EVERY_2, *CLIP_COV, "actor_rollout_ref.rollout.n=2"]
    )
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "actor_rollout_ref.rollout.n" in err and "trainer.resume_allow_config_change" in err
    assert (out / "metrics.jsonl").read_text() == before
