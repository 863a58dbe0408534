"""KL estimators for the KL loss (``kl_loss_type``), with verl's names."""

from __future__ import annotations

from torch import Tensor


def _base_estimate(kind: str, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    diff = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        x = (-diff).clamp(-20.0, 20.0)
        return (x.exp() - x - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl_loss_type: unknown {kind!r}")


def kl_estimate(kind: str, log_prob: Tensor, ref_log_prob: Tensor) -> Tensor:
    """Per-token KL(π_θ‖π_ref) estimate; a trailing '+' keeps the value but takes the gradient of k2."""
    if not kind.endswith("+"):
        return _base_estimate(kind, log_prob, ref_log_prob)
    value = _base_estimate(kind[:-1], log_prob, ref_log_prob)
    k2 = _base_estimate("k2", log_prob, ref_log_prob)
    return value.detach() + k2 - k2.detach()
