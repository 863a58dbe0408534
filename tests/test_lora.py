"""LoRA on PEFT: verl's keys checked with one-line errors, the adapter drawn from the seed alone, the
reference policy as the adapter disabled, the merged export equal to the adapter model (float64, 1e-12)
without touching the base weights, and adapters saved in PEFT's format, loaded by PEFT's own loader."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from splitproof.engine import compute_log_probs
from splitproof.hf_models import load_causal_lm
from splitproof.lora import (
    LoraSettings,
    adapter_disabled,
    adapter_state,
    apply_lora,
    base_digest,
    export_merged,
    lora_layers,
    save_adapter,
)
from splitproof.loss_config import ConfigError

from .engine_helpers import flat, make_model
from .lora_helpers import SETTINGS, lora_model, rollout

MERGED_ABS = 1e-12  # float64: W x + s·B(A x) against (W + s·B·A) x, log-probs of ~-5.5


def trained(seed: int = 0):
    """A LoRA model whose B is nonzero (as after training): the adapter changes the log-probs."""
    model = lora_model(seed)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(0.2 * torch.randn(b.shape, generator=g, dtype=b.dtype))
    return model


def log_probs(model, batch):
    return compute_log_probs(model, batch, micro_batch_size=len(batch))[0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lora_rank=-1), r"^lora_rank: must be >= 0"),
        (dict(lora_rank=0, lora_alpha=32), r"^lora_rank: is 0 \(LoRA off\) but lora_alpha=32 is set"),
        (dict(lora_rank=0, lora_adapter_path="x"), r"^lora_rank: is 0 .* lora_adapter_path='x'"),
        (dict(lora_rank=2.5), r"^lora_rank: must be an integer"),
        (dict(lora_rank=4, lora_alpha=0), r"^lora_alpha: must be a finite number > 0"),
        (dict(lora_rank=4, target_modules="all"), r"^target_modules: must be 'all-linear' or a list"),
        (dict(lora_rank=4, target_modules=[]), r"^target_modules: must be 'all-linear' or a non-empty list"),
    ],
)
def test_bad_settings_are_one_line_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match) as info:
        LoraSettings(**kwargs, prefix="")
    assert "\n" not in str(info.value)


def test_the_keys_are_named_with_their_prefix():
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.lora_rank: is 0"):
        LoraSettings(lora_rank=0, target_modules=["q_proj"], prefix="actor_rollout_ref.model.")


@pytest.mark.parametrize("key", ["target_modules", "exclude_modules"])
def test_a_module_the_model_lacks_names_the_modules_found(key):
    settings = LoraSettings(lora_rank=4, **{key: ["q_proj", "c_attn"]})
    with pytest.raises(
        ConfigError,
        match=rf"^{key}: 'c_attn' matches no module of the model \(LlamaForCausalLM\); "
        r"modules found: down_proj, embed_tokens, gate_proj, k_proj, lm_head, "
        r"o_proj, q_proj, up_proj, v_proj$",
    ):
        apply_lora(make_model(), settings)


def test_missing_peft_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(
        ImportError, match=r"^LoRA needs PEFT, the optional extra 'lora': pip install 'splitproof\[lora\]'$"
    ):
        apply_lora(make_model(), SETTINGS)


def test_the_adapter_is_drawn_from_the_seed_alone():
    torch.manual_seed(123)
    a = flat(adapter_state(lora_model(seed=5)))
    state = torch.get_rng_state()
    torch.manual_seed(456)
    b = flat(adapter_state(lora_model(seed=5)))
    assert torch.equal(a, b)
    torch.manual_seed(123)
    lora_model(seed=5)
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is neither read nor advanced
    assert not torch.equal(a, flat(adapter_state(lora_model(seed=6))))
    targeted = {name.rsplit(".", 1)[-1] for name in lora_layers(lora_model())}
    assert targeted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"}  # all-linear minus down_proj


def test_the_reference_is_the_base_model_with_no_copy():
    model = trained()
    base = make_model()
    batch = rollout(base)
    with_adapter = log_probs(model, batch)
    trainable = [p.requires_grad for p in model.parameters()]
    with adapter_disabled(model):
        reference = log_probs(model, batch)
    assert torch.equal(reference, log_probs(base, batch))  # bitwise the base model's
    assert float((with_adapter - reference).abs().max()) > 1e-2  # the adapter matters
    assert torch.equal(log_probs(model, batch), with_adapter)  # re-enabled as it was
    assert [p.requires_grad for p in model.parameters()] == trainable


def test_merged_export_equals_the_adapter_model_and_leaves_the_base_alone(tmp_path):
    model = trained()
    batch = rollout(model)
    digest = base_digest(model)
    assert digest == base_digest(make_model())
    export_merged(model, tmp_path / "merged")
    assert base_digest(model) == digest  # the live base weights are bitwise untouched
    merged = load_causal_lm(tmp_path / "merged")
    assert next(merged.parameters()).dtype == torch.float64
    assert type(merged).__name__ == "LlamaForCausalLM"
    diff = float((log_probs(merged, batch) - log_probs(model, batch)).abs().max())
    assert diff <= MERGED_ABS
    assert base_digest(merged) != digest  # the adapter is in the merged weights


def test_a_saved_adapter_loads_with_peft_and_as_lora_adapter_path(tmp_path):
    from peft import PeftModel

    model = trained()
    batch = rollout(model)
    save_adapter(model, tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    expected = log_probs(model, batch)
    by_peft = PeftModel.from_pretrained(make_model(), tmp_path / "adapter")
    assert torch.equal(log_probs(by_peft, batch), expected)
    settings = LoraSettings(lora_rank=4, lora_alpha=8, lora_adapter_path=str(tmp_path / "adapter"))
    resumed = apply_lora(make_model(), settings)
    assert torch.equal(log_probs(resumed, batch), expected)
    assert torch.equal(flat(adapter_state(resumed)), flat(adapter_state(model)))
    assert sum(p.numel() for p in resumed.parameters() if p.requires_grad) == flat(adapter_state(model)).numel()


def test_an_adapter_that_does_not_fit_is_refused(tmp_path):
    save_adapter(trained(), tmp_path / "adapter")
    path = str(tmp_path / "adapter")
    with pytest.raises(ConfigError, match=r"^lora_adapter_path: .*trained on other base weights \(digest "):
        apply_lora(make_model(seed=1), LoraSettings(lora_rank=4, lora_alpha=8, lora_adapter_path=path))
    with pytest.raises(ConfigError, match=r"^lora_rank: is 8 but the adapter at .* has rank 4$"):
        apply_lora(make_model(), LoraSettings(lora_rank=8, lora_alpha=8, lora_adapter_path=path))
    with pytest.raises(ConfigError, match=r"^lora_alpha: is 16.0 but the adapter at .* has lora_alpha 8$"):
        apply_lora(make_model(), LoraSettings(lora_rank=4, lora_adapter_path=path))
    # an adapter saved elsewhere (no digest): its config's base model name decides
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "org/other-model"
    (tmp_path / "adapter" / "adapter_config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    save_file(load_file(weights), weights)  # without the digest
    model = make_model()
    model.config._name_or_path = "org/base-model"
    with pytest.raises(
        ConfigError,
        match=r"^lora_adapter_path: .*the adapter's base model is 'org/other-model', "
        r"the model is 'org/base-model'$",
    ):
        apply_lora(model, LoraSettings(lora_rank=4, lora_alpha=8, lora_adapter_path=path))


def test_the_diagnosis_model_trains_the_adapter_alone():
    from splitproof.diagnose.context import ModelSpec, build_model

    model = build_model(ModelSpec(dtype="float64", lora_rank=4))
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert base_digest(model) == base_digest(build_model(ModelSpec(dtype="float64")))
    assert ModelSpec(lora_rank=4).describe().endswith(", LoRA rank 4")


@pytest.mark.dist
def test_diagnose_runs_the_split_sweep_on_a_lora_model(tmp_path):
    from splitproof.cli import main

    path = tmp_path / "lora.json"
    assert (
        main(
            [
                "diagnose",
                "--lora-rank",
                "4",
                "--dtype",
                "float64",
                "--optimizer",
                "adamw",
                "--split",
                "even:4",
                "--split",
                "packed:40",
                "--split",
                "dp:2",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads(path.read_text())
    assert "LoRA rank 4" in report["settings"]["model"]
    splits = report["scenarios"][0]["splits"]
    assert [s["split"] for s in splits] == ["even:4", "packed:40", "dp:2"]
    for s in splits:
        assert s["verdict"] == "pass" and s["update_rel_diff"] < 1e-12, s


def test_splitproof_export_merges_a_saved_adapter(tmp_path, capsys):
    from splitproof.cli import main

    base_dir = tmp_path / "base"
    make_model().save_pretrained(base_dir)
    model = trained()
    model.peft_config["default"].base_model_name_or_path = str(base_dir)
    save_adapter(model, tmp_path / "adapter")
    assert main(["export", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    batch = rollout(model)
    merged = load_causal_lm(tmp_path / "merged")
    assert float((log_probs(merged, batch) - log_probs(model, batch)).abs().max()) <= MERGED_ABS
    capsys.readouterr()
    for argv, message in (
        (
            [str(tmp_path / "nope"), "--out", str(tmp_path / "m2")],
            r"lora_adapter_path: .*nope: no adapter_config\.json",
        ),
        ([str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")], r"out: .*merged exists and is not empty"),
        (
            [str(tmp_path / "adapter"), "--model", str(tmp_path / "x"), "--out", str(tmp_path / "m3")],
            r"model: .*x: not a local model directory",
        ),
    ):
        assert main(["export", *argv]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
