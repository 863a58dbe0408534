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

import torch
from torch import Tensor

from ..advantages.exact import row_sums

SAFETY_BOUND = 20.0  # |log-ratio| is clamped to this before exp (verl's bound: exp(20) ≈ 4.9e8)
LEVELS = ("token", "sequence")
PREFIX = "rollout_corr/"


def _log_ratios(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """δ = old − rollout in float64, 0 off the mask, and the boolean mask."""
    mask = response_mask.bool()
    delta = old_log_probs.detach().double() - rollout_log_probs.detach().double()
    return torch.where(mask, delta, torch.zeros_like(delta)), mask


def _sequence_sums(values: Tensor) -> Tensor:
    """Σ_t values[i, t] per row, correctly rounded (values already 0 off the mask)."""
    return torch.tensor(row_sums(values), dtype=torch.float64)


def rollout_is_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor, level: str,
                       threshold: float) -> Tensor:
    """Truncated importance weights [B, T] in ``old_log_probs``' dtype, detached, 0 on padding.

    token: w_t = min(exp(clip₂₀(δ_t)), C); sequence: w_t = min(exp(clip₂₀(Σ_s δ_s)), C) for every valid t;
    δ = old − rollout, C = ``threshold``.
    """
    if level not in LEVELS:
        raise ValueError(f"rollout_is: unknown {level!r}; expected one of {', '.join(LEVELS)}")
    if not (math.isfinite(threshold) and threshold > 0):
        raise ValueError(f"rollout_is_threshold: must be > 0 and finite, got {threshold!r}")
    delta, mask = _log_ratios(old_log_probs, rollout_log_probs, response_mask)
    log_w = delta if level == "token" else _sequence_sums(delta).unsqueeze(1).expand_as(delta)
    weights = log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().clamp(max=threshold)
    return torch.where(mask, weights, torch.zeros_like(weights)).to(old_log_probs.dtype)


def _token_mean(values: Tensor, mask: Tensor) -> float:
    """Σ m v / Σ m over the whole batch, correctly rounded."""
    return math.fsum(values[mask].tolist()) / int(mask.sum())


def _row_means(values: Tensor, mask: Tensor) -> Tensor:
    """Per-row masked mean Σ_t m v / Σ_t m; a row without tokens gives 0 (as verl's masked_mean)."""
    counts = mask.sum(dim=1).double()
    sums = _sequence_sums(torch.where(mask, values, torch.zeros_like(values)))
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.zeros_like(sums))


def _mean(values: Tensor) -> float:
    return math.fsum(values.tolist()) / values.numel()


def _sample_std(values: Tensor) -> float:
    """Unbiased std over the rows (as ``torch.std``); 0 for one row."""
    if values.numel() < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(math.fsum(((values - mean) ** 2).tolist()) / (values.numel() - 1))


def is_metrics(weights: Tensor, old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor,
               level: str, threshold: float) -> dict[str, float]:
    """verl's IS-weight statistics (names without the ``rollout_corr/`` prefix) of truncated ``weights``.

    ``rollout_is_mean`` = token mean w̄ of w; ``_std`` = its population std over tokens;
    ``_eff_sample_size`` = 1 / mean_t (w_t / w̄)² (w > 0 on valid tokens, so w̄ > 0); ``_ratio_fraction_high|low`` = share of
    untruncated weights above C | below 1/C (tokens, or sequences for ``sequence``); ``_max|_min`` = extreme
    truncated token weights (``sequence``: exp(clip(max S)) and exp(min S), untruncated); ``_seq_*`` =
    statistics of each sequence's mean weight (``_seq_fraction_*`` of its untruncated mean).
    """
    delta, mask = _log_ratios(old_log_probs, rollout_log_probs, response_mask)
    w = torch.where(mask, weights.detach().double(), torch.zeros_like(delta))
    if level == "token":
        raw = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    else:
        raw = _sequence_sums(delta).clamp(-SAFETY_BOUND, SAFETY_BOUND).exp().unsqueeze(1).expand_as(delta)
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    low = 1.0 / threshold
    mean = _token_mean(w, mask)
    out = {"rollout_is_mean": mean}
    if level == "sequence":
        sums = _sequence_sums(delta)
        out["rollout_is_max"] = math.exp(min(float(sums.max()), SAFETY_BOUND))
        out["rollout_is_min"] = math.exp(float(sums.min()))
        out["rollout_is_ratio_fraction_high"] = _mean((sums > math.log(threshold)).double())
        out["rollout_is_ratio_fraction_low"] = _mean((sums < math.log(low)).double())
    else:
        out["rollout_is_max"] = float(w[mask].max())
        out["rollout_is_min"] = float(w[mask].min())
        out["rollout_is_ratio_fraction_high"] = _token_mean((raw > threshold).double(), mask)
        out["rollout_is_ratio_fraction_low"] = _token_mean((raw < low).double(), mask)
    out["rollout_is_std"] = math.sqrt(_token_mean((w - mean) ** 2, mask)) if int(mask.sum()) > 1 else 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / _token_mean((w / mean) ** 2, mask)
    seq = _row_means(w, mask)
    raw_seq = _row_means(raw, mask)
    out.update({
        "rollout_is_seq_mean": _mean(seq),
        "rollout_is_seq_std": _sample_std(seq),
        "rollout_is_seq_max": float(seq.max()),
        "rollout_is_seq_min": float(seq.min()),
        "rollout_is_seq_max_deviation": float((seq - 1.0).abs().max()),
        "rollout_is_seq_fraction_high": _mean((raw_seq > threshold).double()),
        "rollout_is_seq_fraction_low": _mean((raw_seq < low).double()),
    })
    return out


def offpolicy_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, response_mask: Tensor) -> dict[str, float]:
    """verl's rollout-vs-training mismatch diagnostics (names without the ``rollout_corr/`` prefix).

    With ℓ̄ᵢ the mean log-prob of sequence i and δ = old − rollout:
    ``training_ppl`` = meanᵢ exp(−ℓ̄ᵢ^old), ``training_log_ppl`` = meanᵢ(−ℓ̄ᵢ^old) (``rollout_*`` alike);
    ``kl`` = mean_t(−δ) (KL(rollout ‖ old), direct estimator); ``k3_kl`` = mean_t(e^δ − 1 − δ);
    ``log_ppl_diff`` = meanᵢ dᵢ with dᵢ = ℓ̄ᵢ^rollout − ℓ̄ᵢ^old (also ``_abs_diff``, ``_max``, ``_min``);
    ``ppl_ratio`` = meanᵢ e^{dᵢ}; ``chi2_token`` = mean_t e^{2 clip₂₀(δ)} − 1;
    ``chi2_seq`` = meanᵢ e^{2 clip₂₀(Sᵢ)} − 1.
    """
    delta, mask = _log_ratios(old_log_probs, rollout_log_probs, response_mask)
    if not bool(mask.any()):
        raise ValueError("response_mask: no valid token in the batch")
    old_mean = _row_means(old_log_probs.detach().double(), mask)
    rollout_mean = _row_means(rollout_log_probs.detach().double(), mask)
    diff = rollout_mean - old_mean
    clipped = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_clipped = _sequence_sums(delta).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": _mean((-old_mean).exp()),
        "training_log_ppl": _mean(-old_mean),
        "kl": _token_mean(-delta, mask),
        "k3_kl": _token_mean(torch.expm1(delta) - delta, mask),
        "rollout_ppl": _mean((-rollout_mean).exp()),
        "rollout_log_ppl": _mean(-rollout_mean),
        "log_ppl_diff": _mean(diff),
        "log_ppl_abs_diff": _mean(diff.abs()),
        "log_ppl_diff_max": float(diff.max()),
        "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": _mean(diff.exp()),
        "chi2_token": _token_mean((2 * clipped).exp(), mask) - 1.0,
        "chi2_seq": _mean((2 * seq_clipped).exp()) - 1.0,
    }


def rollout_correction(config, old_log_probs: Tensor, rollout_log_probs: Tensor | None,
                       response_mask: Tensor) -> tuple[Tensor | None, dict[str, float]]:
    """The step's rollout correction: ``(rollout_is_weights or None, rollout_corr/ metrics)``.

    As verl's trainer: nothing without the rollout's log-probs or in bypass mode (the old log-probs *are*
    the rollout's there); otherwise the mismatch metrics always, and the truncated weights and their
    statistics when ``config.rollout_is`` is set. ``config``: an ``algorithm.rollout_correction`` section.
    """
    if rollout_log_probs is None or config.bypass_mode:
        return None, {}
    metrics = {}
    weights = None
    if config.rollout_is is not None:
        weights = rollout_is_weights(old_log_probs, rollout_log_probs, response_mask, config.rollout_is,
                                     config.rollout_is_threshold)
        metrics.update(is_metrics(weights, old_log_probs, rollout_log_probs, response_mask, config.rollout_is,
                                  config.rollout_is_threshold))
    metrics.update(offpolicy_metrics(old_log_probs, rollout_log_probs, response_mask))
    return weights, {PREFIX + name: value for name, value in metrics.items()}
