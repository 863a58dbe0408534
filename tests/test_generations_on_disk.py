"""A run with verl's DAPO reward manager, held-out sampling with n = 4 and both generation folders: one
``<step>.jsonl`` per step with verl's fields and the rewards the step used, and verl's n > 1 held-out names."""

from __future__ import annotations

import json

import pytest
import torch

from .rl_helpers import run_trajectory, save_tiny_char_model, trajectory_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generations_and_held_out_metrics(model_dir, tmp_path):
    rollouts, held_out = tmp_path / "rollouts", tmp_path / "validation"
    out = run_trajectory(
        trajectory_config(
            model_dir,
            1,
            [
                "data.val_files=builtin://addition/test",
                "data.val_max_samples=3",
                "trainer.val_before_train=true",
                "trainer.test_freq=1",
                "actor_rollout_ref.rollout.val_kwargs.n=4",
                "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                "reward.reward_manager.name=dapo",
                "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
                "+reward.reward_kwargs.overlong_buffer_cfg.len=3",
                "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
                "+reward.reward_kwargs.overlong_buffer_cfg.log=true",
                "+reward.reward_kwargs.max_resp_len=6",
                f"trainer.rollout_data_dir={rollouts}",
                f"trainer.validation_data_dir={held_out}",
            ],
        )
    )
    assert sorted(p.name for p in rollouts.iterdir()) == ["1.jsonl"]
    assert sorted(p.name for p in held_out.iterdir()) == ["0.jsonl", "1.jsonl"]
    train_rows, record = _rows(rollouts / "1.jsonl"), out["records"][1]
    assert len(train_rows) == 16 and set(train_rows[0]) == {
        "input",
        "output",
        "gts",
        "score",
        "step",
        "acc",
        "overlong_reward",
        "overlong",
    }
    assert all(r["step"] == 1 and r["input"].endswith("=") for r in train_rows)
    assert sum(r["score"] for r in train_rows) / 16 == pytest.approx(record["critic/score/mean"], abs=1e-12)
    assert sum(r["overlong_reward"] for r in train_rows) / 16 == pytest.approx(record["reward/overlong_reward/mean"])
    assert all(r["score"] == pytest.approx(r["acc"] + r["overlong_reward"]) for r in train_rows)
    assert [len(r["output"]) for r in train_rows[:4]] == [
        len(s.response_ids) - s.finished for s in out["samples"][0][:4]
    ]
    val_rows = _rows(held_out / "0.jsonl")
    assert len(val_rows) == 12 and {r["gts"] for r in val_rows} == {str(r["gts"]) for r in val_rows}
    for step in (0, 1):
        keys = {k for k in out["records"][step] if k.startswith("val-core/")}
        assert keys == {
            "val-core/addition/acc/mean@4",
            "val-core/addition/acc/best@4/mean",
            "val-core/addition/acc/best@4/std",
            "val-core/addition/acc/pass@4",
        }
        assert "val-aux/addition/reward/best@2/mean" in out["records"][step]
    mean = sum(r["acc"] for r in val_rows) / 12
    assert out["records"][0]["val-core/addition/acc/mean@4"] == pytest.approx(mean)
