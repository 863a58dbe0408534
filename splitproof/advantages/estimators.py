"""The estimator table (verl's ``algorithm.adv_estimator`` names, option names and defaults) and
``compute_advantage``, which validates the inputs once and dispatches."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from numbers import Real

import torch
from torch import Tensor

from . import group
from .errors import AdvantageError, AdvantageOptionError, GroupsRequiredError, UnknownEstimatorError
from .exact import count_dtype, masked_whiten, row_sums
from .inputs import Groups, float64_copy, group_rows, mask_copy
from .returns import discounted_returns, gae_advantages, reward_to_go


@dataclass(frozen=True)
class EstimatorInputs:
    """The validated batch, in float64 on the CPU."""

    name: str
    rewards: Tensor  # [B, T] token-level rewards
    mask: Tensor  # [B, T] 0/1
    counts_in: torch.dtype  # the dtype verl counts tokens in (see exact.count_dtype)
    groups: Groups | None
    options: Mapping[str, object]

    @property
    def scores(self) -> list[float]:
        """R_i = Σ_t r_{i,t} over the whole row (as verl; the reward stage leaves padding at 0)."""
        return row_sums(self.rewards)

    def per_row(self, values: list[float]) -> Tensor:
        """One scalar per row, broadcast over the row's valid tokens (0 elsewhere)."""
        return torch.tensor(values, dtype=torch.float64, device=self.mask.device).reshape(-1, 1) * self.mask

    def whiten(self, x: Tensor) -> Tensor:
        return masked_whiten(self.name, x, self.mask, self.counts_in)


Result = tuple[Tensor, Tensor]


def _grpo(b: EstimatorInputs) -> Result:
    adv = b.per_row(
        group.grpo(
            b.scores,
            b.groups.members,
            epsilon=b.options["epsilon"],
            norm_adv_by_std_in_grpo=b.options["norm_adv_by_std_in_grpo"],
        )
    )
    return adv, adv.clone()


def _grpo_passk(b: EstimatorInputs) -> Result:
    adv = b.per_row(
        group.grpo_passk(
            b.scores,
            b.groups.members,
            b.groups.ids,
            epsilon=b.options["epsilon"],
            norm_adv_by_std_in_grpo=b.options["norm_adv_by_std_in_grpo"],
        )
    )
    return adv, adv.clone()


def _rloo(b: EstimatorInputs) -> Result:
    adv = b.per_row(group.rloo(b.scores, b.groups.members))
    return adv, adv.clone()


def _opo(b: EstimatorInputs) -> Result:
    adv = b.per_row(group.opo(b.scores, b.groups.members, b.mask.sum(-1).tolist()))
    return adv, adv.clone()


def _gpg(b: EstimatorInputs) -> Result:
    adv = b.per_row(group.gpg(b.scores, b.groups.members, f_norm=b.options["f_norm"]))
    return adv, adv.clone()


def _reinforce_plus_plus(b: EstimatorInputs) -> Result:
    returns = discounted_returns(b.rewards, b.mask, b.options["gamma"])
    return b.whiten(returns) * b.mask, returns


def _reinforce_plus_plus_baseline(b: EstimatorInputs) -> Result:
    centred = b.per_row(group.group_centred(b.scores, b.groups.members))
    adv = b.whiten(centred) * b.mask
    return adv, adv.clone()


def _remax(b: EstimatorInputs) -> Result:
    returns = reward_to_go(b.rewards, b.mask)
    return returns - b.options["reward_baselines"].reshape(-1, 1) * b.mask, returns


def _gae(b: EstimatorInputs) -> Result:
    values = b.options["values"]
    advantages = gae_advantages(b.rewards, values, b.mask, b.options["gamma"], b.options["lam"])
    return b.whiten(advantages), advantages + values


@dataclass(frozen=True)
class Estimator:
    """One estimator: its function, the options it reads (verl's defaults; None = required: an input the
    trainer computes, the critic's ``values`` or remax's ``reward_baselines``), for estimators that compare
    the samples of a prompt why they need at least two, and the ``algorithm.*`` keys a trainer hands it
    (as verl's trainer does)."""

    name: str
    compute: Callable[[EstimatorInputs], Result]
    options: Mapping[str, object] = field(default_factory=dict)
    groups_reason: str | None = None
    config_keys: tuple[str, ...] = ()

    @property
    def uses_index(self) -> bool:
        return self.groups_reason is not None


_MEAN_BASELINE = "its baseline is the mean score of the prompt's samples; with one sample per prompt "
_GRPO_OPTIONS = {"epsilon": 1e-6, "norm_adv_by_std_in_grpo": True}

ESTIMATOR_TABLE: dict[str, Estimator] = {
    e.name: e
    for e in (
        Estimator("gae", _gae, {"values": None, "gamma": 1.0, "lam": 1.0}, config_keys=("gamma", "lam")),
        Estimator(
            "grpo",
            _grpo,
            _GRPO_OPTIONS,
            _MEAN_BASELINE + "every advantage is the raw score, unbaselined",
            config_keys=("norm_adv_by_std_in_grpo",),
        ),
        Estimator("reinforce_plus_plus", _reinforce_plus_plus, {"gamma": 1.0}, config_keys=("gamma",)),
        Estimator(
            "reinforce_plus_plus_baseline",
            _reinforce_plus_plus_baseline,
            {},
            _MEAN_BASELINE + "the baseline is 0 and only the batch whitening remains",
            config_keys=("gamma",),
        ),
        Estimator("remax", _remax, {"reward_baselines": None}),
        Estimator(
            "rloo",
            _rloo,
            {},
            "its baseline is the mean score of the prompt's other samples; with one sample per prompt "
            "there are none and every advantage is the raw score",
        ),
        Estimator(
            "opo",
            _opo,
            {},
            "its baseline is the length-weighted mean score of the prompt's samples; with one sample per "
            "prompt the baseline is 0 and every advantage is the raw score",
        ),
        Estimator(
            "grpo_passk",
            _grpo_passk,
            _GRPO_OPTIONS,
            "it gives the best sample of each prompt the margin over the second best, so every prompt "
            "needs at least 2 samples",
        ),
        Estimator(
            "gpg", _gpg, {"f_norm": 1.0}, _MEAN_BASELINE + "every advantage is the raw score times the batch factor"
        ),
    )
}
ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_TABLE)
NEEDS_GROUPS: frozenset[str] = frozenset(name for name, e in ESTIMATOR_TABLE.items() if e.uses_index)
# Every option any estimator reads; one an estimator does not read is ignored (verl hands every estimator
# the whole algorithm config), a name outside this set is an error.
OPTIONS: tuple[str, ...] = tuple(dict.fromkeys(k for e in ESTIMATOR_TABLE.values() for k in e.options))


def estimator_spec(name) -> Estimator:
    """The table entry of ``name`` (a string or a str-valued enum such as verl's AdvantageEstimator)."""
    key = getattr(name, "value", name)
    if not isinstance(key, str) or key not in ESTIMATOR_TABLE:
        raise UnknownEstimatorError(str(key), ESTIMATORS)
    return ESTIMATOR_TABLE[key]


def requires_groups(name) -> str | None:
    """Why ``name`` needs at least two samples per prompt (``rollout.n`` ≥ 2), or None if it does not."""
    return estimator_spec(name).groups_reason


def check_samples_per_prompt(name, n: int) -> None:
    """Raise ``GroupsRequiredError`` naming the estimator when it needs groups and ``n`` < 2."""
    reason = requires_groups(name)
    if reason is not None and n < 2:
        raise GroupsRequiredError(
            estimator_spec(name).name, f"needs rollout.n >= 2 samples per prompt, got {n}: {reason}"
        )


def _real(name: str, option: str, value, *, positive: bool = False, nonzero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise AdvantageOptionError(name, option, f"must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise AdvantageOptionError(name, option, f"must be > 0, got {value!r}")
    if nonzero and value == 0:
        raise AdvantageOptionError(name, option, "must not be 0")
    return float(value)


def _resolve(spec: Estimator, given: Mapping[str, object], shape: tuple[int, int]) -> dict[str, object]:
    """The options ``spec`` reads: given or default, checked; tensors as float64 CPU copies."""
    resolved = {}
    for option, default in spec.options.items():
        value = given.get(option)
        value = default if value is None else value  # None means "not set", as in verl's config
        if value is None:
            raise AdvantageOptionError(spec.name, option, f"is required by {spec.name} and was not given")
        if option == "values":
            value = float64_copy(spec.name, option, value, shape)
        elif option == "reward_baselines":
            value = float64_copy(spec.name, option, value, shape[:1])
        elif option == "norm_adv_by_std_in_grpo":
            if not isinstance(value, bool):
                raise AdvantageOptionError(spec.name, option, f"must be True or False, got {value!r}")
        else:
            value = _real(spec.name, option, value, positive=option == "epsilon", nonzero=option == "f_norm")
        resolved[option] = value
    return resolved


def compute_advantage(
    estimator, token_level_rewards: Tensor, response_mask: Tensor, index=None, **options
) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``[B, T]`` of one rollout batch with verl's estimator ``estimator``.

    ``index`` holds one group id per row (rows with equal ids are samples of one prompt); the group
    estimators (``NEEDS_GROUPS``) require it. ``options`` are verl's names (``OPTIONS``); each estimator
    reads its own and ignores the others. Computed in float64; returned in the dtype and on the device of
    ``token_level_rewards``. Permuting the rows permutes the result and changes no bit of it.
    """
    spec = estimator_spec(estimator)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise AdvantageOptionError(spec.name, unknown[0], f"is not an estimator option; known: {', '.join(OPTIONS)}")
    if not isinstance(token_level_rewards, Tensor) or token_level_rewards.dim() != 2:
        shape = getattr(token_level_rewards, "shape", None)
        raise AdvantageError(spec.name, f"token_level_rewards must be a [B, T] tensor, got {shape}")
    shape = tuple(token_level_rewards.shape)
    inputs = EstimatorInputs(
        name=spec.name,
        rewards=float64_copy(spec.name, "token_level_rewards", token_level_rewards, shape),
        mask=mask_copy(spec.name, response_mask, shape),
        counts_in=count_dtype(response_mask.dtype),
        groups=group_rows(spec.name, index, shape[0]) if spec.uses_index else None,
        options=_resolve(spec, options, shape),
    )
    if index is not None and not spec.uses_index:
        group_rows(spec.name, index, shape[0])  # validated all the same: a wrong index is a caller bug
    advantages, returns = spec.compute(inputs)
    out = {"dtype": token_level_rewards.dtype, "device": token_level_rewards.device}
    return advantages.to(**out), returns.to(**out)
