"""Reward managers: verl's ``naive`` (the score as the reward function returns it) and ``dapo`` (the score
plus DAPO's overlong penalty).

Selected by ``reward.reward_manager.name`` or, in verl's older spelling, ``reward_model.reward_manager``;
the ``dapo`` manager reads ``reward.reward_kwargs`` (or ``reward_model.reward_kwargs``, which verl maps
onto it): ``overlong_buffer_cfg.{enable, len, penalty_factor, log}`` and ``max_resp_len``.

Overlong penalty of a response of ℓ tokens (its EOS included, as verl counts the valid response), with
buffer length L, penalty factor f and M = ``max_resp_len``:

    overlong_reward(ℓ) = min(-(ℓ - (M - L)) / L · f, 0)

zero up to M - L tokens, then falling linearly to -f at M. The reward is score + overlong_reward.
The ``dapo`` manager's extra values, as verl's: ``acc`` = the score when the reward function returns a
number (or, as the built-in rules do, a number with the ``pred`` it compared), and with ``log``: ``overlong_reward``
and ``overlong`` (1.0 when the penalty is negative).
verl computes the penalty in float32 (a tensor length); here it is float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...loss_config import ConfigError

if TYPE_CHECKING:
    from .scored import Rewards

MANAGERS = ("naive", "dapo")
OVERLONG_KEYS = ("enable", "len", "penalty_factor", "log")
KWARG_KEYS = ("overlong_buffer_cfg", "max_resp_len")


@dataclass(frozen=True)
class OverlongBuffer:
    length: int
    penalty_factor: float
    max_resp_len: int
    log: bool


@dataclass(frozen=True)
class RewardManager:
    """The reward manager a run applies to every score: its name and, for ``dapo``, the overlong buffer."""

    name: str = "naive"
    overlong: OverlongBuffer | None = None

    def extra_names(self, function_extras: frozenset[str] = frozenset()) -> frozenset[str]:
        """The extra values this manager reports, given those the reward function returns."""
        names = set(function_extras)
        if self.name == "dapo":
            names.add("acc")
            if self.overlong is not None and self.overlong.log:
                names.update(("overlong_reward", "overlong"))
        return frozenset(names)


def overlong_reward(length: int, buffer: OverlongBuffer) -> float:
    """min(-(ℓ - (M - L)) / L · f, 0) (see the module docstring)."""
    exceed = length - (buffer.max_resp_len - buffer.length)
    return min(-exceed / buffer.length * buffer.penalty_factor, 0.0)


def apply_manager(manager: RewardManager, rewards: Rewards, lengths: list[int]) -> Rewards:
    """Each sample's reward and extra values under ``manager``; ``rewards`` holds the reward function's
    scores and extra values (``scored.Rewards``), ``lengths[i]`` the response's token count. ``acc`` is
    added for a sample with no extra value (its score), then the overlong values."""
    import torch  # here: the config checks import this module, torch-free

    from .scored import Rewards, present_extra

    held = present_extra(rewards.extra)
    if manager.name == "naive":
        return Rewards(rewards.scores, held, rewards.stats)
    count, order = len(rewards), {name: k for k, name in enumerate(held)}
    # a sample whose function returned no extra value but the answer it voted for (``pred``) scores ``acc``
    bare = [all(math.isnan(values[i]) for name, values in held.items() if name != "pred") for i in range(count)]
    scores = rewards.scores.tolist()
    extra = dict(held)
    acc = extra.get("acc", [math.nan] * count)
    extra["acc"] = [score if empty else value for score, empty, value in zip(scores, bare, acc)]
    if manager.overlong is not None:
        penalties = [overlong_reward(length, manager.overlong) for length in lengths]
        scores = [score + penalty for score, penalty in zip(scores, penalties)]
        if manager.overlong.log:
            extra["overlong_reward"] = penalties
            extra["overlong"] = [float(penalty < 0) for penalty in penalties]
    added = {"acc": -1, "overlong_reward": len(order), "overlong": len(order) + 1}

    def position(name: str, row: int) -> int:  # where the name sat in the sample's own values
        if name in held and not math.isnan(held[name][row]):
            return order[name]
        return added[name]

    return Rewards(
        torch.tensor(scores, dtype=torch.float64, device="cpu"), present_extra(extra, position), rewards.stats
    )


def _merged_kwargs(reward_kwargs: dict, legacy_kwargs: dict) -> tuple[dict, str]:
    if reward_kwargs and legacy_kwargs and reward_kwargs != legacy_kwargs:
        raise ConfigError(
            "reward_model.reward_kwargs",
            "differs from reward.reward_kwargs; verl maps one onto the other: set one of them",
        )
    if legacy_kwargs:
        return dict(legacy_kwargs), "reward_model.reward_kwargs"
    return dict(reward_kwargs), "reward.reward_kwargs"


def _manager_name(name: str, legacy: str | None) -> tuple[str, str]:
    if legacy is not None and name not in ("naive", legacy):
        raise ConfigError(
            "reward_model.reward_manager",
            f"is {legacy!r} while reward.reward_manager.name is {name!r}; set one of them",
        )
    chosen, key = (
        (legacy, "reward_model.reward_manager") if legacy is not None else (name, "reward.reward_manager.name")
    )
    if chosen not in MANAGERS:
        raise ConfigError(
            key, f"reward manager {chosen!r} is not implemented by splitproof; expected one of {', '.join(MANAGERS)}"
        )
    return chosen, key


def _number(value, key: str, *, integer: bool = False):
    ok = isinstance(value, int if integer else (int, float)) and not isinstance(value, bool)
    if not ok:
        raise ConfigError(key, f"must be {'an integer' if integer else 'a number'}, got {value!r}")
    return value


def reward_manager(
    name: str, legacy_name: str | None, reward_kwargs: dict, legacy_kwargs: dict, max_response_length: int
) -> RewardManager:
    """The run's reward manager from verl's keys (both spellings); a ``ConfigError`` names the key of any
    manager we do not implement, kwargs it would ignore, or an overlong buffer that cannot work."""
    chosen, name_key = _manager_name(name, legacy_name)
    kwargs, prefix = _merged_kwargs(reward_kwargs or {}, legacy_kwargs or {})
    for key in kwargs:
        if key not in KWARG_KEYS:
            raise ConfigError(
                f"{prefix}.{key}", f"unknown reward-manager argument; the dapo manager reads {', '.join(KWARG_KEYS)}"
            )
    if chosen == "naive":
        if kwargs:
            raise ConfigError(prefix, f"is read only by the dapo reward manager, but {name_key} is 'naive'")
        return RewardManager("naive")
    cfg = kwargs.get("overlong_buffer_cfg") or {}
    if not isinstance(cfg, dict):
        raise ConfigError(f"{prefix}.overlong_buffer_cfg", f"must be a mapping, got {cfg!r}")
    for key in cfg:
        if key not in OVERLONG_KEYS:
            raise ConfigError(
                f"{prefix}.overlong_buffer_cfg.{key}", f"unknown key; expected {', '.join(OVERLONG_KEYS)}"
            )
    if not cfg.get("enable", False):
        return RewardManager("dapo")
    where = f"{prefix}.overlong_buffer_cfg"
    length = _number(cfg.get("len"), f"{where}.len", integer=True)
    factor = _number(cfg.get("penalty_factor"), f"{where}.penalty_factor")
    max_len = kwargs.get("max_resp_len")
    if max_len is None:
        raise ConfigError(
            f"{prefix}.max_resp_len",
            "must be set when the overlong buffer is enabled (verl: the "
            f"response length the buffer ends at, e.g. {max_response_length})",
        )
    max_len = _number(max_len, f"{prefix}.max_resp_len", integer=True)
    if length <= 0:
        raise ConfigError(f"{where}.len", f"must be > 0 when the overlong buffer is enabled, got {length}")
    if length > max_len:
        raise ConfigError(f"{where}.len", f"{length} is longer than {prefix}.max_resp_len ({max_len})")
    if length > max_response_length:
        raise ConfigError(
            f"{where}.len",
            f"{length} is longer than data.max_response_length ({max_response_length}):"
            " no response could be penalised as the buffer says",
        )
    return RewardManager(
        "dapo",
        OverlongBuffer(
            length=length, penalty_factor=float(factor), max_resp_len=max_len, log=bool(cfg.get("log", False))
        ),
    )
