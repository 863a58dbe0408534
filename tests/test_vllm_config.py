"""``actor_rollout_ref.rollout.name=vllm`` in the config, without an engine: the bad inputs are one line and
exit 2 before any model (vLLM missing: how to install it; tensor parallelism; float64), verl's engine keys
are read with vllm and noticed (no effect) with hf, and those the CPU engine cannot honour are noticed."""

from __future__ import annotations

import pytest

from splitproof.cli import main
from splitproof.rl import run as run_module
from splitproof.rl.config import vllm_keys

from .config_helpers import error_of, load
from .rl_helpers import assert_usage_error, save_tiny_char_model, train_overrides

VLLM = "actor_rollout_ref.rollout.name=vllm"
ROLLOUT = "actor_rollout_ref.rollout"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.setattr(vllm_keys, "vllm_installed", lambda: True)


def _no_model(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    monkeypatch.setattr(run_module, "start_engine", refuse)


def test_vllm_missing_is_one_line_saying_how_to_install(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_keys, "vllm_installed", lambda: False)
    _no_model(monkeypatch)
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 1), VLLM])
    assert_usage_error(code, capsys.readouterr().err, [f"{ROLLOUT}.name", "pip install -e '.[vllm]'"], out)


@pytest.mark.parametrize(
    "setting, key",
    [
        ("tensor_model_parallel_size=2", "tensor_model_parallel_size"),
        ("max_num_batched_tokens=0", "max_num_batched_tokens"),
        ("max_model_len=10", "max_model_len"),
        ("dtype=int8", "dtype"),
    ],
)
def test_bad_engine_keys_are_one_line_before_any_model(
    setting, key, installed, model_dir, tmp_path, monkeypatch, capsys
):
    _no_model(monkeypatch)
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 1), VLLM, f"{ROLLOUT}.{setting}"])
    assert_usage_error(code, capsys.readouterr().err, [f"{ROLLOUT}.{key}"], out)


def test_a_float64_engine_is_refused_and_a_float32_one_beside_a_float64_actor_is_not(installed):
    fp64 = "actor_rollout_ref.actor.fsdp_config.model_dtype=fp64"
    error = error_of(VLLM, fp64)
    assert error.field == f"{ROLLOUT}.dtype" and "float64" in str(error)
    cfg, _ = load(VLLM, fp64, f"{ROLLOUT}.dtype=fp32")
    assert vllm_keys.engine_dtype(cfg) == "float32"


def test_engine_keys_are_read_with_vllm_and_noticed_with_hf(installed):
    keys = [f"{ROLLOUT}.enable_prefix_caching=false", f"{ROLLOUT}.max_num_batched_tokens=512"]
    cfg, notices = load(VLLM, *keys)
    assert cfg.actor_rollout_ref.rollout.enable_prefix_caching is False
    assert cfg.actor_rollout_ref.rollout.max_num_batched_tokens == 512
    assert notices == []
    cfg, notices = load(*keys)
    assert cfg == load()[0]
    assert [n.split(":")[0] for n in notices] == [k.split("=")[0] for k in keys]
    assert all("no effect in splitproof" in n and f"{ROLLOUT}.name=vllm" in n for n in notices)
    assert load(f"{ROLLOUT}.enable_prefix_caching=true")[1] == []  # the default: nothing to say


def test_what_the_cpu_engine_cannot_honour_is_noticed(installed):
    cfg, notices = load(
        VLLM,
        f"{ROLLOUT}.gpu_memory_utilization=0.3",
        f"{ROLLOUT}.free_cache_engine=false",
        f"{ROLLOUT}.enforce_eager=true",
    )
    assert [n.split("=")[0] for n in notices] == [
        f"{ROLLOUT}.gpu_memory_utilization",
        f"{ROLLOUT}.free_cache_engine",
        f"{ROLLOUT}.enforce_eager",
    ]
    assert all("no effect with the CPU vLLM engine" in n for n in notices)


def test_on_a_gpu_the_engine_gets_vllms_batch_invariant_mode_and_its_memory_share(installed):
    cfg, _ = load(VLLM, f"{ROLLOUT}.gpu_memory_utilization=0.3")
    cfg.trainer.device = "cuda:0"  # the notice and the settings only: no CUDA needed
    assert vllm_keys.vllm_notices(cfg, {}) == [
        f"{ROLLOUT}.name=vllm on trainer.device=cuda:0: VLLM_BATCH_INVARIANT=1 is set for the engine (vLLM's "
        "batch-invariant kernels, beta; their cost and what they hold are not measured by splitproof)"
    ]
    settings = run_module.vllm_settings(cfg)
    assert settings.gpu and settings.gpu_memory_utilization == 0.3 and not settings.enforce_eager
    cfg.trainer.device = "cpu"
    assert not run_module.vllm_settings(cfg).gpu
