"""The dapo reward manager: verl 0.9.1's overlong penalty on a grid (verl's formula written out below from
its ``DAPORewardManager``, evaluated with torch as verl evaluates it), its extra values, and how verl's
keys select and configure it (both spellings; anything we do not implement refused, naming the key)."""

from __future__ import annotations

import math

import pytest
import torch

from splitproof.collective import default_collective
from splitproof.loss_config import ConfigError
from splitproof.rl.config.derive import reward_manager_of
from splitproof.rl.config.load import load_train_config
from splitproof.rl.rewards.dapo import OverlongBuffer, RewardManager, apply_manager, overlong_reward
from splitproof.rl.rewards.scored import Rewards


def verl_overlong_reward(valid_response_length: int, max_resp_len: int, buffer_len: int, penalty_factor: float):
    """verl 0.9.1 (``verl/experimental/reward_loop/reward_manager/dapo.py``, ``run_single``): the valid length
    is the attention mask's sum over the response, an integer tensor; the rest is plain Python on it."""
    valid = torch.tensor([1] * valid_response_length, dtype=torch.long).sum()
    expected_len = max_resp_len - buffer_len
    exceed_len = valid - expected_len
    return min(-exceed_len / buffer_len * penalty_factor, 0)


GRID = [(m, b, f) for m in (4, 16, 512) for b in (1, 3, 4, m) if b <= m for f in (1.0, 0.5, 0.1, 2.0)]


def test_overlong_penalty_equals_verls_on_a_grid():
    """Ours is float64, verl's a float32 tensor: equal to float32 rounding (measured: at most 1 float32 ulp)."""
    worst = 0.0
    for m, b, f in GRID:
        buffer = OverlongBuffer(length=b, penalty_factor=f, max_resp_len=m, log=True)
        for length in range(m + 1):
            ours, theirs = overlong_reward(length, buffer), float(verl_overlong_reward(length, m, b, f))
            assert (ours < 0) == (theirs < 0), (m, b, f, length)
            assert abs(ours - theirs) <= 2**-23 * abs(theirs), (m, b, f, length, ours, theirs)
            worst = max(worst, abs(ours - theirs))
        assert overlong_reward(m, buffer) == -f and overlong_reward(m - b, buffer) == 0.0
    print(f"largest |ours - verl's| over {len(GRID)} settings: {worst:.2e}")


def _managed(manager, scores, extras, lengths):
    """``apply_manager`` on per-sample scores and extra dicts, its result as per-sample lists again."""
    names = dict.fromkeys(name for extra in extras for name in extra)
    given = Rewards(
        torch.tensor(scores, dtype=torch.float64),
        {name: [extra.get(name, math.nan) for extra in extras] for name in names},
    )
    out = apply_manager(manager, given, lengths)
    return out.scores.tolist(), [
        {name: values[i] for name, values in out.extra.items() if not math.isnan(values[i])} for i in range(len(scores))
    ]


def test_manager_adds_the_penalty_and_verls_extra_values():
    buffer = OverlongBuffer(length=2, penalty_factor=1.0, max_resp_len=4, log=True)
    rewards, extras = _managed(RewardManager("dapo", buffer), [1.0, 0.5], [{}, {"acc": 0.0, "pred": 3.0}], [4, 1])
    assert rewards == [0.0, 0.5]
    assert extras == [
        {"acc": 1.0, "overlong_reward": -1.0, "overlong": 1.0},
        {"acc": 0.0, "pred": 3.0, "overlong_reward": 0.0, "overlong": 0.0},
    ]
    assert _managed(RewardManager("dapo"), [1.0], [{}], [9]) == ([1.0], [{"acc": 1.0}])
    assert _managed(RewardManager("naive"), [1.0], [{}], [9]) == ([1.0], [{}])


def test_scoring_applies_the_manager_to_every_sample(tmp_path):
    """``step.score_samples`` (training and validation alike) returns the manager's rewards and extras."""
    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.rl.data.prompts import load_prompts
    from splitproof.rl.rollout.hf import Sample
    from splitproof.rl.run import Reward
    from splitproof.rl.step import score_samples

    tokenizer = char_tokenizer()
    data = load_prompts("builtin://addition/train", tokenizer, max_prompt_length=16, max_samples=2)
    truth = str(data[0].columns["reward_model"]["ground_truth"])
    eos = tokenizer.eos_token_id
    samples = [
        Sample(0, 0, list(data[0].prompt_ids), tokenizer.encode(truth) + [eos], [], True),
        Sample(0, 1, list(data[0].prompt_ids), tokenizer.encode("x" * 6), [], False),
    ]
    buffer = OverlongBuffer(length=4, penalty_factor=0.5, max_resp_len=6, log=True)
    reward = Reward(fn=None, manager=RewardManager("dapo", buffer), tokenizer=tokenizer, total_steps=1)
    rewards = score_samples(reward, data, samples, 1, default_collective("cpu"))
    scores, extra = rewards.scores, rewards.extra
    lengths = [len(s.response_ids) for s in samples]
    penalties = [overlong_reward(n, buffer) for n in lengths]
    assert extra["acc"] == [1.0, 0.0] and extra["overlong_reward"] == penalties
    assert scores.tolist() == [1.0 + penalties[0], 0.0 + penalties[1]] and penalties[1] == -0.5


RECIPE = [
    "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len=2",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
    "+reward_model.reward_kwargs.max_resp_len=4",
]


def test_verls_two_spellings_select_the_same_manager():
    old = reward_manager_of(load_train_config(None, ["reward_model.reward_manager=dapo", *RECIPE]))
    new = reward_manager_of(
        load_train_config(
            None, ["reward.reward_manager.name=dapo", *[r.replace("reward_model.", "reward.") for r in RECIPE]]
        )
    )
    assert old == new == RewardManager("dapo", OverlongBuffer(length=2, penalty_factor=1.0, max_resp_len=4, log=False))
    assert reward_manager_of(load_train_config(None, [])) == RewardManager("naive")


@pytest.mark.parametrize(
    "overrides, key, words",
    [
        (["reward_model.reward_manager=prime"], "reward_model.reward_manager", "not implemented"),
        (["reward.reward_manager.name=batch"], "reward.reward_manager.name", "not implemented"),
        (
            [
                "reward_model.reward_manager=dapo",
                "reward.reward_manager.name=naive",
                "reward.reward_manager.name=batch",
            ],
            "reward_model.reward_manager",
            "set one of them",
        ),
        (["+reward.reward_kwargs.max_resp_len=4"], "reward.reward_kwargs", "only by the dapo"),
        (
            ["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong=1"],
            "reward.reward_kwargs.overlong",
            "unknown",
        ),
        (["reward_model.reward_manager=dapo", *RECIPE[:3]], "reward_model.reward_kwargs.max_resp_len", "must be set"),
        (
            ["reward_model.reward_manager=dapo", *RECIPE[:2]],
            "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
            "number",
        ),
        (
            ["reward_model.reward_manager=dapo", *RECIPE[:4], "+reward_model.reward_kwargs.max_resp_len=1"],
            "reward_model.reward_kwargs.overlong_buffer_cfg.len",
            "longer than",
        ),
        (
            [
                "reward_model.reward_manager=dapo",
                *RECIPE,
                "reward_model.reward_kwargs.overlong_buffer_cfg.len=6",
                "reward_model.reward_kwargs.max_resp_len=8",
            ],
            "reward_model.reward_kwargs.overlong_buffer_cfg.len",
            "longer than data.max_response_length",
        ),
    ],
)
def test_reward_manager_mistakes_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_train_config(None, overrides)
    assert info.value.field == key and words in str(info.value), str(info.value)


def test_the_built_in_dapo_recipe_loads_with_verls_dapo_settings():
    cfg = load_train_config("builtin://charlm-dapo", [])
    assert cfg.algorithm.filter_groups.enable and cfg.algorithm.filter_groups.metric == "acc"
    assert cfg.data.gen_batch_size == 2 * cfg.data.train_batch_size == 256
    assert cfg.actor_rollout_ref.actor.clip_ratio_high == 0.28 and not cfg.actor_rollout_ref.actor.use_kl_loss
    assert reward_manager_of(cfg) == RewardManager(
        "dapo", OverlongBuffer(length=2, penalty_factor=1.0, max_resp_len=6, log=True)
    )
    with pytest.raises(ConfigError, match="builtin://charlm-dapo"):
        load_train_config("builtin://charlm-dap", [])


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (["overlong_buffer_cfg.len=4", "overlong_buffer_cfg.penalty_factor=1.0"], "max_resp_len"),
        (
            ["overlong_buffer_cfg.len=0", "overlong_buffer_cfg.penalty_factor=1.0", "max_resp_len=64"],
            "overlong_buffer_cfg.len",
        ),
    ],
)
def test_an_error_about_reward_kwargs_you_set_calls_them_yours(kwargs, key, capsys):
    """reward_kwargs set key by key on the command line are the user's: the error names the key, and never
    calls the mapping verl's default."""
    from splitproof.cli import main

    overrides = [
        "reward_model.reward_manager=dapo",
        "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
        *(f"+reward_model.reward_kwargs.{kv}" for kv in kwargs),
        "trainer.total_training_steps=1",
    ]
    assert main(["train", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"splitproof: error: reward_model.reward_kwargs.{key}:"), err
    assert "default" not in err, err
