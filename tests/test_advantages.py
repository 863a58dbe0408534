"""splitproof.advantages against the independent float64 reference (tests/advantage_reference.py),
plus edge cases, dtypes, row-order independence and errors."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.advantage_reference as ref
from splitproof.advantages import (
    ESTIMATORS,
    NEEDS_GROUPS,
    OPTIONS,
    AdvantageError,
    AdvantageOptionError,
    GroupsRequiredError,
    UnknownEstimatorError,
    check_samples_per_prompt,
    compute_advantage,
    requires_groups,
)

D = torch.float64
MASK_DTYPES = (torch.float64, torch.float32, torch.int64, torch.bool)


@dataclass
class Case:
    rewards: list  # [B][T]
    mask: list  # [B][T] of 0/1
    ids: list
    values: list  # [B][T]
    baselines: list  # [B]
    mask_dtype: torch.dtype
    index_form: str
    chosen: dict  # estimator options (epsilon, gamma, ...)

    def tensors(self):
        return torch.tensor(self.rewards, dtype=D), torch.tensor(self.mask, dtype=self.mask_dtype)

    def index(self):
        if self.index_form == "ndarray":
            return np.array(self.ids, dtype=object)
        if self.index_form == "tensor":
            return torch.tensor(self.ids)
        return list(self.ids)

    def options(self):
        return dict(
            values=torch.tensor(self.values, dtype=D),
            reward_baselines=torch.tensor(self.baselines, dtype=D),
            **self.chosen,
        )


@st.composite
def cases(draw, max_groups=5, max_size=4, max_t=6):
    """The layout from hypothesis; the values from a seeded generator (cheap to draw)."""
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    b, t = sum(sizes), draw(st.integers(1, max_t))
    id_kind = draw(st.sampled_from(["int", "str"]))
    grid = draw(st.sampled_from([(0.0, 1.0), (0.0, 0.5, 1.0), tuple(k / 8 for k in range(-80, 81))]))
    dense = draw(st.booleans())
    forms = ["list", "ndarray"] + (["tensor"] if id_kind == "int" else [])
    mask_dtype, index_form = draw(st.sampled_from(MASK_DTYPES)), draw(st.sampled_from(forms))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))

    ids = [(7 * g - 3 if id_kind == "int" else f"uid-{g}") for g, size in enumerate(sizes) for _ in range(size)]
    rng.shuffle(ids)
    mask = []
    for _ in range(b):
        n, hole = rng.choice([0, t, rng.randint(0, t)]), rng.choice([-1, rng.randint(0, t - 1)])
        mask.append([1 if (p < n and p != hole) else 0 for p in range(t)])
    if dense:  # token-level rewards everywhere
        rewards = [[rng.choice(grid) for _ in range(t)] for _ in range(b)]
    else:  # one outcome reward on the last valid token (the last position of an empty row)
        rewards = [[0.0] * t for _ in range(b)]
        for i, row in enumerate(mask):
            rewards[i][max([p for p in range(t) if row[p]], default=t - 1)] = rng.choice(grid)
    values = [[rng.randint(-40, 40) / 16 for _ in range(t)] for _ in range(b)]
    baselines = [rng.randint(-16, 16) / 4 for _ in range(b)]
    chosen = {
        "epsilon": rng.choice([1e-6, 1e-3, 0.5]),
        "norm_adv_by_std_in_grpo": rng.random() < 0.7,
        "gamma": rng.choice([1.0, 0.9, 0.5]),
        "lam": rng.choice([1.0, 0.95, 0.0]),
        "f_norm": rng.choice([1.0, 2.0, -0.5]),
    }
    return Case(rewards, mask, ids, values, baselines, mask_dtype, index_form, chosen)


def reference(estimator: str, case: Case):
    r, m, ids, o = case.rewards, case.mask, case.ids, case.chosen
    counts32 = case.mask_dtype != torch.float64
    grpo_options = dict(epsilon=o["epsilon"], norm_adv_by_std_in_grpo=o["norm_adv_by_std_in_grpo"])
    return {
        "grpo": lambda: ref.grpo(r, m, ids, **grpo_options),
        "grpo_passk": lambda: ref.grpo_passk(r, m, ids, **grpo_options),
        "rloo": lambda: ref.rloo(r, m, ids),
        "opo": lambda: ref.opo(r, m, ids),
        "gpg": lambda: ref.gpg(r, m, ids, f_norm=o["f_norm"]),
        "reinforce_plus_plus": lambda: ref.reinforce_plus_plus(r, m, counts32, gamma=o["gamma"]),
        "reinforce_plus_plus_baseline": lambda: ref.reinforce_plus_plus_baseline(r, m, ids, counts32),
        "remax": lambda: ref.remax(r, m, case.baselines),
        "gae": lambda: ref.gae(r, m, case.values, counts32, gamma=o["gamma"], lam=o["lam"]),
    }[estimator]()


@pytest.mark.parametrize("estimator", ESTIMATORS)
@settings(max_examples=30)
@given(case=cases())
def test_matches_reference(estimator, case):
    rewards, mask = case.tensors()
    try:
        expected = reference(estimator, case)
    except ValueError:
        with pytest.raises(AdvantageError):
            compute_advantage(estimator, rewards, mask, case.index(), **case.options())
        return
    advantages, returns = compute_advantage(estimator, rewards, mask, case.index(), **case.options())
    assert advantages.dtype == D and returns.dtype == D
    torch.testing.assert_close(advantages, torch.tensor(expected[0], dtype=D), rtol=0, atol=1e-10)
    torch.testing.assert_close(returns, torch.tensor(expected[1], dtype=D), rtol=0, atol=1e-10)


@settings(max_examples=40)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_row_order_never_changes_a_value(case, seed):
    """Permuting the rows permutes the result, value for value (statistics use correctly rounded sums)."""
    rewards, mask = case.tensors()
    perm = torch.randperm(rewards.shape[0], generator=torch.Generator().manual_seed(seed))
    options = case.options()
    permuted = dict(options, values=options["values"][perm], reward_baselines=options["reward_baselines"][perm])
    ids = [case.ids[i] for i in perm.tolist()]
    for estimator in ESTIMATORS:
        try:
            straight = compute_advantage(estimator, rewards, mask, case.ids, **options)
        except AdvantageError:
            continue
        shuffled = compute_advantage(estimator, rewards[perm], mask[perm], ids, **permuted)
        for a, b in zip(straight, shuffled):
            assert torch.equal(a[perm], b), estimator


# --------------------------------------------------------------------------------------------- edge cases


def outcome(scores, width=3):
    """Rewards with each row's score on its last token, full masks."""
    rewards = torch.zeros(len(scores), width, dtype=D)
    rewards[:, -1] = torch.tensor(scores, dtype=D)
    return rewards, torch.ones(len(scores), width, dtype=D)


def test_grpo_group_of_one_keeps_its_score_over_one_plus_epsilon_in_float32():
    rewards, mask = outcome([2.5, 1.0, 3.0])
    adv, _ = compute_advantage("grpo", rewards, mask, ["solo", "pair", "pair"])
    # mean 0, std 1; verl evaluates 1 + epsilon in float32: 1.0000009536743164
    assert adv[0, 0].item() == 2.5 / 1.0000009536743164
    assert adv[0, 0].item() == pytest.approx(2.5, rel=1e-6)
    raw, _ = compute_advantage("grpo", rewards, mask, ["solo", "pair", "pair"], norm_adv_by_std_in_grpo=False)
    assert raw[0, 0].item() == 2.5


@pytest.mark.parametrize("estimator", sorted(NEEDS_GROUPS))
@pytest.mark.parametrize("score", [0.1, 1.0, 7.3, -123.456])
def test_a_group_of_equal_scores_gets_exactly_zero(estimator, score):
    rewards, mask = outcome([score] * 5 + [0.0, 1.0])
    ids = ["same"] * 5 + ["other"] * 2
    adv, returns = compute_advantage(estimator, rewards, mask, ids, epsilon=1e-300)
    if estimator == "reinforce_plus_plus_baseline":  # whitened with the other group: no longer 0, still finite
        assert torch.isfinite(adv).all()
        assert torch.equal(adv[:5], adv[:1].expand(5, -1))
    else:
        assert torch.equal(adv[:5], torch.zeros(5, 3, dtype=D))
    assert torch.isfinite(returns).all()


def test_opo_group_of_empty_rows_is_zero_not_nan():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 2.0], [3.0, 0.0], [1.0, 0.0]], dtype=D)
    mask = torch.tensor([[0, 0], [0, 0], [1, 0], [1, 1]], dtype=D)
    adv, _ = compute_advantage("opo", rewards, mask, [0, 0, 1, 1])
    assert torch.equal(adv[:2], torch.zeros(2, 2, dtype=D))
    assert adv[2, 0].item() == pytest.approx(3.0 - (1 * 3.0 + 2 * 1.0) / 3, abs=1e-15)


def test_grpo_passk_rewards_only_a_unique_best():
    rewards, mask = outcome([1.0, 3.0, 2.0, 5.0, 5.0, 0.0])
    adv, _ = compute_advantage("grpo_passk", rewards, mask, [0, 0, 0, 1, 1, 1], norm_adv_by_std_in_grpo=False)
    assert adv[:, -1].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_empty_batch_of_a_group_estimator():
    adv, returns = compute_advantage("grpo", torch.zeros(0, 4, dtype=D), torch.zeros(0, 4), [])
    assert adv.shape == returns.shape == (0, 4)


def test_gae_and_reinforce_skip_observation_tokens_and_ignore_padding_values():
    rewards = torch.tensor([[0.0, 5.0, 0.0, 1.0, float("nan")]], dtype=D)
    mask = torch.tensor([[1, 0, 1, 1, 0]], dtype=D)
    with pytest.raises(AdvantageError, match="token_level_rewards .row 0.: non-finite"):
        compute_advantage("reinforce_plus_plus", rewards, mask)
    rewards[0, 4] = 9.0
    _, returns = compute_advantage("reinforce_plus_plus", rewards, mask, gamma=0.5)
    assert returns.tolist() == [[0.25, 0.0, 0.5, 1.0, 0.0]]  # the 5.0 of the observation token is skipped


@pytest.mark.parametrize(
    "index",
    [
        [5, 5, 9, 9, 5],
        (5, 5, 9, 9, 5),
        np.array([5, 5, 9, 9, 5]),
        torch.tensor([5, 5, 9, 9, 5]),
        ["a", "a", "b", "b", "a"],
        np.array(["a", "a", "b", "b", "a"]),
        np.array(["a", "a", "b", "b", "a"], dtype=object),
    ],
)
def test_every_index_form_groups_the_same_rows(index):
    adv, _ = compute_advantage("grpo", *outcome([1.0, 2.0, 3.0, 5.0, 6.0]), index)
    expected, _ = compute_advantage("grpo", *outcome([1.0, 2.0, 3.0, 5.0, 6.0]), [0, 0, 1, 1, 0])
    assert torch.equal(adv, expected)


# ------------------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("estimator", ["grpo", "reinforce_plus_plus", "gae"])
def test_low_precision_input_is_computed_in_float64_and_returned_in_its_dtype(dtype, estimator):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(6, 5, generator=g).to(dtype)
    values = torch.randn(6, 5, generator=g).to(dtype)
    mask = torch.ones(6, 5)
    ids = [0, 0, 0, 1, 1, 1]
    adv, returns = compute_advantage(estimator, rewards, mask, ids, values=values)
    adv64, returns64 = compute_advantage(estimator, rewards.to(D), mask, ids, values=values.to(D))
    assert adv.dtype == returns.dtype == dtype
    assert torch.equal(adv, adv64.to(dtype)) and torch.equal(returns, returns64.to(dtype))


# ------------------------------------------------------------------------------------------------- errors


def test_unknown_estimator_lists_the_known_ones():
    with pytest.raises(UnknownEstimatorError, match="'grpoo'.*known: gae, grpo, ") as info:
        compute_advantage("grpoo", *outcome([1.0]), [0])
    assert isinstance(info.value, ValueError) and info.value.estimator == "grpoo"
    for name in ESTIMATORS:
        assert name in str(info.value)


@pytest.mark.parametrize("estimator, option", [("gae", "values"), ("remax", "reward_baselines")])
def test_missing_required_option_is_named(estimator, option):
    with pytest.raises(AdvantageOptionError, match=f"'{estimator}': option '{option}' is required") as info:
        compute_advantage(estimator, *outcome([1.0, 2.0]), [0, 1])
    assert info.value.option == option


def test_unknown_option_lists_the_known_ones():
    with pytest.raises(AdvantageOptionError, match="'norm_adv_by_std'.*known: " + ", ".join(OPTIONS)):
        compute_advantage("grpo", *outcome([1.0, 2.0]), [0, 0], norm_adv_by_std=False)


def test_options_an_estimator_does_not_read_are_ignored():
    a = compute_advantage("rloo", *outcome([1.0, 2.0]), [0, 0], gamma=0.5, lam=0.1, norm_adv_by_std_in_grpo=False)
    b = compute_advantage("rloo", *outcome([1.0, 2.0]), [0, 0])
    assert torch.equal(a[0], b[0])


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("epsilon", 0.0, "must be > 0"),
        ("epsilon", float("nan"), "finite"),
        ("gamma", "1", "finite"),
        ("norm_adv_by_std_in_grpo", 1, "True or False"),
        ("f_norm", 0.0, "must not be 0"),
    ],
)
def test_bad_option_values_are_named(option, value, message):
    estimator = {"gamma": "reinforce_plus_plus", "f_norm": "gpg"}.get(option, "grpo")
    with pytest.raises(AdvantageOptionError, match=f"option '{option}' {message}|option '{option}' must"):
        compute_advantage(estimator, *outcome([1.0, 2.0]), [0, 0], **{option: value})


@pytest.mark.parametrize(
    "index, message",
    [
        (None, "needs index"),
        ([0, 0, 1], "3 ids for 2 rows"),
        ([[0], [1]], r"row 0.*not a usable group id"),
        ([0, float("nan")], "row 1"),
        (np.zeros((2, 1)), "one-dimensional"),
        ("ab", "sequence of group ids"),
    ],
)
def test_bad_index_is_named(index, message):
    with pytest.raises(AdvantageError, match=message):
        compute_advantage("grpo", *outcome([1.0, 2.0]), index)


def test_bad_tensors_are_named():
    rewards, mask = outcome([1.0, 2.0])
    with pytest.raises(AdvantageError, match="response_mask .row 1.: must contain only 0 and 1"):
        compute_advantage("grpo", rewards, mask * torch.tensor([[1.0], [2.0]]), [0, 0])
    with pytest.raises(AdvantageError, match="does not match"):
        compute_advantage("grpo", rewards, mask[:, :2], [0, 0])
    with pytest.raises(AdvantageError, match="floating-point"):
        compute_advantage("grpo", rewards.long(), mask, [0, 0])
    with pytest.raises(AdvantageError, match=r"values must have shape \[2, 3\]"):
        compute_advantage("gae", rewards, mask, values=torch.zeros(2, 4, dtype=D))
    with pytest.raises(AdvantageError, match=r"reward_baselines must have shape \[2\]"):
        compute_advantage("remax", rewards, mask, reward_baselines=torch.zeros(2, 1, dtype=D))


def test_passk_group_of_one_is_named():
    with pytest.raises(GroupsRequiredError, match="'grpo_passk'.*group 'b' .row 2. has 1 sample"):
        compute_advantage("grpo_passk", *outcome([1.0, 2.0, 3.0]), ["a", "a", "b"])


def test_whitening_needs_two_valid_tokens():
    rewards, mask = outcome([1.0, 2.0])
    mask[:] = 0
    mask[0, 0] = 1
    for estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        with pytest.raises(AdvantageError, match=f"'{estimator}': whitens .* response_mask has 1"):
            compute_advantage(estimator, rewards, mask, [0, 0])


def test_which_estimators_need_groups():
    assert NEEDS_GROUPS == {"grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus_baseline"}
    for name in ESTIMATORS:
        assert (requires_groups(name) is not None) == (name in NEEDS_GROUPS)
    check_samples_per_prompt("gae", 1)
    check_samples_per_prompt("grpo", 2)
    with pytest.raises(
        GroupsRequiredError, match="'rloo': needs rollout.n >= 2 samples per prompt, got 1: its baseline"
    ):
        check_samples_per_prompt("rloo", 1)
    with pytest.raises(UnknownEstimatorError):
        requires_groups("ppo")
