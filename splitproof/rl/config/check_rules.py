"""The value checks every part of the config check is written with; each raises ``ConfigError`` naming its
dotted key."""

from __future__ import annotations

import math

from ...loss_config import ConfigError


def fail(key: str, message: str):
    raise ConfigError(key, message)


def require(cond: bool, key: str, message: str) -> None:
    if not cond:
        fail(key, message)


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def positive_int(value, key: str) -> None:
    require(is_int(value) and value >= 1, key, f"must be an integer >= 1, got {value!r}")


def optional_positive_int(value, key: str) -> None:
    require(value is None or (is_int(value) and value >= 1), key, f"must be null or an integer >= 1, got {value!r}")


def one_of(value, choices, key: str, later=(), later_reason="not supported yet") -> None:
    if value in later:
        fail(key, f"{value!r} is {later_reason}; expected one of {', '.join(map(str, choices))}")
    require(value in choices, key, f"unknown {value!r}; expected one of {', '.join(map(str, choices))}")
