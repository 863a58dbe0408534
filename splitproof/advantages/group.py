"""Outcome estimators that compare the samples of one prompt (a group of rows with the same index).

Each function maps the per-row scores R_i = Σ_t r_{i,t} and the rows of each group to one scalar
advantage per row; the caller broadcasts it over the row's valid tokens. n is the size of the row's group.
"""

from __future__ import annotations

import torch

from .errors import GroupsRequiredError
from .exact import centred_mean, centred_weighted_mean, sample_std


def grpo(scores: list[float], groups: list[list[int]], *, epsilon: float, norm_adv_by_std_in_grpo: bool) -> list[float]:
    """A_i = (R_i − mean_g) / (std_g + ε), or R_i − mean_g without the std (Dr. GRPO).

    std is the unbiased standard deviation. A group of one has mean 0 and std 1, so A_i = R_i / (1 + ε)
    with 1 + ε evaluated in PyTorch's default float dtype, as verl does.
    """
    advantages = [0.0] * len(scores)
    for rows in groups:
        values = [scores[i] for i in rows]
        if len(rows) == 1:
            mean, divisor = 0.0, float(torch.tensor(1.0, device="cpu") + epsilon)
        else:
            mean = centred_mean(values)
            divisor = sample_std(values, mean) + epsilon
        for i in rows:
            centred = scores[i] - mean
            advantages[i] = centred / divisor if norm_adv_by_std_in_grpo else centred
    return advantages


def rloo(scores: list[float], groups: list[list[int]]) -> list[float]:
    """A_i = n/(n−1) · (R_i − mean_g) = R_i − mean of the other samples; a group of one keeps R_i."""
    advantages = list(scores)
    for rows in groups:
        n = len(rows)
        if n > 1:
            mean = centred_mean([scores[i] for i in rows])
            for i in rows:
                advantages[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return advantages


def opo(scores: list[float], groups: list[list[int]], lengths: list[float]) -> list[float]:
    """A_i = R_i − b_g, b_g = Σ_j L_j R_j / Σ_j L_j with L_j the row's valid-token count.

    A group of one has b = 0; so has a group whose rows are all empty (Σ L = 0; verl divides 0 by 0).
    """
    advantages = list(scores)
    for rows in groups:
        weights = [lengths[i] for i in rows]
        if len(rows) > 1 and sum(weights) > 0:
            baseline = centred_weighted_mean([scores[i] for i in rows], weights)
            for i in rows:
                advantages[i] = scores[i] - baseline
    return advantages


def grpo_passk(
    scores: list[float], groups: list[list[int]], ids: list, *, epsilon: float, norm_adv_by_std_in_grpo: bool
) -> list[float]:
    """Only the best row of a group gets an advantage: R_max − R_second (÷ (std_g + ε) with the flag).

    When the two best scores tie that advantage is 0, so which of them is "best" never matters.
    Every group needs n ≥ 2.
    """
    advantages = [0.0] * len(scores)
    for rows, group_id in zip(groups, ids):
        if len(rows) < 2:
            raise GroupsRequiredError(
                "grpo_passk", f"group {group_id!r} (row {rows[0]}) has 1 sample; pass@k needs at least 2 per group"
            )
        values = [scores[i] for i in rows]
        ranked = sorted(rows, key=lambda i: scores[i], reverse=True)
        advantage = scores[ranked[0]] - scores[ranked[1]]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (sample_std(values, centred_mean(values)) + epsilon)
        advantages[ranked[0]] = advantage
    return advantages


def gpg(scores: list[float], groups: list[list[int]], *, f_norm: float) -> list[float]:
    """A_i = α (R_i − mean_g) / f_norm, α = B / max(#{i : R_i ≠ 0}, 1) over the whole batch.

    A group of one has mean 0. α is evaluated in PyTorch's default float dtype, as verl does.
    """
    nonzero = sum(1 for r in scores if r != 0.0)
    alpha = float(len(scores) / torch.tensor(max(nonzero, 1), device="cpu"))
    advantages = [0.0] * len(scores)
    for rows in groups:
        mean = centred_mean([scores[i] for i in rows]) if len(rows) > 1 else 0.0
        for i in rows:
            advantages[i] = alpha * (scores[i] - mean) / f_norm
    return advantages


def group_centred(scores: list[float], groups: list[list[int]]) -> list[float]:
    """R_i − mean_g; a group of one keeps R_i (the centring of reinforce_plus_plus_baseline)."""
    centred = list(scores)
    for rows in groups:
        if len(rows) > 1:
            mean = centred_mean([scores[i] for i in rows])
            for i in rows:
                centred[i] = scores[i] - mean
    return centred
