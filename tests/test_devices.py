"""`trainer.device`: cpu, cuda (GPU LOCAL_RANK), cuda:N — resolved per rank, the process group's backend, and
each mistake one line naming the key before any model is loaded. CUDA is faked where the machine has none:
``torch.cuda.is_available`` / ``device_count`` / ``get_device_capability`` / ``get_device_name``."""

from __future__ import annotations

import pytest
import torch

from splitproof import ConfigError
from splitproof.cli import main
from splitproof.devices import (
    check_dtype,
    deterministic,
    parse_device,
    process_group_backend,
    resolve_device,
    this_process_device,
)
from splitproof.rl import run as run_module

from .config_helpers import error_of, load
from .rl_helpers import assert_usage_error, save_tiny_char_model, train_overrides


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


def fake_cuda(monkeypatch, count: int, capability=(9, 0)):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")


def test_parse_device():
    assert parse_device("cpu") == ("cpu", None)
    assert parse_device("cuda") == ("cuda", None)
    assert parse_device("cuda:3") == ("cuda", 3)
    for bad in ("tpu", "cuda:", "cuda:-1", "cuda:x", "CUDA", 0, None, "mps"):
        with pytest.raises(ConfigError, match="trainer.device: must be cpu, cuda or cuda:N"):
            parse_device(bad)


def test_cpu_needs_no_cuda(monkeypatch):
    fake_cuda(monkeypatch, 0)
    assert resolve_device("cpu", local_rank=3, world_size=4) == torch.device("cpu")


def test_cuda_is_the_rank_s_own_gpu(monkeypatch):
    fake_cuda(monkeypatch, 4)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert [resolve_device("cuda", local_rank=r, world_size=4) for r in range(4)] == [
        torch.device("cuda", r) for r in range(4)
    ]
    assert resolve_device("cuda:2") == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert this_process_device("cuda") == torch.device("cuda", 3)


@pytest.mark.parametrize(
    "count, spec, local_rank, world, words",
    [
        (0, "cuda", 0, 1, "needs CUDA, and this machine has no CUDA device; set trainer.device=cpu"),
        (0, "cuda:0", 0, 1, "no CUDA device"),
        (2, "cuda:2", 0, 1, "this machine has 2 CUDA device(s), cuda:0 to cuda:1"),
        (2, "cuda:1", 0, 2, "puts all 2 ranks on one GPU"),
        (2, "cuda", 2, 3, "LOCAL_RANK=2 on cuda:2, and this machine has 2 CUDA device(s)"),
    ],
)
def test_each_device_mistake_is_one_line(monkeypatch, count, spec, local_rank, world, words):
    fake_cuda(monkeypatch, count)
    with pytest.raises(ConfigError) as info:
        resolve_device(spec, local_rank=local_rank, world_size=world)
    assert info.value.field == "trainer.device"
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_dtype_the_gpu_cannot_run(monkeypatch):
    fake_cuda(monkeypatch, 1, capability=(7, 5))
    check_dtype(torch.device("cuda", 0), torch.float32, "k")
    check_dtype(torch.device("cuda", 0), torch.float64, "k")
    check_dtype(torch.device("cpu"), torch.bfloat16, "k")  # the CPU computes bf16
    with pytest.raises(ConfigError, match=r"^k: bfloat16 needs a GPU of compute capability 8.0 .* has 7.5; use fp32$"):
        check_dtype(torch.device("cuda", 0), torch.bfloat16, "k")
    fake_cuda(monkeypatch, 1, capability=(8, 0))
    check_dtype(torch.device("cuda", 0), torch.bfloat16, "k")


def test_backend_nccl_for_the_gpu_gloo_beside_it():
    assert process_group_backend("cpu") == "gloo"
    assert process_group_backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"


def test_the_cpu_sets_nothing_for_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    assert deterministic("cpu") is None
    assert torch.are_deterministic_algorithms_enabled() == before


def test_config_checks_the_device_of_this_rank(monkeypatch):
    fake_cuda(monkeypatch, 0)
    error = error_of("trainer.device=cuda")
    assert error.field == "trainer.device" and "no CUDA device" in str(error)
    fake_cuda(monkeypatch, 1)
    assert load("trainer.device=cuda")[0].trainer.device == "cuda"
    assert "1 CUDA device(s)" in str(error_of("trainer.device=cuda:1"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "LOCAL_RANK=1" in str(error_of("trainer.device=cuda"))


def test_config_checks_the_models_dtypes_on_the_device(monkeypatch):
    fake_cuda(monkeypatch, 1, capability=(7, 0))
    error = error_of("trainer.device=cuda", "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16")
    assert error.field == "actor_rollout_ref.actor.fsdp_config.model_dtype" and "7.0" in str(error)
    assert load("trainer.device=cuda", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp64")
    critic = ["algorithm.adv_estimator=gae", "critic.fsdp.model_dtype=bf16"]
    assert error_of("trainer.device=cuda", *critic).field == "critic.fsdp.model_dtype"


@pytest.mark.parametrize(
    "count, device, words",
    [(0, "cuda", ["trainer.device", "no CUDA device"]), (1, "cuda:1", ["trainer.device", "cuda:0 to cuda:0"])],
)
def test_train_refuses_before_any_model_loads(monkeypatch, tmp_path, capsys, model_dir, count, device, words):
    fake_cuda(monkeypatch, count)

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 2), f"trainer.device={device}"])
    assert_usage_error(code, capsys.readouterr().err, words, out)


def test_bf16_on_an_old_gpu_refused_before_any_model_loads(monkeypatch, tmp_path, capsys, model_dir):
    fake_cuda(monkeypatch, 1, capability=(7, 5))
    monkeypatch.setattr(run_module, "load_policy", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "out"
    code = main(["train", *train_overrides(model_dir, out, 2, dtype="bf16"), "trainer.device=cuda"])
    assert_usage_error(code, capsys.readouterr().err, ["model_dtype", "compute capability 8.0"], out)


def test_diagnose_device_past_the_count_is_one_line(monkeypatch):
    from splitproof.diagnose.context import ModelError, check_device

    fake_cuda(monkeypatch, 2)
    check_device("cuda:1")
    with pytest.raises(ModelError, match=r"^--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0 to cuda:1$"):
        check_device("cuda:2")
    fake_cuda(monkeypatch, 0)
    with pytest.raises(ModelError, match="CUDA is not available"):
        check_device("cuda")


def test_torchrun_ranks_join_nccl_on_their_own_gpu(monkeypatch):
    """`splitproof train` under torchrun with trainer.device=cuda: rank LOCAL_RANK sets its GPU, the default
    group is NCCL beside gloo, and the exit barrier gets a gloo group of its own (CUDA and the process
    group faked: what is checked is what the command asks torch for)."""
    import torch.distributed as dist

    from splitproof.cli import train as train_cli

    fake_cuda(monkeypatch, 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set_device", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(("init", backend)))
    monkeypatch.setattr(dist, "new_group", lambda backend, timeout: calls.append(("new_group", backend)) or "g")
    monkeypatch.setattr(train_cli, "LEAVE_GROUP", None)
    train_cli.init_distributed(60, "cuda")
    assert calls == [("set_device", torch.device("cuda", 1)), ("init", "cpu:gloo,cuda:nccl"), ("new_group", "gloo")]
    assert train_cli.LEAVE_GROUP == "g"
    calls.clear()
    train_cli.init_distributed(60, "cpu")
    assert calls == [("init", "gloo")]
