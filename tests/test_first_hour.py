"""What a verl user meets in the first hour: verl's infrastructure keys beside a later mistake, errors in
a useful order, verl's data keys honoured."""

from __future__ import annotations

import fnmatch

import pytest

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


def test_every_no_effect_pattern_names_a_verl_key():
    assert len(NO_EFFECT_KEYS) == len(verl_keys.NO_EFFECT)
    for key in ("actor_rollout_ref.rollout.gpu_memory_utilization", "actor_rollout_ref.rollout.max_num_batched_tokens",
                "trainer.n_gpus_per_node", "actor_rollout_ref.actor.fsdp_config.param_offload"):
        assert verl_keys.classify(key, 1) == "no_effect", key


@pytest.mark.parametrize("key", NO_EFFECT_KEYS)
def test_a_no_effect_key_beside_a_later_mistake_gives_that_mistakes_line(key, model_dir, tmp_path, monkeypatch,
                                                                         capsys):
    """verl's infrastructure keys are accepted with a notice; the mistake after them is its own one line."""
    _no_model(monkeypatch)
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 2), f"{key}=2",
                 f"custom_reward_function.path={tmp_path}/no_reward.py"])
    err = capsys.readouterr().err
    assert_usage_error(code, err, ["no_reward.py", "not found"], out)
    assert f"splitproof: notice: {key}: no effect" in err


VERL_SCRIPT_KEYS = ["actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
                    "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=8",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
                    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
                    "actor_rollout_ref.rollout.max_num_batched_tokens=2048"]


@pytest.mark.parametrize("mistake", ["missing data file", "reward syntax error"])
def test_a_verl_scripts_infrastructure_keys_leave_the_mistake_its_line(mistake, model_dir, tmp_path, monkeypatch,
                                                                        capsys):
    _no_model(monkeypatch)
    broken = tmp_path / "broken_reward.py"
    broken.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None:\n    return 1\n")
    extra, words = {"missing data file": ([f"data.train_files={tmp_path}/nowhere.parquet"], ["nowhere.parquet"]),
                    "reward syntax error": ([f"custom_reward_function.path={broken}"], ["broken_reward.py"])}[mistake]
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
