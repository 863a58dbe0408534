"""Environments in TRL's ``environment_factory`` shape for the environment tests.

- ``LookupEnv``: a stateful episode. ``reset(seed, **row)`` draws a secret digit from its own
  ``random.Random(seed)`` and returns an observation naming the row; its tool ``lookup(key)`` sleeps a
  random, unseeded 0–30 ms (completion order varies), counts the calls, answers from its state, and
  raises on key ``7`` (an environment that raises mid-episode); ``get_reward`` reads the state.
- ``UnseededEnv``: draws its task from the operating system's entropy, whatever seed it is given.
- ``LockedEnv``: a ``LookupEnv`` that holds a lock (its instances do not pickle).
- ``doubled_reward`` / ``any_reward``: TRL reward functions that read each episode's instance
  (``environments=``, by name / through ``**kwargs``).
- ``NoReset``, ``Untyped``, ``Undocumented``: bad environments, one mistake each.
"""

from __future__ import annotations

import os
import random
import threading
import time

_jitter = random.Random()  # deliberately unseeded: latency must not matter


class LookupEnv:
    def reset(self, seed: int, **row) -> str:
        if row.get("environment") == "lookup":  # routed by a mapping: the routing column must not reach reset
            raise ValueError("the environment column reached reset")
        self.rng = random.Random(seed)
        self.secret = self.rng.randrange(10)
        self.calls = 0
        return str(self.secret)

    def lookup(self, key: str) -> str:
        """Look a key up in the episode's table.

        Args:
            key: a single digit
        """
        time.sleep(_jitter.uniform(0.0, 0.03))
        if key == "7":
            raise RuntimeError("key 7 is broken")
        self.calls += 1
        return "ab"[(int(key) + self.secret + self.calls) % 2] * (self.calls % 3 + 1)

    def get_reward(self) -> float:
        return float(self.calls == self.secret % 4) + 0.1 * self.calls


class LockedEnv(LookupEnv):
    def reset(self, seed: int, **row) -> str:
        self.lock = threading.Lock()
        return super().reset(seed, **row)


def doubled_reward(completions, environments, **kwargs):
    return [2.0 * env.get_reward() for env in environments]


def any_reward(completions, **kwargs):
    return [0.0 if env is None else 0.5 for env in kwargs.get("environments", [None] * len(completions))]


class UnseededEnv:
    def reset(self, **row) -> str:
        return f" #{int.from_bytes(os.urandom(4), 'little')}"

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: a single digit
        """
        return key


class NoReset:
    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: a single digit
        """
        return key


class Untyped:
    def reset(self, **row) -> None:
        return None

    def lookup(self, key):
        """Look a key up.

        Args:
            key: a single digit
        """
        return key


class Undocumented:
    def reset(self, **row) -> None:
        return None

    def lookup(self, key: str) -> str:
        return key
