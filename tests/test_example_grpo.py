"""examples/grpo.py against `splitproof train`: the same float64 weights after every step and the same metrics.

Both run the built-in task with the same settings (a smaller batch than the recipe's, so that the test takes
seconds; the recipe's own sizes in the slow test). The trainer runs as the CLI (in-process), saving every step;
the example is imported with those sizes set on its constants and run with --dtype fp64 --seed 7.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitproof.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo.py"
STEPS, SEED = 3, 7  # a sampling seed other than the default: --seed is actor_rollout_ref.rollout.seed
SMALL = {
    "TRAIN_BATCH_SIZE": 16,
    "PPO_MINI_BATCH_SIZE": 4,
    "TEST_FREQ": STEPS,
    "VAL_BEFORE_TRAIN": False,
    "SAVE_FREQ": 1,
}  # held-out evaluation (500 prompts) once, after the last step
SMALL_OVERRIDES = [
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    f"trainer.test_freq={STEPS}",
    "trainer.val_before_train=false",
]
TIED = {"lm_head.weight": "model.embed_tokens.weight"}  # charlm ties its output layer to its embeddings


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_example(out: Path, constants: dict) -> list[dict]:
    example = load_example()
    for name, value in constants.items():
        assert hasattr(example, name), name
        setattr(example, name, value)
    threads = torch.get_num_threads()
    try:
        return example.main(["--steps", str(STEPS), "--dtype", "fp64", "--seed", str(SEED), "--output", str(out)])
    finally:
        torch.set_num_threads(threads)


def run_trainer(out: Path, overrides: list[str]) -> list[dict]:
    args = [
        f"trainer.total_training_steps={STEPS}",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=fp64",
        f"actor_rollout_ref.rollout.seed={SEED}",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=null",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={out}",
        *overrides,
    ]
    assert main(["train", *args]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(tmp_path: Path, constants: dict, overrides: list[str]) -> None:
    ours = run_example(tmp_path / "example", constants)
    theirs = run_trainer(tmp_path / "trainer", overrides)
    first = 0 if constants.get("VAL_BEFORE_TRAIN", True) else 1
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(first, STEPS + 1))
    compared = 0
    for mine, reference in zip(ours, theirs):
        for name, value in mine.items():
            if name.startswith("timing_s/"):
                continue
            assert name in reference, f"step {mine['step']}: the trainer reports no {name}"
            assert value == reference[name], (mine["step"], name, value, reference[name])  # bit for bit
            compared += 1
    assert "val-core/addition/reward/mean@1" in ours[-1] and "actor/pg_loss" in ours[-1]
    assert compared >= 15 * STEPS
    initial = None
    for step in range(1, STEPS + 1):
        mine = load_file(tmp_path / "example" / f"global_step_{step}" / "model.safetensors")
        reference = load_file(tmp_path / "trainer" / f"global_step_{step}" / "actor" / "model.safetensors")
        for name, source in TIED.items():  # save_pretrained stores a tied weight once, the trainer twice
            if name not in mine:
                mine[name] = mine[source]
        assert mine.keys() == reference.keys()
        for name, tensor in mine.items():
            assert tensor.dtype == torch.float64, name
            assert torch.equal(tensor, reference[name]), f"step {step}: {name}"
        if initial is not None:  # the weights move from step to step: the comparison is not of constants
            assert any(not torch.equal(mine[n], initial[n]) for n in mine)
        initial = mine


def test_example_matches_splitproof_train(tmp_path):
    assert_same_run(tmp_path, SMALL, SMALL_OVERRIDES)


@pytest.mark.slow
def test_example_matches_splitproof_train_at_recipe_sizes(tmp_path):
    assert_same_run(tmp_path, {"SAVE_FREQ": 1}, [])
