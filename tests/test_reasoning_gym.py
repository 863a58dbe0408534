"""reasoning-gym tasks as data and reward (``reasoning-gym://TASK?...``): rows a function of the name, the
task's own ``score_answer`` as the reward, an unknown task one line with the close names before any model,
and a short run on a task. Needs the ``envs`` extra (reasoning-gym); the not-installed message does not."""

from __future__ import annotations

import sys

import pytest

from splitproof.cli import main
from splitproof.rl.data.files import DataError, read_rows
from splitproof.rl.rewards.functions import default_reward_for

from .rl_helpers import train_overrides
from .test_multiturn import _exit_2_before_any_model

QUERY = "min_terms=2&max_terms=2&min_digits=2&max_digits=2&allow_parentheses=false&allow_negation=false"
TEXT = f"reasoning-gym://basic_arithmetic?size=40&seed=3&{QUERY}&prompt=text&answer=raw&suffix=%3D"


def test_not_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(DataError, match=r"reasoning-gym is not installed: pip install 'splitproof\[envs\]'"):
        read_rows("reasoning-gym://chain_sum?size=4")


@pytest.fixture
def rg():
    return pytest.importorskip("reasoning_gym", reason="the envs extra (pip install 'splitproof[envs]')")


def test_rows_are_the_tasks_items_and_the_reward_its_score_answer(rg):
    rows = read_rows(TEXT)
    assert len(rows) == 40 and rows == read_rows(TEXT)
    library = rg.create_dataset(
        "basic_arithmetic",
        size=40,
        seed=3,
        min_terms=2,
        max_terms=2,
        min_digits=2,
        max_digits=2,
        allow_parentheses=False,
        allow_negation=False,
    )
    for row, entry in zip(rows, library):
        assert row["prompt"] == entry["question"] + "="
        assert row["reward_model"]["ground_truth"] == entry["answer"]
        reward = default_reward_for(row["data_source"])
        right = reward.fn(row["data_source"], f" {entry['answer']} ", None, row["extra_info"])
        wrong = reward.fn(row["data_source"], "x", None, row["extra_info"])
        assert right == {"score": 1.0, "acc": 1.0} and wrong["score"] == library.score_answer("x", entry)


def test_chat_prompts_and_answer_tags(rg):
    (row,) = read_rows("reasoning-gym://chain_sum?size=1&seed=0")
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert "<answer>" in row["prompt"][0]["content"]
    reward = default_reward_for(row["data_source"]).fn
    answer = row["reward_model"]["ground_truth"]
    assert reward(row["data_source"], f"so <answer>{answer}</answer>", None, row["extra_info"])["score"] == 1.0
    assert reward(row["data_source"], answer, None, row["extra_info"])["score"] == 0.0  # no tags: no answer


def test_an_unknown_task_names_the_close_ones(rg, tmp_path, monkeypatch, capsys):
    setup = ["data.train_files=reasoning-gym://basic_arithmetik?size=8"]
    words = ["basic_arithmetik", "close names: basic_arithmetic"]
    _exit_2_before_any_model(setup, words, tmp_path, monkeypatch, capsys)


def test_a_short_run_on_a_task(rg, tmp_path):
    out = tmp_path / "out"
    extra = [
        f"data.train_files={TEXT}",
        f"data.val_files={TEXT.replace('seed=3', 'seed=4')}",
        "data.max_prompt_length=24",
        "custom_reward_function.path=null",
        "custom_reward_function.name=null",
    ]
    assert main(["train", *train_overrides("builtin://charlm", out, 2, extra=extra)]) == 0
    text = (out / "metrics.jsonl").read_text()
    assert "val-core/reasoning_gym/basic_arithmetic/acc/mean@1" in text
