"""Differences between two runs, and the verdict rule.

Differences are taken in float64 over every parameter at once (as one flat vector):
``*_max_abs_diff`` = max |a − b|, ``*_rel_diff`` = ‖a − b‖₂ / ‖b‖₂, for the accumulated gradient (before
clipping) and for the parameter update (after − before, so the update difference is after_a − after_b).
They accumulate chunk by chunk (:class:`Difference`), so a comparison needs no model-sized temporary.

Verdict: a comparison passes iff, for the gradient and for the update,

    rel_diff <= max(FACTOR × control rel_diff, FLOOR_EPS × eps(dtype))

with FACTOR = 16 and FLOOR_EPS = 64: within a small multiple of the floating-point floor that the control
measured on the same model, batch and split, and never stricter than 64 machine epsilons of the run's
dtype (a relative bound, i.e. 64·eps·‖update‖ in absolute terms); and the split's objective is within
:func:`objective_tolerance` of the independent float64 reference (``Context.reference``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

FACTOR = 16.0
FLOOR_EPS = 64.0
DIFF_FIELDS = ("grad_max_abs_diff", "grad_rel_diff", "update_max_abs_diff", "update_rel_diff")
CHUNK = 1 << 20  # elements converted to float64 at a time


class Difference:
    """max |a − b| and ‖a − b‖₂ of two flat vectors given piece by piece, in float64 (b None: 0)."""

    def __init__(self) -> None:
        self.max_abs = 0.0
        self._squares = 0.0

    def add(self, a: Tensor, b: Tensor | None = None) -> None:
        a = a.reshape(-1)
        for start in range(0, a.numel(), CHUNK):
            d = a[start : start + CHUNK].double()
            if b is not None:
                d = d - b.reshape(-1)[start : start + CHUNK].to(device=d.device, dtype=torch.float64)
            self.max_abs = max(self.max_abs, float(d.abs().max()))
            self._squares += float((d * d).sum())

    @property
    def norm(self) -> float:
        return math.sqrt(self._squares)

    def relative_to(self, norm: float) -> float:
        """‖a − b‖ / norm (0 when both are 0, inf when only the norm is)."""
        if norm == 0.0:
            return 0.0 if self._squares == 0.0 else math.inf
        return self.norm / norm


def eps_of(dtype: str | torch.dtype) -> float:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return float(torch.finfo(dtype).eps)


def tolerance(control: dict[str, float], dtype) -> dict[str, float]:
    """The bound each relative difference must stay under, from the control and the dtype."""
    floor = FLOOR_EPS * eps_of(dtype)
    return {name: max(FACTOR * control[name], floor) for name in ("grad_rel_diff", "update_rel_diff")}


def objective_tolerance(
    value: float, rounding: float, scale: float, dtype, control_deviation: float | None = None
) -> float:
    """The bound on |objective − J_ref|: how far the run's objective may sit from the float64 reference
    for reasons of precision alone.

    Default: max(FACTOR × rounding, FLOOR_EPS × eps(dtype) × scale) — the measured effect of the run dtype's
    log-probs, and a bound proportional to the size of the summed terms (``scale``, see
    ``Context.reference``), which holds however the terms cancel.

    With ``control_deviation`` — the control's own |objective − J_ref| on the same split, where the control
    is the same objective without its split-sensitive term (KL-Cov, Clip-Cov) and so sums the same terms
    in the same dtype — the measured floor replaces the size bound:
    max(FACTOR × control_deviation, FACTOR × rounding, FLOOR_EPS × eps(dtype) × |J|, FLOOR_EPS × eps(float64)
    × scale). The size bound is pessimistic where J is a near-cancelling sum (KL-Cov's token mean of
    zero-mean advantages × ratios can be 1e-5 from terms of size 1), and would then exceed |J| itself.
    """
    if control_deviation is None:
        return max(FACTOR * rounding, FLOOR_EPS * eps_of(dtype) * scale)
    return max(
        FACTOR * control_deviation,
        FACTOR * rounding,
        FLOOR_EPS * eps_of(dtype) * abs(value),
        FLOOR_EPS * eps_of(torch.float64) * scale,
    )


def verdict(figures: dict[str, float], bounds: dict[str, float]) -> str:
    """ "pass" iff every figure named in ``bounds`` is within its bound (NaN fails)."""
    ok = all(figures[name] <= bound for name, bound in bounds.items())
    return "pass" if ok else "fail"


def mask_agreement(a: frozenset | None, b: frozenset | None) -> float | None:
    """|a ∩ b| / |a ∪ b| (1.0 when both are empty); None when a mask is unknown."""
    if a is None or b is None:
        return None
    union = a | b
    return 1.0 if not union else len(a & b) / len(union)
