"""`splitproof train` with LoRA (verl's actor_rollout_ref.model.lora_* keys): the adapter alone trains, the
reference is the base model (adapter disabled, no copy), the base weights never change, checkpoints hold
PEFT's adapter directory and resume exactly, the merged model is written at the end; bad input is one
line, exit 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitproof.cli import main
from splitproof.engine import compute_log_probs
from splitproof.hf_models import load_causal_lm
from splitproof.lora import adapter_state, base_digest, save_adapter
from splitproof.rl.config.load import load_train_config
from splitproof.rl.train import train

from .engine_helpers import make_rollout
from .rl_helpers import save_tiny_char_model, train_overrides

LORA = [
    "actor_rollout_ref.model.lora_rank=4",
    "actor_rollout_ref.model.lora_alpha=8",
    "actor_rollout_ref.actor.optim.lr=0.05",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


def _config(model_dir, out, steps, extra=()):
    return load_train_config(
        None,
        train_overrides(
            model_dir, out, steps, dtype="fp64", extra=[*LORA, "trainer.save_freq=1", "trainer.test_freq=-1", *extra]
        ),
    )


@pytest.fixture(scope="module")
def finished(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-run")
    return train(_config(model_dir, out, 3)), out


def _adapter(run):
    return {k: v.clone() for k, v in adapter_state(run.actor.model).items()}


def test_the_adapter_alone_trains_against_the_base_as_reference(model_dir, finished):
    result, _ = finished
    run = result.parts
    no_copy = run.reference_policy is None or run.reference_policy.frozen is None
    assert run.lora and no_copy  # no second copy of the model
    assert base_digest(run.actor.model) == base_digest(load_causal_lm(model_dir))  # bitwise as loaded
    optimized = {id(p) for g in run.actor.optimizer.param_groups for p in g["params"]}
    adapter = {id(p) for name, p in run.actor.model.named_parameters() if ".lora_" in name}
    assert optimized == adapter
    assert any(float(v.abs().max()) > 0 for k, v in _adapter(run).items() if "lora_B" in k)  # B moved from 0
    kl = [r["actor/kl_loss"] for r in result.records if "actor/kl_loss" in r]
    # two minibatches a step: the first starts at the base (B = 0, KL 0), the second has moved away
    assert len(kl) == 3 and 0 < kl[0] < kl[-1]


def test_checkpoints_hold_peft_adapters_and_the_merged_model_is_written(model_dir, finished):
    from peft import PeftModel

    result, out = finished
    actor = out / "global_step_3" / "actor"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in actor.iterdir()}
    assert not (actor / "model.safetensors").exists()
    assert json.loads((actor / "adapter_config.json").read_text())["r"] == 4
    loaded = PeftModel.from_pretrained(load_causal_lm(model_dir), actor)
    assert all(torch.equal(a, b) for a, b in zip(adapter_state(loaded).values(), _adapter(result.parts).values()))
    batch = make_rollout(loaded, 6, holes=False)
    merged = load_causal_lm(out / "merged")
    policy = result.parts.actor.for_inference()
    diff = (
        compute_log_probs(merged, batch, micro_batch_size=6)[0]
        - compute_log_probs(policy, batch, micro_batch_size=6)[0]
    )
    assert float(diff.abs().max()) <= 1e-12
    # any checkpoint's adapter merges with `splitproof export` (its config names the base model)
    assert main(["export", str(actor), "--out", str(out / "exported")]) == 0
    exported = load_causal_lm(out / "exported")
    assert all(torch.equal(a, b) for a, b in zip(exported.state_dict().values(), merged.state_dict().values()))


def test_a_lora_run_stopped_and_resumed_equals_the_uninterrupted_one(model_dir, finished, tmp_path):
    result, _ = finished
    train(_config(model_dir, tmp_path, 2))
    resumed = train(_config(model_dir, tmp_path, 3))
    assert resumed.start_step == 2
    assert all(torch.equal(a, b) for a, b in zip(_adapter(resumed.parts).values(), _adapter(result.parts).values()))
    want = result.records[-1]
    got = resumed.records[-1]
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean", "actor/grad_norm"):
        assert math.isclose(got[key], want[key], rel_tol=1e-12, abs_tol=1e-15), key


def _exit_2(capsys, args) -> str:
    capsys.readouterr()  # what the test's own setup printed
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


def test_bad_lora_input_is_one_line_before_training(model_dir, tmp_path, capsys):
    base = train_overrides(model_dir, tmp_path / "out", 1)
    err = _exit_2(capsys, [*base, "actor_rollout_ref.model.lora_alpha=32"])
    assert (
        "actor_rollout_ref.model.lora_rank: is 0 (LoRA off) but actor_rollout_ref.model.lora_alpha=32.0 is set" in err
    )
    err = _exit_2(
        capsys, [*base, "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=[c_attn]"]
    )
    assert "actor_rollout_ref.model.target_modules: 'c_attn' matches no module of the model" in err
    assert "modules found: down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj" in err
    err = _exit_2(
        capsys,
        [
            *base,
            "actor_rollout_ref.model.lora_rank=4",
            f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'none'}",
        ],
    )
    assert "actor_rollout_ref.model.lora_adapter_path:" in err and "no adapter_config.json" in err
    other = save_tiny_char_model(tmp_path / "other", dtype=torch.float64, seed=1)
    from splitproof.lora import LoraSettings, apply_lora

    save_adapter(apply_lora(load_causal_lm(other), LoraSettings(lora_rank=4, lora_alpha=8)), tmp_path / "adapter")
    err = _exit_2(capsys, [*base, *LORA[:2], f"actor_rollout_ref.model.lora_adapter_path={tmp_path / 'adapter'}"])
    assert "actor_rollout_ref.model.lora_adapter_path:" in err and "trained on other base weights" in err
    assert not (tmp_path / "out" / "global_step_1").exists()


def test_resuming_onto_other_base_weights_is_refused(model_dir, finished, tmp_path, capsys):
    import shutil

    _, out = finished
    moved = tmp_path / "model"
    shutil.copytree(model_dir, moved)
    changed = load_causal_lm(moved)
    with torch.no_grad():
        changed.model.embed_tokens.weight[0, 0] += 1.0
    changed.save_pretrained(moved)
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    args = train_overrides(
        str(moved),
        run_dir,
        4,
        dtype="fp64",
        extra=[*LORA, "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.resume_allow_config_change=true"],
    )
    err = _exit_2(capsys, args)
    assert "actor_rollout_ref.model.path: the checkpoint" in err and "trained on other base weights" in err


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


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["fsdp2"])  # DDP's LoRA update: tests/test_lora_engine.py (D = 2, 3)
def test_torchrun_lora_matches_one_process(model_dir, finished, tmp_path, strategy):
    """Two FSDP2 ranks end with the one-process run's adapter (float64, 1e-10 of the update) and
    write the same PEFT adapter directory."""
    from safetensors.torch import load_file

    result, one = finished
    args = train_overrides(
        model_dir,
        tmp_path,
        3,
        dtype="fp64",
        extra=[
            *LORA,
            "trainer.save_freq=1",
            "trainer.test_freq=-1",
            f"actor_rollout_ref.actor.strategy={strategy}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        ],
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run([*TORCHRUN, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    weights = "adapter_model.safetensors"
    got = load_file(tmp_path / "global_step_3" / "actor" / weights)
    want = load_file(one / "global_step_3" / "actor" / weights)
    initial = dict(adapter_state(_fresh(model_dir)))
    assert set(got) == set(want)
    update = max(float((want[k] - initial[k]).abs().max()) for k in want)
    difference = max(float((got[k] - want[k]).abs().max()) for k in want)
    assert difference <= 1e-10 * update, difference / update
    assert (tmp_path / "merged" / "model.safetensors").exists()


def _fresh(model_dir):
    from splitproof.lora import LoraSettings, apply_lora

    return apply_lora(load_causal_lm(model_dir), LoraSettings(lora_rank=4, lora_alpha=8), seed=0)
