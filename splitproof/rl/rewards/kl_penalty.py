"""KL in the reward (verl's ``algorithm.use_kl_in_reward``): the fixed and adaptive KL controllers of
``algorithm.kl_ctrl`` and ``apply_kl_penalty``.

    r_{i,t} = s_{i,t} − β · m_{i,t} · k(log π_old, log π_ref)_{i,t}

β is the controller's value before this step's update; k is the per-token estimate named by
``algorithm.kl_penalty``. The KL the controller sees is the mean over rows of each row's masked mean,
    KL = (1/B) Σ_i [Σ_t m_{i,t} k_{i,t} / (n_i + 1e-8)],
and it is updated once per step with n_steps = B. Sums are correctly rounded (``math.fsum``), so the
result does not depend on the order of the rows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields

import torch
from torch import Tensor

from ...advantages.exact import count_dtype, counts_plus_eps
from ...batch import BatchError, check_binary_mask, check_finite_on
from ...loss_config import KL_TYPES, ConfigError, is_finite_number, require
from ...losses.kl import kl_estimate
from ..config.algorithm_schema import KLControlConfig

KL_CTRL_TYPES = ("fixed", "adaptive")
_PREFIX = "algorithm.kl_ctrl."


def check_kl_control(config: KLControlConfig) -> KLControlConfig:
    """``config`` (verl's ``algorithm.kl_ctrl``: same keys, same defaults), or a ``ConfigError`` naming the key."""
    require(
        config.type in KL_CTRL_TYPES,
        _PREFIX + "type",
        f"unknown {config.type!r}; expected one of {', '.join(KL_CTRL_TYPES)}",
    )
    require(
        is_finite_number(config.kl_coef) and config.kl_coef >= 0,
        _PREFIX + "kl_coef",
        f"must be a finite number >= 0, got {config.kl_coef!r}",
    )
    if config.type == "adaptive":
        require(
            isinstance(config.horizon, int) and not isinstance(config.horizon, bool) and config.horizon > 0,
            _PREFIX + "horizon",
            f"must be an int > 0, got {config.horizon!r}",
        )
        require(
            is_finite_number(config.target_kl) and config.target_kl > 0,
            _PREFIX + "target_kl",
            f"must be > 0, got {config.target_kl!r}",
        )
    return config


class _KLController:
    type: str
    value: float

    def state_dict(self) -> dict:
        """What a checkpoint must keep: the current coefficient."""
        return {"type": self.type, "value": self.value}

    def load_state_dict(self, state: Mapping) -> None:
        require(
            state.get("type") == self.type,
            "kl_ctrl state",
            f"is for a {state.get('type')!r} controller, this one is {self.type!r}",
        )
        require(
            is_finite_number(state.get("value")),
            "kl_ctrl state",
            f"value must be a finite number, got {state.get('value')!r}",
        )
        self.value = float(state["value"])

    @staticmethod
    def _check_update(current_kl: float, n_steps: int) -> None:
        require(is_finite_number(current_kl), "current_kl", f"must be a finite number, got {current_kl!r}")
        require(
            isinstance(n_steps, int) and not isinstance(n_steps, bool) and n_steps >= 0,
            "n_steps",
            f"must be an int >= 0, got {n_steps!r}",
        )


class FixedKLController(_KLController):
    """β stays ``kl_coef``."""

    type = "fixed"

    def __init__(self, kl_coef: float):
        check_kl_control(KLControlConfig(type="fixed", kl_coef=kl_coef))
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        self._check_update(current_kl, n_steps)


class AdaptiveKLController(_KLController):
    """Ziegler et al. (2019): β ← β · (1 + e · n_steps / horizon), e = clip(KL / target_kl − 1, −0.2, 0.2)."""

    type = "adaptive"

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        check_kl_control(KLControlConfig(type="adaptive", kl_coef=init_kl_coef, target_kl=target_kl, horizon=horizon))
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        self._check_update(current_kl, n_steps)
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def kl_control_config(kl_ctrl) -> KLControlConfig:
    """A ``KLControlConfig`` from a mapping (dict, OmegaConf), an object with the keys as attributes, or None."""
    if kl_ctrl is None or isinstance(kl_ctrl, KLControlConfig):
        return check_kl_control(kl_ctrl or KLControlConfig())
    keys = [f.name for f in fields(KLControlConfig)]
    if isinstance(kl_ctrl, Mapping):
        given = dict(kl_ctrl)
        unknown = sorted(set(given) - set(keys))
        if unknown:
            raise ConfigError(_PREFIX + str(unknown[0]), f"unknown key; known: {', '.join(keys)}")
    else:
        given = {key: getattr(kl_ctrl, key) for key in keys if hasattr(kl_ctrl, key)}
    return check_kl_control(KLControlConfig(**given))


def make_kl_controller(kl_ctrl) -> FixedKLController | AdaptiveKLController:
    """verl's ``get_kl_controller``: the controller ``algorithm.kl_ctrl`` describes (see ``kl_control_config``)."""
    config = kl_control_config(kl_ctrl)
    if config.type == "fixed":
        return FixedKLController(config.kl_coef)
    return AdaptiveKLController(config.kl_coef, config.target_kl, config.horizon)


def kl_penalty_kind(kl_penalty: str) -> str:
    """The per-token estimator of ``algorithm.kl_penalty`` (a '+' suffix only changes gradients, none here)."""
    field = "algorithm.kl_penalty"
    if kl_penalty == "full":
        raise ConfigError(
            field,
            "'full' needs both policies' whole vocabulary distributions, which the reward "
            f"stage does not keep; use one of {', '.join(KL_TYPES)}",
        )
    base = kl_penalty[:-1] if isinstance(kl_penalty, str) and kl_penalty.endswith("+") else kl_penalty
    require(
        base in KL_TYPES, field, f"unknown {kl_penalty!r}; expected one of {', '.join(KL_TYPES)} (optionally with '+')"
    )
    return base


def _float64(name: str, value, shape: tuple[int, ...], valid: Tensor) -> Tensor:
    if not isinstance(value, Tensor) or not value.is_floating_point() or tuple(value.shape) != shape:
        raise BatchError(
            name,
            f"must be a floating-point tensor of shape {list(shape)}, got "
            f"{getattr(value, 'dtype', type(value).__name__)} {list(getattr(value, 'shape', []))}",
        )
    copy = value.detach().to(device="cpu", dtype=torch.float64)
    check_finite_on(name, copy, valid)
    return copy


def apply_kl_penalty(
    token_level_scores: Tensor,
    old_log_probs: Tensor,
    ref_log_probs: Tensor,
    response_mask: Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[Tensor, dict[str, float]]:
    """Token-level rewards with the KL penalty, and verl's metrics; updates ``kl_ctrl`` once (n_steps = B).

    ``old_log_probs`` are the actor's log-probs of the responses before the update (verl's
    ``old_log_probs``), ``ref_log_probs`` the reference policy's. Metrics: ``actor/reward_kl_penalty``
    (the KL above) and ``actor/reward_kl_penalty_coeff`` (β used for these rewards). Computed in float64;
    the rewards come back in the dtype and on the device of ``token_level_scores``.
    """
    kind = kl_penalty_kind(kl_penalty)
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2:
        raise BatchError("response_mask", f"must be a [B, T] tensor, got {getattr(response_mask, 'shape', None)}")
    shape = tuple(response_mask.shape)
    if shape[0] == 0:
        raise BatchError("response_mask", "the batch is empty")
    valid = check_binary_mask("response_mask", response_mask.detach().cpu())
    scores = _float64("token_level_scores", token_level_scores, shape, torch.ones_like(valid))
    old = _float64("old_log_probs", old_log_probs, shape, valid)
    ref = _float64("ref_log_probs", ref_log_probs, shape, valid)

    kld = torch.where(valid, kl_estimate(kind, torch.where(valid, old, 0.0), torch.where(valid, ref, 0.0)), 0.0)
    beta = kl_ctrl.value
    rewards = scores - beta * kld
    denominators = counts_plus_eps(valid.sum(-1), count_dtype(response_mask.dtype)).tolist()
    row_means = [math.fsum(row) / d for row, d in zip(kld.tolist(), denominators)]
    current_kl = math.fsum(row_means) / shape[0]
    kl_ctrl.update(current_kl, n_steps=shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return rewards.to(dtype=token_level_scores.dtype, device=token_level_scores.device), metrics
