"""Rollout correction as pure functions: the truncated IS weights and the rollout_corr/ metrics against
plain float64 loops, and their independence from the row order and the padding width."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.rl.config.algorithm_schema import RolloutCorrectionConfig
from splitproof.rl.rollout.correction import (
    SAFETY_BOUND,
    is_metrics,
    offpolicy_metrics,
    rollout_correction,
    rollout_is_weights,
)


def _random_batch(seed: int, rows: int, width: int, scale: float):
    """Log-probs ≤ 0 for the rollout, old = rollout + a mismatch of size ``scale``; every row ≥ 1 token."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    rollout = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    old = rollout + torch.randn(rows, width, generator=g, dtype=torch.float64) * scale
    return old * mask, rollout * mask, mask


def _loop_weights(old, rollout, mask, level, threshold):
    """The formula, one token at a time in Python floats."""
    out = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    clip = lambda x: min(max(x, -SAFETY_BOUND), SAFETY_BOUND)  # noqa: E731
    for i in range(old.shape[0]):
        valid = [t for t in range(old.shape[1]) if mask[i, t]]
        total = math.fsum(float(old[i, t]) - float(rollout[i, t]) for t in valid)
        for t in valid:
            log_w = float(old[i, t]) - float(rollout[i, t]) if level == "token" else total
            out[i][t] = min(math.exp(clip(log_w)), threshold)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("scale, threshold", [(0.05, 2.0), (0.5, 1.2), (12.0, 3.0), (12.0, 1e12), (0.3, 0.5)])
def test_weights_match_a_plain_loop(level, scale, threshold):
    """Random inputs, mismatches from small to past the ±20 safety clamp, thresholds below 1 and past e^20."""
    for seed in range(3):
        old, rollout, mask = _random_batch(seed, rows=7, width=9, scale=scale)
        got = rollout_is_weights(old, rollout, mask, level, threshold)
        want = _loop_weights(old, rollout, mask, level, threshold)
        assert got.dtype == torch.float64 and not got.requires_grad
        assert torch.equal(got == 0, ~mask)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
        if level == "sequence":  # one weight per sequence, broadcast over its tokens
            assert all(len(set(got[i][mask[i]].tolist())) == 1 for i in range(len(got)))


def test_weights_truncate_and_clamp():
    old = torch.tensor([[0.0, 0.0, 30.0], [-25.0, 0.0, 0.0]], dtype=torch.float64)
    rollout = torch.zeros_like(old)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    token = rollout_is_weights(old, rollout, mask, "token", 2.0)
    assert token.tolist() == [[1.0, 1.0, 2.0], [math.exp(-20.0), 1.0, 0.0]]
    assert rollout_is_weights(old, rollout, mask, "token", 1e12)[0, 2] == math.exp(20.0)  # the safety bound
    seq = rollout_is_weights(old, rollout, mask, "sequence", 2.0)
    assert seq.tolist() == [[2.0, 2.0, 2.0], [math.exp(-20.0), math.exp(-20.0), 0.0]]
    f32 = rollout_is_weights(old.float(), rollout.float(), mask, "token", 2.0)
    assert f32.dtype == torch.float32


def test_metrics_match_a_plain_loop():
    old, rollout, mask = _random_batch(5, rows=6, width=8, scale=0.4)
    threshold = 1.5
    for level in ("token", "sequence"):
        w = rollout_is_weights(old, rollout, mask, level, threshold)
        got = is_metrics(w, old, rollout, mask, level, threshold)
        tokens = [(i, t) for i in range(6) for t in range(8) if mask[i, t]]
        ws = [float(w[i, t]) for i, t in tokens]
        mean = sum(ws) / len(ws)
        assert got["rollout_is_mean"] == pytest.approx(mean, rel=1e-14)
        assert got["rollout_is_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in ws) / len(ws)), rel=1e-12)
        assert got["rollout_is_eff_sample_size"] == pytest.approx(
            1 / (sum((x / mean) ** 2 for x in ws) / len(ws)), rel=1e-14
        )
        seq = [sum(float(w[i, t]) for t in range(8) if mask[i, t]) / int(mask[i].sum()) for i in range(6)]
        assert got["rollout_is_seq_mean"] == pytest.approx(sum(seq) / 6, rel=1e-14)
        assert got["rollout_is_seq_max_deviation"] == pytest.approx(max(abs(s - 1) for s in seq), rel=1e-12)
        deltas = [float(old[i, t] - rollout[i, t]) for i, t in tokens]
        if level == "token":
            assert got["rollout_is_ratio_fraction_high"] == sum(math.exp(d) > threshold for d in deltas) / len(deltas)
            assert got["rollout_is_max"] == max(ws) and got["rollout_is_min"] == min(ws)
        else:
            sums = [sum(float(old[i, t] - rollout[i, t]) for t in range(8) if mask[i, t]) for i in range(6)]
            assert got["rollout_is_ratio_fraction_high"] == sum(s > math.log(threshold) for s in sums) / 6
            assert got["rollout_is_max"] == pytest.approx(math.exp(max(sums)), rel=1e-13)
        assert 0 < got["rollout_is_ratio_fraction_high"] < 1  # the case is not vacuous
    off = offpolicy_metrics(old, rollout, mask)
    assert off["kl"] == pytest.approx(-sum(deltas) / len(deltas), rel=1e-13)
    assert off["k3_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in deltas) / len(deltas), rel=1e-12)
    assert off["chi2_token"] == pytest.approx(sum(math.exp(2 * d) for d in deltas) / len(deltas) - 1, rel=1e-12)
    old_means = [sum(float(old[i, t]) for t in range(8) if mask[i, t]) / int(mask[i].sum()) for i in range(6)]
    roll_means = [sum(float(rollout[i, t]) for t in range(8) if mask[i, t]) / int(mask[i].sum()) for i in range(6)]
    assert off["training_ppl"] == pytest.approx(sum(math.exp(-m) for m in old_means) / 6, rel=1e-13)
    assert off["rollout_log_ppl"] == pytest.approx(-sum(roll_means) / 6, rel=1e-13)
    diffs = [r - o for r, o in zip(roll_means, old_means)]
    assert off["log_ppl_diff_max"] == pytest.approx(max(diffs), rel=1e-12)
    assert off["ppl_ratio"] == pytest.approx(sum(math.exp(d) for d in diffs) / 6, rel=1e-13)
    assert off["chi2_seq"] == pytest.approx(sum(math.exp(2 * s) for s in sums) / 6 - 1, rel=1e-12)


def test_no_mismatch_gives_weights_one_and_zero_divergence():
    _, rollout, mask = _random_batch(1, rows=4, width=5, scale=0.0)
    for level in ("token", "sequence"):
        w = rollout_is_weights(rollout, rollout, mask, level, 2.0)
        assert torch.equal(w, mask.double())
        m = is_metrics(w, rollout, rollout, mask, level, 2.0)
        assert m["rollout_is_mean"] == m["rollout_is_eff_sample_size"] == 1.0 and m["rollout_is_std"] == 0.0
    off = offpolicy_metrics(rollout, rollout, mask)
    assert off["kl"] == off["k3_kl"] == off["chi2_token"] == off["chi2_seq"] == off["log_ppl_diff"] == 0.0


def test_chi2_estimates_are_never_negative():
    """Old log-probs below the rollout's on every token: mean(e^{2δ}) − 1 < 0 on this sample; χ² is floored at 0."""
    _, rollout, mask = _random_batch(2, rows=4, width=5, scale=0.0)
    old = rollout - 1e-8 * mask.double()
    off = offpolicy_metrics(old, rollout, mask)
    assert off["kl"] > 0 and off["chi2_token"] == 0.0 and off["chi2_seq"] == 0.0


@settings(max_examples=25)
@given(
    seed=st.integers(0, 10_000),
    rows=st.integers(1, 9),
    width=st.integers(1, 7),
    extra=st.integers(0, 4),
    level=st.sampled_from(["token", "sequence"]),
    threshold=st.sampled_from([0.8, 1.3, 2.0, 10.0]),
)
def test_metrics_depend_on_the_rows_alone(seed, rows, width, extra, level, threshold):
    """Permuting the rows or widening the padding changes no bit of any metric, and moves the weights with
    their rows: every mean is a correctly rounded sum."""
    old, rollout, mask = _random_batch(seed, rows, width, scale=0.7)
    config = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold)
    weights, metrics = rollout_correction(config, old, rollout, mask)
    perm = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    pad = lambda x: torch.cat([x, torch.zeros(rows, extra, dtype=x.dtype)], dim=1)  # noqa: E731
    w2, m2 = rollout_correction(config, pad(old[perm]), pad(rollout[perm]), pad(mask[perm]))
    assert m2 == metrics
    assert torch.equal(w2[:, :width], weights[perm]) and not w2[:, width:].any()
    assert all(name.startswith("rollout_corr/") for name in metrics)


def test_step_entry_follows_verl():
    old, rollout, mask = _random_batch(2, rows=3, width=4, scale=0.2)
    weights, metrics = rollout_correction(RolloutCorrectionConfig(), old, rollout, mask)
    assert weights is None and "rollout_corr/kl" in metrics and "rollout_corr/rollout_is_mean" not in metrics
    assert rollout_correction(RolloutCorrectionConfig(rollout_is="token"), old, None, mask) == (None, {})
    assert rollout_correction(RolloutCorrectionConfig(bypass_mode=True), old, rollout, mask) == (None, {})
    with pytest.raises(ValueError, match="rollout_is"):
        rollout_is_weights(old, rollout, mask, "geometric", 2.0)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        rollout_is_weights(old, rollout, mask, "token", float("nan"))
