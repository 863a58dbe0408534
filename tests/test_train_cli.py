"""`splitproof train` as a user meets it: a run's outputs, user mistakes (one line, exit 2, nothing loaded
or written), a reward function failing mid-run, Ctrl-C, the resume command it prints."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
from pathlib import Path

import pytest
import yaml

from splitproof.cli import main
from splitproof.cli.train import resume_command
from splitproof.engine.launch import run_data_parallel
from splitproof.rl import run as run_module
from splitproof.rl.checkpoint.resume import is_complete, latest_checkpoint
from splitproof.rl.tracking.loggers import read_metrics

from .rl_helpers import assert_usage_error, save_tiny_char_model, train_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def finished(model_dir, tmp_path_factory):
    """A 3-step run with a checkpoint every 2 steps (so at 2 and at the last step, 3)."""
    out = tmp_path_factory.mktemp("run") / "out"
    code = main(["train", *train_overrides(model_dir, out, 3, extra=["trainer.save_freq=2"])])
    return code, out


def test_a_run_writes_metrics_checkpoints_and_curve(finished):
    code, out = finished
    assert code == 0
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert "val-core/addition/reward/mean@1" in records[0] and "val-core/addition/reward/mean@1" in records[2]
    for name in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "timing_s/gen", "timing_s/step"):
        assert name in records[1], name
    assert "timing_s/testing" in records[2] and "timing_s/testing" not in records[1]  # evaluation steps only
    assert sorted(p.name for p in out.glob("global_step_*")) == ["global_step_2", "global_step_3"]
    assert latest_checkpoint(out) == out / "global_step_3"
    assert (out / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rerunning_a_finished_run_does_nothing(finished, model_dir, monkeypatch, capsys):
    """It says so and how to go on, loads no model and touches no file."""
    _, out = finished
    before = {
        name: ((out / name).read_bytes(), (out / name).stat().st_mtime_ns) for name in ("metrics.jsonl", "curve.png")
    }
    _no_model(monkeypatch)
    assert main(["train", *train_overrides(model_dir, out, 3, extra=["trainer.save_freq=2"])]) == 0
    err = capsys.readouterr().err
    assert "the run is complete" in err and "To train further: trainer.total_training_steps=N with N > 3" in err
    assert "done: the run was already complete at step 3; nothing written" in err
    assert {name: ((out / name).read_bytes(), (out / name).stat().st_mtime_ns) for name in before} == before


def test_a_finished_runs_rerun_imports_no_torch(finished, model_dir):
    """Answered from the checkpoint's files (start-up time): no torch, transformers or numpy imported."""
    import subprocess
    import sys

    args = train_overrides(model_dir, finished[1], 3, extra=["trainer.save_freq=2"])
    code = (
        f"import sys; from splitproof.cli import main; code = main(['train', *{args!r}]); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules); "
        "print(code, heavy, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.stderr.strip().splitlines()[-1] == "0 []", done.stderr
    assert "the run is complete" in done.stderr


def test_the_default_run_keeps_a_final_checkpoint():
    """The README's `splitproof train` is resumable: its recipe saves, at the last step too."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import is_due

    for steps in ([], ["trainer.total_training_steps=7"]):
        trainer = load_train_config(None, steps).trainer
        total = trainer.total_training_steps
        assert trainer.save_freq > 0 and is_due(total, total, trainer.save_freq)


def test_val_only_on_a_finished_run_records_nothing(finished, model_dir, tmp_path, capsys):
    """The evaluation is shown; metrics.jsonl and curve.png stay as the run left them, and extending the run
    afterwards gives the steps of an uninterrupted run (no second record of a step)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished[1], out)
    before = {name: (out / name).read_bytes() for name in ("metrics.jsonl", "curve.png")}
    args = train_overrides(model_dir, out, 3, extra=["trainer.save_freq=2"])
    assert main(["train", *args, "trainer.val_only=true", "trainer.logger=[console,file]"]) == 0
    captured = capsys.readouterr()
    assert "step 3/3" in captured.out and "held-out" in captured.out
    assert "done: evaluated the weights of step 3 (trainer.val_only; nothing written)" in captured.err
    assert {name: (out / name).read_bytes() for name in before} == before
    assert main(["train", *train_overrides(model_dir, out, 4, extra=["trainer.save_freq=2"])]) == 0
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    err = capsys.readouterr().err
    assert "starting over" not in err and f"wrote {out / 'metrics.jsonl'}, {out / 'curve.png'}" in err
    assert main(["train", *train_overrides(model_dir, out, 1), "trainer.resume_mode=disable"]) == 0
    assert f"starting over (trainer.resume_mode=disable): {out / 'metrics.jsonl'}" in capsys.readouterr().err


def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)


def _data_file(tmp_path, rows, name="rows.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MISTAKES = {
    "unknown key": (["data.train_batch_sise=4"], ["data.train_batch_sise", "data.train_batch_size"]),
    "unsupported verl key": (["algorithm.use_pf_ppo=true"], ["not supported"]),
    "wrong value": (["actor_rollout_ref.rollout.n=0"], ["actor_rollout_ref.rollout.n", ">= 1"]),
    "wrong type": (["data.train_batch_size=many"], ["data.train_batch_size", "integer"]),
    "minibatch does not divide": (["actor_rollout_ref.actor.ppo_mini_batch_size=3"], ["ppo_mini_batch_size", "divide"]),
    "batch larger than the data": (["data.train_max_samples=3"], ["train_batch_size", "3 prompts"]),
    "missing data file": (["data.train_files={tmp}/nowhere.parquet"], ["nowhere.parquet"]),
    "missing prompt column": (["data.prompt_key=question"], ["'question'"]),
    "bad reward path": (["custom_reward_function.path={tmp}/no_reward.py"], ["no_reward.py", "not found"]),
    "bad reward name": (["custom_reward_function.name=nothing_here"], ["nothing_here"]),
    "unknown data source": (
        ["data.train_files={mystery}", "custom_reward_function.path=null", "custom_reward_function.name=null"],
        ["mystery"],
    ),
    "output directory under a file": (
        ["trainer.default_local_dir={tmp}/a_file/out"],
        ["trainer.default_local_dir", "not a directory"],
    ),
    "output directory unwritable": (["trainer.default_local_dir=/proc/splitproof/out"], ["trainer.default_local_dir"]),
    "model directory without a model": (["actor_rollout_ref.model.path={tmp}"], ["actor_rollout_ref.model.path"]),
    "critic model missing": (
        ["algorithm.adv_estimator=gae", "critic.model.path={tmp}/no_critic"],
        ["critic.model.path", "not a local directory"],
    ),
    "critic directory without a model": (
        ["algorithm.adv_estimator=gae", "critic.model.path={tmp}"],
        ["critic.model.path"],
    ),
    "critic minibatch does not divide": (
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=3"],
        ["critic.ppo_mini_batch_size", "divide"],
    ),
    "rollout correction without rollout log-probs": (
        ["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.rollout.calculate_log_probs=false"],
        ["actor_rollout_ref.rollout.calculate_log_probs"],
    ),
    "filter metric the reward does not produce": (
        ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=nope"],
        ["algorithm.filter_groups.metric", "'nope'", "not produced"],
    ),
    "generation batch smaller than a step": (
        ["algorithm.filter_groups.enable=true", "data.gen_batch_size=2"],
        ["data.gen_batch_size", "smaller than data.train_batch_size"],
    ),
    "overlong buffer longer than the responses": (
        [
            "reward.reward_manager.name=dapo",
            "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
            "+reward.reward_kwargs.overlong_buffer_cfg.len=8",
            "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1",
            "+reward.reward_kwargs.max_resp_len=8",
        ],
        ["overlong_buffer_cfg.len", "longer than data.max_response_length"],
    ),
    "reward manager not implemented": (["reward_model.reward_manager=prime"], ["reward_model.reward_manager", "prime"]),
    "resume from nothing": (
        ["trainer.resume_mode=resume_path", "trainer.resume_from_path={tmp}/nowhere"],
        ["trainer.resume_from_path", "does not exist"],
    ),
}


@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_user_mistakes_are_one_line_and_exit_2_before_any_work(mistake, model_dir, tmp_path, monkeypatch, capsys):
    overrides, words = MISTAKES[mistake]
    (tmp_path / "a_file").write_text("")
    mystery = _data_file(tmp_path, [{"prompt": "1+1=", "data_source": "mystery"}] * 4)
    out = tmp_path / "out"
    _no_model(monkeypatch)
    filled = [o.format(tmp=tmp_path, mystery=mystery) for o in overrides]
    code = main(["train", *train_overrides(model_dir, out, 2), *filled])
    assert_usage_error(code, capsys.readouterr().err, words, out)


def test_missing_logger_backend_is_exit_2(model_dir, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    _no_model(monkeypatch)
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 2), "trainer.logger=[console,wandb]"])
    assert code == 2
    assert "trainer.logger" in capsys.readouterr().err and not out.exists()


def test_wandb_without_credentials_is_one_line_exit_2_before_any_work(model_dir, tmp_path, monkeypatch, capsys):
    from splitproof.rl.tracking.loggers import wandb_can_log

    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.com login u password p\n")
    monkeypatch.setenv("NETRC", str(netrc))
    _no_model(monkeypatch)
    out = tmp_path / "out"
    assert main(["train", *train_overrides(model_dir, out, 2), "trainer.logger=[console,wandb]"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("splitproof: notice:")]
    assert len(lines) == 1 and "trainer.logger" in lines[0], lines
    assert "wandb login" in lines[0] and "WANDB_MODE=offline" in lines[0]
    assert not out.exists()
    netrc.write_text("machine api.wandb.ai\n  login user\n  password 0123\n")
    assert wandb_can_log()
    assert wandb_can_log({"WANDB_MODE": "offline", "NETRC": str(tmp_path / "none")})
    assert not wandb_can_log({"NETRC": str(tmp_path / "none")})


def test_errors_about_values_you_did_not_set_name_their_origin(tmp_path, monkeypatch, capsys):
    """The built-in model on data of your own: verl's batch and lengths, each error saying where its value
    came from, before any model is loaded."""
    rows = _data_file(
        tmp_path, [{"prompt": f"{i}+1=", "data_source": "addition", "ground_truth": str(i + 1)} for i in range(6)]
    )
    _no_model(monkeypatch)
    out = tmp_path / "out"
    base = ["train", f"data.train_files={rows}", f"trainer.default_local_dir={out}"]
    for extra, words in (
        (
            [],
            "(data.max_prompt_length=512 is verl's default; data.max_response_length=512 is "
            "verl's default; actor_rollout_ref.model.path=builtin://charlm is splitproof's default",
        ),
        (
            ["data.max_prompt_length=8", "data.max_response_length=4"],
            "fewer than one batch of 1024 (data.train_batch_size) (data.train_batch_size=1024 is verl's default)",
        ),
    ):
        assert main([*base, *extra]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("splitproof: notice:")]
        assert len(lines) == 1 and words in lines[0], lines
    assert not out.exists()


def test_print_config_imports_no_torch():
    """What --print-config needs is the config alone: no torch, transformers or numpy (start-up time)."""
    import subprocess
    import sys

    code = (
        "import sys; from splitproof.cli import main; code = main(['train', '--print-config']); "
        "heavy = sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules); "
        "print(code, heavy, file=sys.stderr)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.stderr.strip().splitlines()[-1] == "0 []", done.stderr


def test_print_config_prints_yaml_and_writes_nothing(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--print-config", *train_overrides(model_dir, out, 2)]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["train_batch_size"] == 4
    assert printed["trainer"]["default_local_dir"] == str(out)
    assert not out.exists()


def test_reward_failure_mid_run_keeps_the_last_checkpoint(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    monkeypatch.setenv("STEP_REWARD_FAIL_AT", "3")
    code = main(["train", *train_overrides(model_dir, out, 4, extra=["trainer.save_freq=1"])])
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("splitproof: notice:")]
    assert code == 1
    assert len(err) == 1 and err[0].startswith("splitproof: error: step 3: "), err
    assert "reward function graded (" in err[0] and "raised ValueError: cannot score step 3" in err[0]
    assert "(uid=" in err[0] and "global_step_2" in err[0]
    assert latest_checkpoint(out) == out / "global_step_2" and is_complete(out / "global_step_2")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("global_step", ".tmp"))) == [
        "global_step_1",
        "global_step_2",
    ]
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]


def test_ctrl_c_stops_between_stages_and_says_how_to_resume(model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    args = train_overrides(model_dir, out, 4, extra=["trainer.save_freq=2"])
    monkeypatch.setenv("STEP_REWARD_INTERRUPT_AT", "3")
    assert main(["train", *args]) == 130
    err = capsys.readouterr().err
    assert "stopped after step 2" in err and str(out / "global_step_2") in err
    command = err.split("To resume: ", 1)[1].strip().splitlines()[0]
    assert command == "splitproof train " + shlex.join(args)
    assert latest_checkpoint(out) == out / "global_step_2"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2]
    monkeypatch.delenv("STEP_REWARD_INTERRUPT_AT")
    assert main(["train", *shlex.split(command)[2:]]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]


def test_resume_command_turns_resume_on(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert resume_command(["a=1"], "auto") == "splitproof train a=1"
    assert (
        resume_command(["trainer.resume_mode=disable", "b=x y"], "disable")
        == "splitproof train 'b=x y' trainer.resume_mode=auto"
    )
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert resume_command([], "auto").startswith("torchrun --standalone --nproc_per_node 2 -m splitproof train")


def test_readme_first_command_trains():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    first = readme.split("```bash\n", 1)[1].split("\n", 1)[0]
    assert first.endswith("&& .venv/bin/splitproof train")
    assert "splitproof diagnose" in readme.split("Run the tests", 1)[0]


def _fail_on_rank_1(model_dir, out):
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import StepFailed
    from splitproof.rl.train import train

    os.environ.update(STEP_REWARD_FAIL_AT="2", STEP_REWARD_FAIL_RANK="1")  # a forked worker's own environment
    cfg = load_train_config(
        None, train_overrides(model_dir, out, 3, extra=["trainer.save_freq=1", "actor_rollout_ref.actor.strategy=ddp"])
    )
    try:
        train(cfg)
    except StepFailed as e:
        return e.step, str(e)
    return None


@pytest.mark.dist
def test_a_reward_failing_on_one_rank_stops_every_rank(model_dir, tmp_path):
    out = tmp_path / "out"
    ranks = run_data_parallel(_fail_on_rank_1, 2, model_dir, out)
    assert [step for step, _ in ranks] == [2, 2]
    assert all("reward function graded" in message and "cannot score step 2" in message for _, message in ranks)
    assert latest_checkpoint(out) == out / "global_step_1"
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
