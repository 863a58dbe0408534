"""KL in the reward: controllers, their factory and checkpoints, and apply_kl_penalty against the
independent reference (tests/advantage_reference.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import tests.advantage_reference as ref
from splitproof.batch import BatchError
from splitproof.loss_config import KL_TYPES, ConfigError
from splitproof.rl.rewards.kl_penalty import (
    AdaptiveKLController,
    FixedKLController,
    KLControlConfig,
    apply_kl_penalty,
    make_kl_controller,
)

D = torch.float64


def batch(seed: int, b: int = 5, t: int = 6, mask_dtype=D):
    rng = random.Random(seed)
    mask = [[1 if p < n else 0 for p in range(t)] for n in [rng.choice([0, t, rng.randint(1, t)]) for _ in range(b)]]
    mask[0] = [1] * t  # at least one valid token
    scores = [[0.0] * (t - 1) + [rng.choice([0.0, 1.0])] for _ in range(b)]
    old = [[rng.uniform(-3, 0) for _ in range(t)] for _ in range(b)]
    refp = [[rng.uniform(-3, 0) for _ in range(t)] for _ in range(b)]
    return (
        scores,
        old,
        refp,
        mask,
        [torch.tensor(x, dtype=D) for x in (scores, old, refp)] + [torch.tensor(mask, dtype=mask_dtype)],
    )


@pytest.mark.parametrize("kind", KL_TYPES + ("k3+", "kl+"))
@pytest.mark.parametrize("mask_dtype", [D, torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("seed", range(4))
def test_kl_penalty_matches_reference(kind, mask_dtype, seed):
    scores, old, refp, mask, tensors = batch(seed, mask_dtype=mask_dtype)
    ctrl = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.5, horizon=100)
    rewards, metrics = apply_kl_penalty(*tensors, ctrl, kl_penalty=kind)
    expected, current_kl = ref.kl_in_reward(scores, old, refp, mask, 0.2, kind, counts32=mask_dtype != D)
    torch.testing.assert_close(rewards, torch.tensor(expected, dtype=D), rtol=0, atol=1e-12)
    assert metrics["actor/reward_kl_penalty"] == pytest.approx(current_kl, abs=1e-12)
    assert metrics["actor/reward_kl_penalty_coeff"] == 0.2  # the coefficient these rewards used
    assert ctrl.value == pytest.approx(ref.adaptive_kl_update(0.2, current_kl, 0.5, 100, n_steps=5), abs=1e-15)


def test_padding_is_never_read_and_rows_are_order_free():
    scores, old, refp, mask, (s, o, r, m) = batch(1)
    o[m == 0], r[m == 0] = float("nan"), float("inf")
    rewards, metrics = apply_kl_penalty(s, o, r, m, FixedKLController(0.1), "low_var_kl")
    assert torch.isfinite(rewards).all()
    perm = torch.tensor([3, 0, 4, 2, 1])
    permuted, metrics_p = apply_kl_penalty(s[perm], o[perm], r[perm], m[perm], FixedKLController(0.1), "low_var_kl")
    assert torch.equal(rewards[perm], permuted) and metrics == metrics_p


def test_rewards_come_back_in_the_score_dtype():
    _, _, _, _, (s, o, r, m) = batch(2)
    rewards, _ = apply_kl_penalty(s.float(), o.float(), r, m, FixedKLController(0.1))
    assert rewards.dtype == torch.float32


def test_fixed_controller_never_moves_and_adaptive_follows_the_formula():
    fixed = FixedKLController(0.05)
    fixed.update(3.0, 64)
    assert fixed.value == 0.05
    ctrl, value = AdaptiveKLController(0.1, target_kl=0.1, horizon=10000), 0.1
    for kl in [0.5, 0.0, 0.1, 0.11, 0.09, 10.0, 1e-9]:  # clipped at ±0.2 and inside
        ctrl.update(kl, n_steps=256)
        value = ref.adaptive_kl_update(value, kl, 0.1, 10000, 256)
        assert ctrl.value == value


def test_state_dict_round_trip_and_type_check():
    ctrl = make_kl_controller({"type": "adaptive", "kl_coef": 0.3})
    ctrl.update(1.0, 100)
    fresh = make_kl_controller({"type": "adaptive", "kl_coef": 0.3})
    fresh.load_state_dict(ctrl.state_dict())
    assert fresh.value == ctrl.value != 0.3
    with pytest.raises(ConfigError, match="kl_ctrl state: is for a 'adaptive' controller, this one is 'fixed'"):
        FixedKLController(0.3).load_state_dict(ctrl.state_dict())


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {},
        KLControlConfig(),
        OmegaConf.create({"type": "fixed", "kl_coef": 0.001}),
        SimpleNamespace(type="fixed", kl_coef=0.001, horizon=10000, target_kl=0.1),
    ],
)
def test_factory_defaults_are_verls(spec):
    ctrl = make_kl_controller(spec)
    assert isinstance(ctrl, FixedKLController) and ctrl.value == 0.001


def test_factory_builds_adaptive_from_omegaconf():
    ctrl = make_kl_controller(OmegaConf.create({"type": "adaptive", "kl_coef": 0.01, "target_kl": 0.2, "horizon": 5}))
    assert isinstance(ctrl, AdaptiveKLController)
    assert (ctrl.value, ctrl.target, ctrl.horizon) == (0.01, 0.2, 5)


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"type": "pid"}, "algorithm.kl_ctrl.type: unknown 'pid'; expected one of fixed, adaptive"),
        ({"type": "adaptive", "horizon": 0}, "algorithm.kl_ctrl.horizon: must be an int > 0"),
        ({"type": "adaptive", "target_kl": 0.0}, "algorithm.kl_ctrl.target_kl: must be > 0"),
        ({"kl_coef": -1.0}, "algorithm.kl_ctrl.kl_coef"),
        ({"kl_coeff": 0.1}, "algorithm.kl_ctrl.kl_coeff: unknown key"),
    ],
)
def test_bad_kl_ctrl_is_named(spec, field):
    with pytest.raises(ConfigError, match=field):
        make_kl_controller(spec)


def test_bad_kl_penalty_and_inputs_are_named():
    _, _, _, _, (s, o, r, m) = batch(3)
    ctrl = FixedKLController(0.1)
    with pytest.raises(ConfigError, match="algorithm.kl_penalty: 'full' needs both policies' whole vocabulary"):
        apply_kl_penalty(s, o, r, m, ctrl, "full")
    with pytest.raises(ConfigError, match="algorithm.kl_penalty: unknown 'k4'"):
        apply_kl_penalty(s, o, r, m, ctrl, "k4")
    o[0, 0] = float("nan")
    with pytest.raises(BatchError, match=r"old_log_probs \(sequence 0\): non-finite"):
        apply_kl_penalty(s, o, r, m, ctrl)
    with pytest.raises(BatchError, match="ref_log_probs: must be a floating-point tensor of shape"):
        apply_kl_penalty(s, r, r[:, :2], m, ctrl)
    with pytest.raises(BatchError, match="the batch is empty"):
        apply_kl_penalty(s[:0], o[:0], r[:0], m[:0], ctrl)
    with pytest.raises(ConfigError, match="current_kl: must be a finite number"):
        AdaptiveKLController(0.1, 0.1, 10).update(float("nan"), 4)
