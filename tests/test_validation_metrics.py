"""Held-out metrics with n > 1 samples: verl's names, exact best/worst (checked by enumeration and against
verl's bootstrap estimate, written out below as its ``bootstrap_metric`` draws), the unbiased pass@k (checked
by enumeration), and which names go under val-core and val-aux."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from splitproof.rl.tracking.held_out import best_of, majority_of, pass_at_k, subset_sizes, validation_metrics, worst_of

VALUES = [0.0, 1.0, 0.5, 1.0, -1.0]


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_best_and_worst_are_the_exact_with_replacement_expectations(k):
    tuples = list(itertools.product(VALUES, repeat=k))
    for ours, reduce in ((best_of(VALUES, k), max), (worst_of(VALUES, k), min)):
        picked = [reduce(t) for t in tuples]
        mean = sum(picked) / len(picked)
        std = math.sqrt(sum((x - mean) ** 2 for x in picked) / len(picked))
        assert ours == pytest.approx((mean, std), abs=1e-12)


def verl_bootstrap(values, k, reduce, seed=42, draws=1000):
    """verl 0.9.1's ``bootstrap_metric``: NumPy's global generator seeded, draws with replacement."""
    np.random.seed(seed)
    idx = np.random.choice(len(values), size=(draws, k), replace=True)
    results = np.array([reduce(np.array(values)[row]) for row in idx])
    return float(results.mean()), float(results.std())


@pytest.mark.parametrize("k", [2, 4])
def test_best_of_is_the_limit_of_verls_bootstrap(k):
    """verl's estimate is within four of its own standard errors of the exact value."""
    for ours, reduce in ((best_of(VALUES, k), np.max), (worst_of(VALUES, k), np.min)):
        mean, std = verl_bootstrap(VALUES, k, reduce)
        assert abs(mean - ours[0]) <= 4 * ours[1] / math.sqrt(1000) and abs(std - ours[1]) < 0.1 * ours[1]


def test_pass_at_k_is_unbiased():
    """The estimator equals the fraction of k-subsets (without replacement) holding a correct sample."""
    for n, c, k in [(5, 0, 2), (5, 1, 2), (5, 2, 3), (8, 3, 8), (8, 7, 1), (6, 6, 4)]:
        subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_majority_picks_the_most_common_prediction():
    assert majority_of([1.0, 0.0, 0.0], [7.0, 3.0, 3.0], 1)[0] == pytest.approx(1 / 3, abs=0.05)
    assert majority_of([1.0, 1.0, 0.0], [7.0, 7.0, 3.0], 1) == majority_of([1.0, 1.0, 0.0], [7.0, 7.0, 3.0], 1)


def test_names_and_sections_follow_verl():
    sources = ["a"] * 8 + ["b"] * 4
    uids = [0] * 4 + [1] * 4 + [2] * 4
    acc = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    scores = [a - 0.1 for a in acc]
    metrics = validation_metrics(sources, uids, scores, {"acc": acc})
    assert subset_sizes(4) == [2, 4] and subset_sizes(5) == [2, 4, 5] and subset_sizes(1) == []
    core = {k for k in metrics if k.startswith("val-core/a/")}
    assert core == {
        "val-core/a/acc/mean@4",
        "val-core/a/acc/best@4/mean",
        "val-core/a/acc/best@4/std",
        "val-core/a/acc/pass@4",
    }
    assert metrics["val-core/a/acc/mean@4"] == (0.25 + 1.0) / 2
    assert metrics["val-core/a/acc/pass@4"] == 1.0 and metrics["val-aux/a/acc/pass@2"] == (0.5 + 1.0) / 2
    assert metrics["val-core/b/acc/pass@4"] == 0.0 and metrics["val-aux/a/acc/std@4"] == pytest.approx(
        (math.sqrt(0.25 * 0.75) + 0) / 2
    )
    assert {"val-aux/a/reward/mean@4", "val-aux/a/reward/best@2/mean", "val-aux/a/acc/worst@4/std"} <= metrics.keys()
    assert not any("pass@" in k for k in metrics if "/reward/" in k)
    single = validation_metrics(["a", "a"], [0, 1], [0.5, 1.0], {})
    assert single == {"val-core/a/reward/mean@1": 0.75}
