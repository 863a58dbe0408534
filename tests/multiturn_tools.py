"""Tools for the multi-turn tests: a lookup that sleeps a random 0–50 ms (unseeded, so completion order
varies from run to run), fails on one key and returns a non-string on another; and a test format that
makes a tiny random model call it often (each digit of a turn, in order, is a call)."""

from __future__ import annotations

import random
import time

_jitter = random.Random()  # deliberately unseeded: latency must not matter


def lookup(key: str) -> str:
    """Look a key up in a small table.

    Args:
        key: a single digit
    """
    time.sleep(_jitter.uniform(0.0, 0.05))
    if key == "7":
        raise RuntimeError("key 7 is broken")
    if key == "3":
        return {"key": 3, "value": [1, 2]}  # a non-string result: appended as JSON
    return "ab"[int(key) % 2] * (int(key) % 3 + 1)
