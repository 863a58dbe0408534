"""Rollout correction (verl's ``algorithm.rollout_correction``): truncated importance weights between the
policy that generated the rollouts and the policy that recomputed the old log-probs, and the mismatch
metrics verl logs under ``rollout_corr/``.

With δ_t = log π_old(y_t) − log π_rollout(y_t) at response token t, m_t the response mask, S = Σ_t m_t δ_t
the sequence's log-ratio, C = ``rollout_is_threshold`` and clip₂₀ = clamp to [−20, 20] (verl's safety
bound, so that exp never overflows):

    token:     w_t = min(exp(clip₂₀(δ_t)), C) · m_t
    sequence:  w_t = min(exp(clip₂₀(S)), C) · m_t        (one weight, broadcast over the sequence)

"Truncated" is verl's TIS: weights above C are set to C, small weights are kept. Everything is computed in
float64 over the whole rollout batch, with correctly rounded sums (``math.fsum``), so a weight and a
metric are functions of the rows' values alone — never of the layout, the row order or the rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

SAFETY_BOUND = 20.0  # |log-ratio| is clamped to this before exp (verl's bound: exp(20) ≈ 4.9e8)
LEVELS = ("token", "sequence")
PREFIX = "rollout_corr/"


class _Tokens:
    """The valid tokens of a [B, T] batch flattened row by row (row i's tokens, then row i+1's), on the CPU,
    with correctly rounded sums per row and over the batch. A row without tokens has mean 0 (verl's
    ``masked_mean``)."""

    def __init__(self, response_mask: Tensor):
        self.mask = response_mask.bool().cpu()
        self.lengths = self.mask.sum(dim=1)
        counts = self.lengths.tolist()
        self.count = sum(counts)
        self._bounds = list(zip([0, *accumulate(counts)], accumulate(counts)))

    def of(self, values: Tensor) -> Tensor:
        """The valid entries of ``values`` [B, T], flattened, in float64."""
        return values.detach().double().cpu()[self.mask]

    def per_token(self, row_values: Tensor) -> Tensor:
        """One value per row, repeated over the row's tokens (flat)."""
        return row_values.repeat_interleave(self.lengths)

    def to_batch(self, flat: Tensor) -> Tensor:
        """Flat values back into [B, T], 0 off the mask."""
        out = torch.zeros(self.mask.shape, dtype=flat.dtype, device=self.mask.device)
        out[self.mask] = flat
        return out

    def row_sums(self, flat: Tensor) -> Tensor:
        values = flat.tolist()
        return torch.tensor([math.fsum(values[a:b]) for a, b in self._bounds], dtype=torch.float64, device="cpu")

    def row_means(self, flat: Tensor) -> Tensor:
        return self.row_sums(flat) / self.lengths.clamp(min=1).double()

    def mean(self, flat: Tensor) -> float:
        return math.fsum(flat.tolist()) / self.count

    def share(self, flags: Tensor) -> float:
        return int(flags.sum()) / self.count


def _mean(values: Tensor) -> float:
    return math.fsum(values.tolist()) / values.numel()


def _share(flags: Tensor) -> float:
    return int(flags.sum()) / flags.numel()


def _sample_std(values: Tensor) -> float:
    """Unbiased std over the rows (as ``torch.std``); 0 for one row."""
    if values.numel() < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(math.fsum(((values - mean) ** 2).tolist()) / (values.numel() - 1))


def _clipped_exp(log_values: Tensor) -> Tensor:
    return log_values.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


@dataclass(frozen=True)
class _Mismatch:
    """A batch's valid tokens and their log-probs (flat, float64), δ = old − rollout and S = Σ_t δ_t per row."""

    tokens: _Tokens
    old: Tensor
    rollout: Tensor
    delta: Tensor
    sums: Tensor


def _mismatch(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> _Mismatch:
    tokens = _Tokens(response_mask)
    old, rollout = tokens.of(old_log_probs), tokens.of(rollout_log_probs)
    delta = old - rollout
    return _Mismatch(tokens, old, rollout, delta, tokens.row_sums(delta))


def _raw_weights(m: _Mismatch, level: str) -> Tensor:
    """exp(clip₂₀(δ_t)) (token) or exp(clip₂₀(S)) over the sequence's tokens (sequence), flat."""
    if level not in LEVELS:
        raise ValueError(f"rollout_is: unknown {level!r}; expected one of {', '.join(LEVELS)}")
    return _clipped_exp(m.delta) if level == "token" else m.tokens.per_token(_clipped_exp(m.sums))


def _weights(m: _Mismatch, level: str, threshold: float) -> Tensor:
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"rollout_is_threshold: must be > 0 and finite, got {threshold!r}")
    return _raw_weights(m, level).clamp(max=threshold)


def rollout_is_weights(
    old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str, threshold: float
) -> Tensor:
    """Truncated importance weights [B, T] in ``old_log_probs``' dtype, detached, 0 on padding.

    token: w_t = min(exp(clip₂₀(δ_t)), C); sequence: w_t = min(exp(clip₂₀(Σ_s δ_s)), C) for every valid t;
    δ = old − rollout, C = ``threshold``.
    """
    m = _mismatch(old_log_probs, rollout_log_probs, response_mask)
    return m.tokens.to_batch(_weights(m, level, threshold)).to(old_log_probs.device, old_log_probs.dtype)


def is_metrics(
    weights: Tensor,
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    level: str,
    threshold: float,
) -> dict[str, float]:
    """verl's IS-weight statistics (names without the ``rollout_corr/`` prefix) of truncated ``weights``.

    ``rollout_is_mean`` = token mean w̄ of w; ``_std`` = its population std over tokens;
    ``_eff_sample_size`` = 1 / mean_t (w_t / w̄)² (w > 0 on valid tokens, so w̄ > 0);
    ``_ratio_fraction_high|low`` = share of untruncated weights above C | below 1/C (tokens, or sequences
    for ``sequence``); ``_max|_min`` = extreme truncated token weights (``sequence``: exp(clip₂₀(max S)) and
    exp(min S), untruncated); ``_seq_*`` = statistics of each sequence's mean weight
    (``_seq_fraction_*`` of its untruncated mean).
    """
    m = _mismatch(old_log_probs, rollout_log_probs, response_mask)
    return _is_metrics(m, m.tokens.of(weights), level, threshold)


def _is_metrics(m: _Mismatch, w: Tensor, level: str, threshold: float) -> dict[str, float]:
    tokens, sums = m.tokens, m.sums
    raw = _raw_weights(m, level)
    low = 1.0 / threshold
    mean = tokens.mean(w)
    out = {"rollout_is_mean": mean}
    if level == "sequence":
        out["rollout_is_max"] = math.exp(min(float(sums.max()), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(sums.min()))
        out["rollout_is_ratio_fraction_high"] = _share(sums > math.log(threshold))
        out["rollout_is_ratio_fraction_low"] = _share(sums < math.log(low))
    else:
        out["rollout_is_max"] = float(w.max())
        out["rollout_is_min"] = float(w.min())
        out["rollout_is_ratio_fraction_high"] = tokens.share(raw > threshold)
        out["rollout_is_ratio_fraction_low"] = tokens.share(raw < low)
    out["rollout_is_std"] = math.sqrt(tokens.mean((w - mean) ** 2)) if tokens.count > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / tokens.mean((w / mean) ** 2)
    seq = tokens.row_means(w)
    raw_seq = _clipped_exp(sums) if level == "sequence" else tokens.row_means(raw)  # a row's untruncated mean
    out.update(
        {
            "rollout_is_seq_mean": _mean(seq),
            "rollout_is_seq_std": _sample_std(seq),
            "rollout_is_seq_max": float(seq.max()),
            "rollout_is_seq_min": float(seq.min()),
            "rollout_is_seq_max_deviation": float((seq - 1.0).abs().max()),
            "rollout_is_seq_fraction_high": _share(raw_seq > threshold),
            "rollout_is_seq_fraction_low": _share(raw_seq < low),
        }
    )
    return out


def offpolicy_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's rollout-vs-training mismatch diagnostics (names without the ``rollout_corr/`` prefix).

    With ℓ̄ᵢ the mean log-prob of sequence i and δ = old − rollout:
    ``training_ppl`` = meanᵢ exp(−ℓ̄ᵢ^old), ``training_log_ppl`` = meanᵢ(−ℓ̄ᵢ^old) (``rollout_*`` alike);
    ``kl`` = mean_t(−δ) (KL(rollout ‖ old), direct estimator); ``k3_kl`` = mean_t(e^δ − 1 − δ);
    ``log_ppl_diff`` = meanᵢ dᵢ with dᵢ = ℓ̄ᵢ^rollout − ℓ̄ᵢ^old (also ``_abs_diff``, ``_max``, ``_min``);
    ``ppl_ratio`` = meanᵢ e^{dᵢ}; ``chi2_token`` = max(0, mean_t e^{2 clip₂₀(δ)} − 1);
    ``chi2_seq`` = max(0, meanᵢ e^{2 clip₂₀(Sᵢ)} − 1).

    The χ² estimates are verl's, floored at 0: E_rollout[w²] − 1 = χ²(old ‖ rollout) ≥ 0 because
    E_rollout[w] = 1, but on a finite sample the mean of w = e^δ is not exactly 1, so mean(w²) − 1 dips
    below 0 when the sampled tokens have w < 1 on balance (seen: −2.3e-8 with δ of order 1e-8). A
    negative estimate of a divergence says only "about 0", so it is reported as 0.
    """
    return _offpolicy_metrics(_mismatch(old_log_probs, rollout_log_probs, response_mask))


def _offpolicy_metrics(m: _Mismatch) -> dict[str, float]:
    tokens = m.tokens
    if tokens.count == 0:
        raise ValueError("response_mask: no valid token in the batch")
    old_mean, rollout_mean = tokens.row_means(m.old), tokens.row_means(m.rollout)
    diff = rollout_mean - old_mean
    return {
        "training_ppl": _mean((-old_mean).exp()),
        "training_log_ppl": _mean(-old_mean),
        "kl": -tokens.mean(m.delta),
        "k3_kl": tokens.mean(torch.expm1(m.delta) - m.delta),
        "rollout_ppl": _mean((-rollout_mean).exp()),
        "rollout_log_ppl": _mean(-rollout_mean),
        "log_ppl_diff": _mean(diff),
        "log_ppl_abs_diff": _mean(diff.abs()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": _mean(diff.exp()),
        "chi2_token": max(0.0, tokens.mean(_clipped_exp(m.delta) ** 2) - 1.0),
        "chi2_seq": max(0.0, _mean((2 * m.sums.clamp(-SAFETY_BOUND, SAFETY_BOUND)).exp()) - 1.0),
    }


def rollout_correction(
    config, old_log_probs: Tensor, rollout_log_probs: Tensor | None, response_mask: Tensor
) -> tuple[Tensor | None, dict[str, float]]:
    """The step's rollout correction: ``(rollout_is_weights or None, rollout_corr/ metrics)``.

    As verl's trainer: nothing without the rollout's log-probs or in bypass mode (the old log-probs *are*
    the rollout's there); otherwise the mismatch metrics always, and the truncated weights and their
    statistics when ``config.rollout_is`` is set. ``config``: an ``algorithm.rollout_correction`` section.
    """
    if rollout_log_probs is None or config.bypass_mode:
        return None, {}
    m = _mismatch(old_log_probs, rollout_log_probs, response_mask)
    metrics, weights = {}, None
    if config.rollout_is is not None:
        flat = _weights(m, config.rollout_is, config.rollout_is_threshold)
        weights = m.tokens.to_batch(flat).to(old_log_probs.device, old_log_probs.dtype)
        metrics.update(_is_metrics(m, flat, config.rollout_is, config.rollout_is_threshold))
    metrics.update(_offpolicy_metrics(m))
    return weights, {PREFIX + name: value for name, value in metrics.items()}
