"""An independent, deliberately plain float64 reference of verl 0.9.1's advantage estimators and of its
KL-in-reward, for tests only.

Python lists and per-row loops with left-to-right sums; no torch and nothing shared with
splitproof.advantages or splitproof.rl. Written from verl's semantics as docs/advantages.md states them,
including the constants verl evaluates in float32 (``f32`` below).
Inputs: ``rewards`` / ``values`` / ``mask`` as lists of rows, ``ids`` one group id per row.
``counts32``: verl counts tokens in float32 (a float32, integer or bool mask), else in float64.
"""

from __future__ import annotations

import math
import struct


def f32(x: float) -> float:
    """x rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]


def _groups(ids) -> dict:
    rows_of = {}
    for i, key in enumerate(ids):
        rows_of.setdefault(key, []).append(i)
    return rows_of


def _sum(values) -> float:
    total = 0.0
    for v in values:
        total += v
    return total


def _mean(values) -> float:
    return _sum(values) / len(values)


def _std(values) -> float:
    m = _mean(values)
    return math.sqrt(_sum([(v - m) ** 2 for v in values]) / (len(values) - 1))


def _scores(rewards) -> list[float]:
    return [_sum(row) for row in rewards]


def _broadcast(per_row, mask):
    return [[per_row[i] * m for m in mask[i]] for i in range(len(mask))]


def _whiten(x, mask, counts32: bool):
    valid = [x[i][t] for i in range(len(x)) for t in range(len(x[i])) if mask[i][t]]
    n = len(valid)
    if n < 2:
        raise ValueError("whitening needs at least 2 valid tokens")
    denominator = f32(n + f32(1e-8)) if counts32 else n + 1e-8
    bessel = f32(n / (n - 1)) if counts32 else n / (n - 1)
    mu = _sum(valid) / denominator
    var = _sum([(v - mu) ** 2 for v in valid]) / denominator * bessel
    scale = 1.0 / math.sqrt(var + 1e-8)
    return [[(v - mu) * scale for v in row] for row in x]


def _times_mask(x, mask):
    return [[x[i][t] * mask[i][t] for t in range(len(mask[i]))] for i in range(len(mask))]


def grpo(rewards, mask, ids, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores, rows_of = _scores(rewards), _groups(ids)
    out = []
    for i, key in enumerate(ids):
        group = [scores[j] for j in rows_of[key]]
        if len(group) == 1:
            mean, divisor = 0.0, f32(1.0 + f32(epsilon))
        else:
            mean, divisor = _mean(group), _std(group) + epsilon
        out.append((scores[i] - mean) / divisor if norm_adv_by_std_in_grpo else scores[i] - mean)
    adv = _broadcast(out, mask)
    return adv, adv


def rloo(rewards, mask, ids):
    scores, rows_of = _scores(rewards), _groups(ids)
    out = []
    for i, key in enumerate(ids):
        group = [scores[j] for j in rows_of[key]]
        n = len(group)
        out.append(scores[i] * n / (n - 1) - _mean(group) * n / (n - 1) if n > 1 else scores[i])
    adv = _broadcast(out, mask)
    return adv, adv


def opo(rewards, mask, ids):
    scores, rows_of = _scores(rewards), _groups(ids)
    lengths = [_sum(row) for row in mask]
    out = []
    for i, key in enumerate(ids):
        rows = rows_of[key]
        total_length = _sum([lengths[j] for j in rows])
        baseline = 0.0
        if len(rows) > 1 and total_length > 0:
            baseline = _sum([lengths[j] * scores[j] for j in rows]) / total_length
        out.append(scores[i] - baseline)
    adv = _broadcast(out, mask)
    return adv, adv


def grpo_passk(rewards, mask, ids, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores, rows_of = _scores(rewards), _groups(ids)
    out = [0.0] * len(scores)
    for rows in rows_of.values():
        if len(rows) < 2:
            raise ValueError("pass@k needs 2 samples per group")
        group = [scores[j] for j in rows]
        best = max(group)
        second = max(group[: group.index(best)] + group[group.index(best) + 1 :])
        margin = best - second
        if norm_adv_by_std_in_grpo:
            margin = margin / (_std(group) + epsilon)
        out[rows[group.index(best)]] = margin
    adv = _broadcast(out, mask)
    return adv, adv


def gpg(rewards, mask, ids, f_norm=1.0):
    scores, rows_of = _scores(rewards), _groups(ids)
    nonzero = len([s for s in scores if s != 0.0])
    alpha = f32(f32(1.0 / max(nonzero, 1)) * len(scores))  # verl: B / count, a float32 tensor op
    out = []
    for i, key in enumerate(ids):
        group = [scores[j] for j in rows_of[key]]
        mean = _mean(group) if len(group) > 1 else 0.0
        out.append(alpha * (scores[i] - mean) / f_norm)
    adv = _broadcast(out, mask)
    return adv, adv


def reinforce_plus_plus(rewards, mask, counts32, gamma=1.0):
    returns = []
    for row, m in zip(rewards, mask):
        running, out = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                running = row[t] + gamma * running
                out[t] = running
        returns.append(out)
    return _times_mask(_whiten(returns, mask, counts32), mask), returns


def reinforce_plus_plus_baseline(rewards, mask, ids, counts32):
    scores, rows_of = _scores(rewards), _groups(ids)
    centred = []
    for i, key in enumerate(ids):
        group = [scores[j] for j in rows_of[key]]
        centred.append(scores[i] - (_mean(group) if len(group) > 1 else 0.0))
    adv = _times_mask(_whiten(_broadcast(centred, mask), mask, counts32), mask)
    return adv, adv


def remax(rewards, mask, reward_baselines):
    returns, adv = [], []
    for row, m, b in zip(rewards, mask, reward_baselines):
        acc, out = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            acc = acc + row[t] * m[t]
            out[t] = acc
        returns.append(out)
        adv.append([out[t] - b * m[t] for t in range(len(row))])
    return adv, returns


def gae(rewards, mask, values, counts32, gamma=1.0, lam=1.0):
    raw, returns = [], []
    for row, m, v in zip(rewards, mask, values):
        next_value, last, out = 0.0, 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                delta = row[t] + gamma * next_value - v[t]
                last = delta + gamma * lam * last
                next_value = v[t]
            out[t] = last
        raw.append(out)
        returns.append([out[t] + v[t] for t in range(len(row))])
    return _whiten(raw, mask, counts32), returns


def kl_value(kind: str, logp: float, ref_logp: float) -> float:
    kind = kind[:-1] if kind.endswith("+") else kind
    d = logp - ref_logp
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = min(max(-d, -20.0), 20.0)
    return min(max(math.exp(x) - x - 1.0, -10.0), 10.0)


def kl_in_reward(scores, old, ref, mask, beta, kind, counts32):
    """(rewards, current_kl): r = s − β·m·k, KL = mean over rows of Σ_t m k / (n_i + 1e-8)."""
    rewards, row_means = [], []
    for s, o, r, m in zip(scores, old, ref, mask):
        k = [kl_value(kind, o[t], r[t]) if m[t] else 0.0 for t in range(len(m))]
        rewards.append([s[t] - beta * k[t] for t in range(len(m))])
        n = _sum(m)
        row_means.append(_sum(k) / (f32(n + f32(1e-8)) if counts32 else n + 1e-8))
    return rewards, _sum(row_means) / len(row_means)


def adaptive_kl_update(value, current_kl, target_kl, horizon, n_steps):
    error = current_kl / target_kl - 1
    error = -0.2 if error < -0.2 else 0.2 if error > 0.2 else error
    return value * (1 + error * n_steps / horizon)
