"""Mixed precision: which dtype stores and which computes (``rl.config.mixed_precision``) for each device and
setting, with the CPU's notice and the errors; ``engine.precision.compute_in`` really computing in bf16
(CPU autocast through the same function the GPU path uses) while the parameters, gradients and optimizer
state stay fp32; the fixed-row products under autocast."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitproof.engine.device_rows import DEVICE_ROWS, fixed_block_linear
from splitproof.engine.precision import compute_dtype, compute_in
from splitproof.loss_config import ConfigError
from splitproof.rl.config.mixed_precision import Precision, resolve

from .config_helpers import error_of, load
from .test_devices import fake_cuda

ACTOR = "actor_rollout_ref.actor.fsdp_config"
GPU_MIXED = f"{ACTOR}.dtype=bfloat16"


@pytest.mark.parametrize(
    "device, model_dtype, dtype, storage, compute",
    [
        ("cpu", "fp32", None, "fp32", "fp32"),
        ("cpu", "fp32", "bfloat16", "fp32", "fp32"),  # the CPU computes in model_dtype
        ("cpu", "fp64", "bf16", "fp64", "fp64"),
        ("cpu", "bf16", "fp32", "bf16", "bf16"),
        ("cuda", "fp32", None, "fp32", "fp32"),
        ("cuda", "fp32", "bfloat16", "fp32", "bf16"),
        ("cuda:1", "float32", "bf16", "fp32", "bf16"),
        ("cuda", "fp32", "float32", "fp32", "fp32"),
        ("cuda", "bf16", "bf16", "bf16", "bf16"),
        ("cuda", "fp64", "fp64", "fp64", "fp64"),
    ],
)
def test_storage_and_compute_dtype_per_device(device, model_dtype, dtype, storage, compute):
    assert resolve(ACTOR, model_dtype, dtype, device) == Precision(storage, compute)


@pytest.mark.parametrize(
    "device, model_dtype, dtype, words",
    [
        ("cpu", "fp32", "int8", "must be null or one of fp32, float32, bf16, bfloat16, fp64, float64, got 'int8'"),
        ("cuda", "fp32", "fp16", "'fp16' needs loss scaling"),
        ("cpu", "fp32", "float16", "'float16' needs loss scaling"),
        ("cuda", "fp64", "bf16", "float64 is never autocast"),
        ("cuda", "bf16", "fp32", "wider than"),
    ],
)
def test_bad_compute_dtype_is_one_line(device, model_dtype, dtype, words):
    with pytest.raises(ConfigError, match=f"^{ACTOR}.dtype: ") as info:
        resolve(ACTOR, model_dtype, dtype, device)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_cpu_notice_names_key_value_and_origin():
    cfg, notices = load(GPU_MIXED)
    assert cfg.actor_rollout_ref.actor.fsdp_config.dtype == "bfloat16"
    assert cfg.critic.fsdp.dtype == "bfloat16"  # the actor's
    mine = [n for n in notices if ".dtype=" in n]
    assert mine == [
        f"{ACTOR}.dtype=bfloat16 (yours) is honoured only on a GPU (trainer.device=cuda): on the CPU the model "
        f"computes in {ACTOR}.model_dtype=fp32, as it is stored (docs/gpu.md)"
    ]
    _, notices = load(GPU_MIXED, "critic.fsdp.dtype=bf16", "algorithm.adv_estimator=gae")
    assert any(n.startswith("critic.fsdp.dtype=bf16 (yours) is honoured only on a GPU") for n in notices)
    _, notices = load(f"{ACTOR}.dtype=fp32")
    assert not [n for n in notices if ".dtype=" in n]
    assert error_of(f"{ACTOR}.dtype=int8").field == f"{ACTOR}.dtype"


def test_gpu_checks_the_compute_dtype(monkeypatch):
    fake_cuda(monkeypatch, 1, capability=(7, 5))
    error = error_of("trainer.device=cuda", GPU_MIXED)
    assert error.field == f"{ACTOR}.dtype" and "compute capability 8.0" in str(error) and "7.5" in str(error)
    critic = error_of("trainer.device=cuda", "critic.fsdp.dtype=bf16", "algorithm.adv_estimator=gae")
    assert critic.field == "critic.fsdp.dtype"
    fake_cuda(monkeypatch, 1, capability=(8, 0))
    cfg, notices = load("trainer.device=cuda", GPU_MIXED)
    assert not [n for n in notices if ".dtype=" in n]
    assert error_of("trainer.device=cuda", GPU_MIXED, f"{ACTOR}.model_dtype=fp64").field == f"{ACTOR}.dtype"


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).to(dtype)


def test_compute_in_bf16_matches_an_explicit_bf16_computation_and_keeps_fp32_masters():
    model = compute_in(_model(), torch.bfloat16)
    assert compute_dtype(model) == torch.bfloat16
    x = torch.randn(5, 8)
    out = model(x)
    lin1, lin2 = model[0], model[2]
    hidden = torch.tanh(F.linear(x.bfloat16(), lin1.weight.bfloat16(), lin1.bias.bfloat16()))
    explicit = F.linear(hidden, lin2.weight.bfloat16(), lin2.bias.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, explicit)
    assert not torch.equal(out.float(), _model()(x))  # not the fp32 result
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out.float().square().sum().backward()
    optimizer.step()
    for p in model.parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
        assert all(s.dtype == torch.float32 for s in optimizer.state[p].values() if s.dim())
    assert not torch.equal(model[0].weight, _model()[0].weight)  # the step moved the fp32 masters


def test_compute_in_leaves_a_model_in_its_own_dtype_alone_and_never_autocasts_float64():
    model = _model()
    assert compute_in(model, None) is model and "forward" not in vars(model)
    assert compute_in(model, torch.float32) is model and "forward" not in vars(model)
    with pytest.raises(ValueError, match="never autocast"):
        compute_in(_model(torch.float64), torch.bfloat16)


def test_a_deep_copy_computes_with_its_own_weights():
    model = compute_in(_model(), torch.bfloat16)
    x = torch.randn(3, 8)
    before = model(x)
    clone = copy.deepcopy(model)  # a frozen reference, an FSDP2 inference copy
    with torch.no_grad():
        clone[2].bias.add_(1.0)
    assert clone(x).dtype == torch.bfloat16 and compute_dtype(clone) == torch.bfloat16
    assert torch.equal(model(x), before) and not torch.equal(clone(x), before)


def test_fixed_rows_hold_under_autocast():
    torch.manual_seed(1)
    weight, bias = torch.randn(12, 8), torch.randn(12)
    x = torch.randn(DEVICE_ROWS + 7, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        many = fixed_block_linear(x, weight, bias)
        few = fixed_block_linear(x[:3], weight, bias)
    assert many.dtype == torch.bfloat16 and many.shape == (DEVICE_ROWS + 7, 12)
    assert torch.equal(many[:3], few)  # a row's result does not depend on the rows beside it
    explicit = F.linear(F.pad(x[:3], (0, 0, 0, DEVICE_ROWS - 3)).bfloat16(), weight.bfloat16(), bias.bfloat16())
    assert torch.equal(few, explicit[:3])


def test_a_gpu_run_s_models_compute_in_bf16(monkeypatch, tmp_path):
    """What ``build_parts`` does with bf16 over fp32 on a GPU, on the CPU (the device resolution faked):
    the policy, its frozen reference and the critic compute in bf16 over fp32 parameters, and a step trains."""
    from splitproof.rl.config import mixed_precision
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    from .rl_helpers import save_tiny_char_model, train_overrides

    extra = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_kl_loss=true", "trainer.test_freq=-1"]
    overrides = train_overrides(save_tiny_char_model(tmp_path / "m"), tmp_path / "out", 1, extra=extra)
    cfg = load_train_config(None, [*overrides, "trainer.logger=[]"], on_notice=lambda m: None)
    monkeypatch.setattr(mixed_precision, "resolve", lambda prefix, storage, dtype, device: Precision("fp32", "bf16"))
    run = build_parts(cfg)
    with run.reference_policy.model() as reference:
        models = [run.actor.model, reference, run.critic.model]
    assert [compute_dtype(m) for m in models] == [torch.bfloat16] * 3
    ids = torch.tensor([[1, 2, 3]])
    assert run.actor.model(input_ids=ids).logits.dtype == torch.bfloat16
    before = {k: v.clone() for k, v in run.actor.model.state_dict().items()}
    fit(run)
    after = run.actor.model.state_dict()
    assert all(v.dtype == torch.float32 for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
