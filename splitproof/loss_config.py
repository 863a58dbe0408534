"""Loss configuration with verl's field names and defaults (``actor`` and ``actor.policy_loss``).

Validated once, when constructed; everything downstream trusts it.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields, replace

LOSS_MODES = (
    "vanilla",
    "gspo",
    "geo_mean",
    "sapo",
    "gpg",
    "cispo",
    "dro",
    "dppo_tv",
    "dppo_kl",
    "clip_cov",
    "kl_cov",
)
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
    "group-mean-token-mean",
)
# The aggregation that needs a group id per sequence (RolloutBatch.index; verl's uid).
GROUP_AGG = "group-mean-token-mean"
KL_TYPES = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
COV_MODES = ("clip_cov", "kl_cov")

# Losses whose policy term has one aggregation by definition (verl forces the same ones).
FORCED_AGG = {
    "gspo": "seq-mean-token-mean",
    "sapo": "seq-mean-token-mean",
    "geo_mean": "sequence-mean",  # (1/G) sum_i l_i, a per-sequence loss
}

# The configured mode that gives the forced aggregation anyway: seq-mean-token-mean of a per-sequence loss
# (constant over a sequence's tokens) is (1/G) sum_i l_i, GMPO's sequence mean. No warning for it.
SAME_AS_FORCED = {"geo_mean": "seq-mean-token-mean"}

_warned_forced: set[tuple[str, str]] = set()


class ConfigError(ValueError):
    """A configuration value is unknown or out of range. The message names the field."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


def require(cond: bool, name: str, message: str) -> None:
    """Raise ``ConfigError(name, message)`` unless ``cond``."""
    if not cond:
        raise ConfigError(name, message)


def is_finite_number(x) -> bool:
    """An int or float (not a bool) that is finite."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class LossConfig:
    """The policy objective: verl's ``actor`` fields, same names, same defaults."""

    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None -> clip_ratio
    clip_ratio_high: float | None = None  # None -> clip_ratio
    clip_ratio_c: float = 3.0
    loss_scale_factor: float | None = None  # S of seq-mean-token-sum-norm; None -> rollout response width
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    seed: int = 42  # Clip-Cov's priority hash

    def __post_init__(self) -> None:
        require(
            self.loss_mode in LOSS_MODES,
            "loss_mode",
            f"unknown {self.loss_mode!r}; expected one of {', '.join(LOSS_MODES)}",
        )
        require(
            self.loss_agg_mode in AGG_MODES,
            "loss_agg_mode",
            f"unknown {self.loss_agg_mode!r}; expected one of {', '.join(AGG_MODES)}",
        )
        base_kl = self.kl_loss_type[:-1] if self.kl_loss_type.endswith("+") else self.kl_loss_type
        require(
            base_kl in KL_TYPES,
            "kl_loss_type",
            f"unknown {self.kl_loss_type!r}; expected one of {', '.join(KL_TYPES)} (optionally with '+')",
        )
        for name in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, name)
            if value is not None:
                require(is_finite_number(value) and value >= 0, name, f"must be a finite number >= 0, got {value!r}")
        require(
            is_finite_number(self.clip_ratio_c) and self.clip_ratio_c > 1.0,
            "clip_ratio_c",
            f"must be > 1, got {self.clip_ratio_c!r}",
        )
        if self.loss_scale_factor is not None:
            require(
                is_finite_number(self.loss_scale_factor) and self.loss_scale_factor > 0,
                "loss_scale_factor",
                f"must be > 0, got {self.loss_scale_factor!r}",
            )
        for name in ("entropy_coeff", "kl_loss_coef", "ppo_kl_coef"):
            value = getattr(self, name)
            require(is_finite_number(value), name, f"must be a finite number, got {value!r}")
        for name in ("tau_pos", "tau_neg"):
            value = getattr(self, name)
            require(is_finite_number(value) and value > 0, name, f"must be > 0, got {value!r}")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            value = getattr(self, name)
            require(is_finite_number(value) and 0 < value <= 1, name, f"must be in (0, 1], got {value!r}")
        require(
            is_finite_number(self.clip_cov_lb)
            and is_finite_number(self.clip_cov_ub)
            and self.clip_cov_lb < self.clip_cov_ub,
            "clip_cov_lb",
            f"must be < clip_cov_ub, got {self.clip_cov_lb!r} >= {self.clip_cov_ub!r}",
        )
        if self.loss_mode == "dro":
            require(
                self.dro_beta is not None and is_finite_number(self.dro_beta) and self.dro_beta > 0,
                "dro_beta",
                f"loss_mode 'dro' needs dro_beta > 0, got {self.dro_beta!r}",
            )
        require(
            isinstance(self.seed, int) and not isinstance(self.seed, bool), "seed", f"must be an int, got {self.seed!r}"
        )
        forced = FORCED_AGG.get(self.loss_mode)
        agrees = self.loss_agg_mode in (forced, SAME_AS_FORCED.get(self.loss_mode))
        if forced and not agrees and (self.loss_mode, self.loss_agg_mode) not in _warned_forced:
            _warned_forced.add((self.loss_mode, self.loss_agg_mode))
            warnings.warn(
                f"loss_mode {self.loss_mode!r} aggregates its policy term as {forced} by definition; "
                f"loss_agg_mode {self.loss_agg_mode!r} applies only to the entropy and KL terms",
                stacklevel=3,
            )

    @property
    def eps_low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def eps_high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high

    @property
    def policy_agg_mode(self) -> str:
        """The aggregation of the policy term: the configured mode unless the loss fixes its own."""
        return FORCED_AGG.get(self.loss_mode, self.loss_agg_mode)

    @property
    def is_cov(self) -> bool:
        return self.loss_mode in COV_MODES

    def replace(self, **changes) -> LossConfig:
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, values: dict) -> LossConfig:
        """Build from a verl-style dict; ``policy_loss`` may be nested as in verl's actor config."""
        flat = dict(values)
        nested = flat.pop("policy_loss", None) or {}
        flat.update(nested)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(flat) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; known fields: {', '.join(sorted(known))}")
        return cls(**flat)


@dataclass(frozen=True)
class ValueLossConfig:
    """The critic's value loss: verl's ``critic`` fields, same names, same defaults.

    ``cliprange_value`` c bounds how far a prediction may move from the critic's prediction before the
    update (clipped loss); ``loss_agg_mode`` aggregates over the critic's minibatch exactly as for the
    policy (``loss_scale_factor``: S of ``seq-mean-token-sum-norm``, else the rollout's response width).
    """

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        require(
            is_finite_number(self.cliprange_value) and self.cliprange_value > 0,
            "cliprange_value",
            f"must be a finite number > 0, got {self.cliprange_value!r}",
        )
        require(
            self.loss_agg_mode in AGG_MODES,
            "loss_agg_mode",
            f"unknown {self.loss_agg_mode!r}; expected one of {', '.join(AGG_MODES)}",
        )
        if self.loss_scale_factor is not None:
            require(
                is_finite_number(self.loss_scale_factor) and self.loss_scale_factor > 0,
                "loss_scale_factor",
                f"must be > 0, got {self.loss_scale_factor!r}",
            )

    def replace(self, **changes) -> ValueLossConfig:
        return replace(self, **changes)
