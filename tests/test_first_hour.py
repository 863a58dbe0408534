"""What a verl user meets in the first hour: verl's infrastructure keys beside a later mistake, errors in
a useful order, verl's data keys honoured."""

from __future__ import annotations

import fnmatch

import pytest
import torch

from splitproof.cli import main
from splitproof.rl import run as run_module
from splitproof.rl.config import verl_keys

from .rl_helpers import assert_usage_error, save_tiny_char_model, train_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)


def _one_key_per_no_effect_pattern() -> list[str]:
    """A verl key for each pattern of ``verl_keys.NO_EFFECT`` (the whole accepted-with-no-effect list)."""
    names = sorted(verl_keys.verl_keys())
    return [next(k for k in names if fnmatch.fnmatchcase(k, pattern)) for pattern in verl_keys.NO_EFFECT]


NO_EFFECT_KEYS = _one_key_per_no_effect_pattern()
BROKEN_REWARD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None:\n    return 1\n"


def test_every_no_effect_pattern_names_a_verl_key():
    assert len(NO_EFFECT_KEYS) == len(verl_keys.NO_EFFECT)
    for key in (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "trainer.n_gpus_per_node",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
    ):
        assert verl_keys.classify(key, 1) == "no_effect", key


@pytest.mark.parametrize("key", NO_EFFECT_KEYS)
def test_a_no_effect_key_beside_a_later_mistake_gives_that_mistakes_line(key, model_dir, tmp_path, monkeypatch, capsys):
    """verl's infrastructure keys are accepted with a notice; the mistake found after them (a reward file
    that does not import, found with the data) is its own one line."""
    _no_model(monkeypatch)
    out = tmp_path / "out"
    broken = tmp_path / "broken_reward.py"
    broken.write_text(BROKEN_REWARD)
    code = main(["train", *train_overrides(model_dir, out, 2), f"{key}=2", f"custom_reward_function.path={broken}"])
    err = capsys.readouterr().err
    assert_usage_error(code, err, ["broken_reward.py"], out)
    assert f"splitproof: notice: {key}: no effect" in err


VERL_SCRIPT_KEYS = [
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "trainer.n_gpus_per_node=8",
    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
    "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
]


@pytest.mark.parametrize("mistake", ["missing data file", "reward syntax error"])
def test_a_verl_scripts_infrastructure_keys_leave_the_mistake_its_line(
    mistake, model_dir, tmp_path, monkeypatch, capsys
):
    _no_model(monkeypatch)
    broken = tmp_path / "broken_reward.py"
    broken.write_text(BROKEN_REWARD)
    extra, words = {
        "missing data file": ([f"data.train_files={tmp_path}/nowhere.parquet"], ["nowhere.parquet"]),
        "reward syntax error": ([f"custom_reward_function.path={broken}"], ["broken_reward.py"]),
    }[mistake]
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 2), *VERL_SCRIPT_KEYS, *extra])
    assert_usage_error(code, capsys.readouterr().err, words, out)


@pytest.mark.parametrize("tokenizer_in", ["adapter", "base"])
def test_export_writes_the_tokenizer(tokenizer_in, model_dir, tmp_path, capsys):
    """`splitproof export` writes a folder AutoTokenizer loads: the adapter's tokenizer, else the base's."""
    import shutil

    from transformers import AutoTokenizer

    from splitproof.hf_models import load_causal_lm
    from splitproof.lora import LoraSettings, apply_lora, save_adapter

    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    model = apply_lora(load_causal_lm(base), LoraSettings(lora_rank=2, lora_alpha=4.0), seed=1)
    model.peft_config["default"].base_model_name_or_path = str(base)
    save_adapter(model, tmp_path / "adapter")
    if tokenizer_in == "adapter":
        AutoTokenizer.from_pretrained(base).save_pretrained(tmp_path / "adapter")
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            (base / name).unlink(missing_ok=True)
    assert main(["export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    want = AutoTokenizer.from_pretrained(tmp_path / tokenizer_in)
    got = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert got("1+2=")["input_ids"] == want("1+2=")["input_ids"] and got.eos_token_id == want.eos_token_id
    assert f"tokenizer from {tmp_path / tokenizer_in}" in capsys.readouterr().out


def test_filter_overlong_prompts_leaves_them_out_with_a_notice(model_dir, tmp_path, capsys):
    """verl's data.filter_overlong_prompts: over-long prompts are dropped (counted), the rest train; off, the
    error names the key that would drop them."""
    import json

    from splitproof.rl.tracking.loggers import read_metrics

    rows = [
        {
            "prompt": f"{i}+1=" if i % 3 else f"{i}+1+1+1+1+1+1+1+1+1=",
            "data_source": "addition",
            "reward_model": {"ground_truth": str(i + 1)},
        }
        for i in range(12)
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = [
        *train_overrides(model_dir, out, 1),
        f"data.train_files={data}",
        "data.val_files=null",
        "data.max_prompt_length=8",
    ]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "data.filter_overlong_prompts=true" in err and "row 0" in err and "longer than max_prompt_length=8" in err
    assert main(["train", *args, "data.filter_overlong_prompts=true"]) == 0
    err = capsys.readouterr().err
    assert (
        "notice: data.filter_overlong_prompts=true: left out 4 of 12 prompts of data.train_files longer than "
        "data.max_prompt_length=8 tokens; 8 remain"
    ) in err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-1] == 1


def test_filtered_prompts_keep_their_file_rows(tmp_path):
    from splitproof.builtin import char_tokenizer
    from splitproof.rl.data.files import DataError
    from splitproof.rl.data.prompts import load_prompts

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(f'{{"prompt": "{p}"}}\n' for p in ("1+1=", "12345678+1=", "2+2=", "3+3=")))
    kept = load_prompts(data, char_tokenizer(), max_prompt_length=6, filter_overlong=True)
    assert [r.prompt for r in kept] == ["1+1=", "2+2=", "3+3="] and [r.uid for r in kept] == [0, 1, 2]
    assert kept.dropped == 1 and kept.origin(1) == f"{data} row 2"
    with pytest.raises(DataError, match="every prompt is longer than max_prompt_length=2"):
        load_prompts(data, char_tokenizer(), max_prompt_length=2, filter_overlong=True)


def test_validation_shuffle_is_said_to_have_no_effect():
    from splitproof.rl.config.load import load_train_config

    notices: list[str] = []
    load_train_config(None, ["data.validation_shuffle=true"], on_notice=notices.append)
    assert any(n.startswith("data.validation_shuffle=true has no effect") for n in notices), notices
    notices.clear()
    load_train_config(None, ["data.val_batch_size=64"], on_notice=notices.append)
    assert any(n.startswith("data.val_batch_size=64 has no effect") for n in notices), notices
    notices.clear()
    load_train_config(None, [], on_notice=notices.append)
    assert not any("validation_shuffle" in n or "val_batch_size" in n for n in notices)


def test_a_missing_file_or_folder_comes_first_with_every_other_problem(model_dir, tmp_path, monkeypatch, capsys):
    """A missing data file before the lengths error, a missing model before GRPO's n >= 2, in one line."""
    _no_model(monkeypatch)
    out = tmp_path / "out"
    base = train_overrides(model_dir, out, 2)
    code = main(["train", *base, f"data.train_files={tmp_path}/nowhere.parquet", "data.max_prompt_length=100000"])
    err = capsys.readouterr().err
    assert_usage_error(code, err, ["nowhere.parquet: prompt file not found"], out)
    assert err.startswith("splitproof: error: data.train_files: ")
    code = main(
        [
            "train",
            *base,
            f"actor_rollout_ref.model.path={tmp_path}/no_model",
            "actor_rollout_ref.rollout.n=1",
            f"data.val_files={tmp_path}/no_val.jsonl",
        ]
    )
    err = capsys.readouterr().err
    assert_usage_error(
        code,
        err,
        [
            "data.val_files: ",
            "no_val.jsonl: prompt file not found",
            f"also actor_rollout_ref.model.path: '{tmp_path}/no_model' is not a local directory",
            "also actor_rollout_ref.rollout.n: ",
        ],
        out,
    )
    assert err.index("no_val.jsonl") < err.index("no_model") < err.index("rollout.n")


def test_readme_says_what_float32_does_and_how_to_get_the_cpu_torch():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    intro = " ".join(readme.split("## ")[0].split())
    assert "never change the gradient" not in intro
    assert "In float64" in intro and "In float32" in intro and "rounding" in intro
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme


def test_console_and_curve_keep_a_data_source_with_a_slash_and_name_the_metric(tmp_path):
    import io

    from splitproof.rl.tracking import curve
    from splitproof.rl.tracking import loggers as tracking

    records = [
        {
            "step": 1,
            "critic/score/mean": 0.5,
            "timing_s/step": 2.0,
            "val-core/openai/gsm8k/acc/mean@4": 0.25,
            "val-core/openai/math/acc/mean@4": 0.75,
        }
    ]
    axes = curve.curve_figure(records).axes[0]
    assert [t.get_text() for t in axes.get_legend().get_texts()] == [
        "training reward (critic/score/mean)",
        "held-out openai/gsm8k (acc/mean@4)",
        "held-out openai/math (acc/mean@4)",
    ]
    assert axes.get_lines()[0].get_marker() == "o"  # a one-point curve is drawn
    out = io.StringIO()
    tracker = tracking.Tracker(["console"], local_dir=tmp_path, total_steps=1, stream=out, header="first line")
    tracker.log({}, 0)  # nothing evaluated before training: no line
    tracker.log(records[0], 1)
    tracker.finish()
    assert out.getvalue().splitlines() == [
        "first line",
        "step 1/1 | reward 0.500 | held-out openai/gsm8k acc/mean@4 0.250, openai/math acc/mean@4 0.750 "
        "(step 1) | 2.00 s/step | ETA 0s",
    ]


def test_the_console_starts_with_the_model_data_device_and_output(tmp_path):
    import io

    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.tracking.loggers import Tracker

    out = io.StringIO()
    cfg = load_train_config(
        None, [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[console]"], on_notice=lambda m: None
    )
    Tracker.from_config(cfg, total_steps=7, stream=out).finish()
    assert out.getvalue().splitlines()[0] == (
        f"splitproof train: model builtin://charlm | data builtin://addition/train | grpo, 7 steps | device cpu | "
        f"output {tmp_path}"
    )


def test_quiet_loading_reaches_the_processes_a_run_starts(monkeypatch):
    import os
    import subprocess
    import sys

    from splitproof.cli.arguments import PROGRESS_BARS_OFF, quiet_loading

    monkeypatch.delenv(PROGRESS_BARS_OFF, raising=False)
    with quiet_loading():
        child = subprocess.run(
            [sys.executable, "-c", "from transformers.utils import logging; print(logging.is_progress_bar_enabled())"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert child.stdout.strip() == "False", child.stderr
    assert PROGRESS_BARS_OFF not in os.environ


def test_checkpoint_disk_use_is_said_at_the_start_and_matches_the_disk(tmp_path, capsys):
    """The start-up notice's size of one checkpoint is what global_step_N takes on disk (within 5%; a model
    of 1.2M parameters, so that per-tensor overheads are small, as they are for real models)."""
    import re

    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.hf_models import tiny_causal_lm

    tokenizer = char_tokenizer()
    model = tiny_causal_lm(
        "llama",
        vocab_size=len(tokenizer),
        hidden_size=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        seed=0,
        dtype=torch.float32,
    )
    model.config.eos_token_id, model.config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "out"
    assert main(["train", *train_overrides(str(tmp_path / "model"), out, 2, extra=["trainer.save_freq=1"])]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "notice: checkpoints:" in line)
    assert "trainer.max_actor_ckpt_to_keep=null (verl's default) keeps all 2 this run writes" in line, line
    said = float(re.search(r"about ([0-9.]+) MB each", line).group(1)) * 1e6
    on_disk = sum(p.stat().st_size for p in (out / "global_step_1").rglob("*") if p.is_file())
    assert abs(said - on_disk) <= 0.05 * on_disk, (said, on_disk)


def test_a_model_you_bring_runs_on_one_thread_by_default(model_dir):
    from splitproof.rl.config.load import load_train_config

    cfg = load_train_config(None, [f"actor_rollout_ref.model.path={model_dir}"], on_notice=lambda m: None)
    assert cfg.trainer.cpu_threads == 1
    assert load_train_config(None, ["trainer.cpu_threads=null"], on_notice=lambda m: None).trainer.cpu_threads is None


def test_built_in_rules_report_their_answer_so_held_out_maj_at_k_exists(model_dir, tmp_path):
    import math

    from splitproof.rl.rewards.functions import default_reward_for
    from splitproof.rl.rewards.rules import answer_id
    from splitproof.rl.tracking.loggers import read_metrics

    addition = default_reward_for("addition").fn
    assert addition("addition", " 12 ", "12") == {"score": 1.0, "pred": 12.0}
    assert addition("addition", "13", "12") == {"score": 0.0, "pred": 13.0}
    assert math.isnan(addition("addition", "  ", "12")["pred"])
    reversal = default_reward_for("reversal").fn
    assert reversal("reversal", "cba", "cba")["pred"] == answer_id("cba") != answer_id("abc")
    assert default_reward_for("product").fn("product", "x\n56088", "56088") == {"score": 1.0, "pred": 56088.0}
    assert default_reward_for("openai/gsm8k").fn("openai/gsm8k", "so #### 18", "18")["pred"] == 18.0
    out = tmp_path / "out"
    args = [
        *train_overrides(model_dir, out, 1),
        "custom_reward_function.path=null",
        "custom_reward_function.name=null",
        "trainer.val_before_train=true",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
    ]
    assert main(["train", *args]) == 0
    first = read_metrics(out / "metrics.jsonl")[0]
    assert "val-core/addition/reward/maj@4/mean" in first and "val-aux/addition/reward/maj@2/mean" in first, first


def test_a_resume_mismatch_says_the_checkpoints_value_and_this_runs(tmp_path):
    from splitproof import ConfigError
    from splitproof.rl.checkpoint.resume import Resumed, check_resume_config
    from splitproof.rl.config.load import dump_config, load_train_config

    saved = load_train_config(None, ["actor_rollout_ref.actor.optim.lr=0.001"], on_notice=lambda m: None)
    now = load_train_config(None, ["actor_rollout_ref.actor.optim.lr=0.01"], on_notice=lambda m: None)
    resumed = Resumed(path=tmp_path / "global_step_2", step=2, trainer_state={}, config_yaml=dump_config(saved))
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.optim\.lr was 0\.001 there, 0\.01 now"):
        check_resume_config(resumed, now)


def test_the_audit_explains_each_cause_once():
    from splitproof.diagnose.audit import run_audit

    from . import audit_examples as ex

    report = run_audit(ex.microbatch_topk, name="topk")
    causes = [r["cause"] for r in report.rows if r["verdict"] != "pass"]
    assert len(causes) >= 2 and len(set(causes)) < len(causes)  # several splits fail for one reason
    table = " ".join(report.format_table().split())
    for cause in set(causes):
        assert table.count(" ".join(cause.split())) == 1, cause


def test_the_diagnosis_says_when_verls_gradient_differs_by_a_scale_the_update_hides():
    from splitproof.diagnose.report import scale_note

    def split(name, grad, update):
        return {"split": name, "legacy": {"grad_rel_diff": grad, "update_rel_diff": update}}

    note = " ".join(scale_note({"splits": [split("even:4", 7.0, 4.1e-6), split("dp:2", 1e-3, 1e-3)]}))
    assert "on even:4 verl's grad rel is over 100x its update rel" in note and "dp:2" not in note
    assert "clipped" in note
    assert scale_note({"splits": [split("dp:2", 1e-3, 1e-3), {"split": "x"}]}) == []


def test_a_budget_that_ends_every_episode_on_its_tool_response_gets_a_hint():
    from splitproof.rl.rollout.episode import Episode
    from splitproof.rl.tracking.hints import budget_hint

    def episode(mask, finished=False, calls=1):
        return Episode(
            uid=0,
            sample_index=0,
            prompt_ids=[1],
            response_ids=[2] * len(mask),
            log_probs=[0.0] * len(mask),
            finished=finished,
            token_mask=mask,
            tool_calls=calls,
        )

    cut = [episode([1, 1, 0, 0]), episode([1, 0, 0])]
    hint = budget_hint(cut, 4, 256)
    assert hint and hint.startswith("every episode with a tool call (2) used up its data.max_response_length=4")
    assert "max_tool_response_length=256" in hint
    assert budget_hint([*cut, episode([1, 0, 1], finished=True)], 4, 256) is None  # one answered
    assert budget_hint([episode([1, 1], calls=0)], 4, 256) is None


def test_every_problem_the_config_check_sees_is_in_one_line():
    from splitproof import ConfigError
    from splitproof.rl.config.load import load_train_config

    with pytest.raises(ConfigError) as info:
        load_train_config(
            None,
            ["actor_rollout_ref.rollout.n=1", "data.truncation=up", "actor_rollout_ref.actor.optim.lr=-1"],
            on_notice=lambda m: None,
        )
    message = str(info.value)
    assert message.startswith("data.truncation: ") and "\n" not in message
    for key in ("also actor_rollout_ref.actor.optim.lr: ", "also actor_rollout_ref.rollout.n: "):
        assert key in message, message
