"""Training against a reward model: the run is the same for every reward-model micro-batching, token budget
and engine layout (rollouts, weights, metrics), and it reports the model's score, the rule's ``acc`` and the
time in the model under their names."""

from __future__ import annotations

import pytest

from .reward_model_helpers import save_tiny_reward_model
from .rl_helpers import (
    HERE,
    LAYOUTS,
    assert_same_trajectory,
    assert_usage_error,
    run_trajectory,
    save_tiny_char_model,
    train_overrides,
    trajectory_config,
)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm_run")
    return save_tiny_char_model(root / "policy", dtype=__import__("torch").float64), save_tiny_reward_model(root)


def _config(dirs, *extra):
    policy, rm = dirs
    rm_keys = [
        "custom_reward_function.path=null",
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={rm}",
    ]
    return trajectory_config(policy, 2, rm_keys + list(extra))


def test_a_run_against_the_reward_model_does_not_depend_on_its_layout(dirs):
    want = run_trajectory(_config(dirs))
    record = want["records"][-1]
    assert {"reward/rm_score/mean", "reward/acc/mean", "timing_s/reward_model"} <= set(record)
    assert record["critic/score/mean"] == pytest.approx(record["reward/rm_score/mean"], rel=1e-12)
    layouts = [
        ["reward.reward_model.micro_batch_size_per_gpu=1", *LAYOUTS["ones"]],
        [
            "reward_model.use_dynamic_bsz=true",
            "reward_model.forward_max_token_len_per_gpu=45",
            *LAYOUTS["budget-packed"],
        ],
    ]
    for layout in layouts:
        assert_same_trajectory(run_trajectory(_config(dirs, *layout)), want)


RM_MISTAKES = {
    "not a classifier": (["reward.reward_model.model_path={causal}"], ["reward.reward_model.model_path", "classifier"]),
    "no path": (["reward.reward_model.model_path=null"], ["reward.reward_model.model_path", "no model_path"]),
    "function without rm_score": (
        [f"custom_reward_function.path={HERE / 'spread_reward.py'}", "custom_reward_function.name=compute_score"],
        ["rm_score"],
    ),
}


@pytest.mark.parametrize("mistake", sorted(RM_MISTAKES))
def test_reward_model_mistakes_are_one_line_and_exit_2_before_any_model(mistake, dirs, tmp_path, monkeypatch, capsys):
    from splitproof.builtin import charlm_directory
    from splitproof.cli import main
    from splitproof.rl import run as run_module

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    overrides, words = RM_MISTAKES[mistake]
    out = tmp_path / "out"
    args = train_overrides(dirs[0], out, 2) + [
        "custom_reward_function.path=null",
        "custom_reward_function.name=null",
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={dirs[1]}",
    ]
    code = main(["train", *args, *[o.format(causal=charlm_directory()) for o in overrides]])
    assert_usage_error(code, capsys.readouterr().err, words, out)
