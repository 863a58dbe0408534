"""Wall and process-CPU seconds per stage and RL step, taken by wrapping the functions that run the stages;
the process's resident memory. Shared by the benchmarks that time `splitproof train` (and TRL) stage by stage."""

from __future__ import annotations

import os
import resource
import time
from contextlib import contextmanager


def rss_mib() -> float:
    """The resident set size now (MiB)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (``getrusage`` maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall and process-CPU seconds per (stage, RL step), added up over the calls of that step."""

    def __init__(self):
        self.step = 0  # the RL step the next measurements belong to (1-based once training runs)
        self.wall: dict[str, dict[int, float]] = {}
        self.cpu: dict[str, dict[int, float]] = {}
        self.starts: list[tuple[float, float]] = []  # (wall, cpu) at the start of every RL step
        self.end: tuple[float, float] | None = None

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def add(self, stage: str, wall: float, cpu: float) -> None:
        for table, value in ((self.wall, wall), (self.cpu, cpu)):
            per_step = table.setdefault(stage, {})
            per_step[self.step] = per_step.get(self.step, 0.0) + value

    @contextmanager
    def timed(self, stage: str):
        w0, c0 = self.now()
        try:
            yield
        finally:
            w1, c1 = self.now()
            self.add(stage, w1 - w0, c1 - c0)

    def begin_step(self) -> None:
        self.step += 1
        self.starts.append(self.now())

    def finish(self) -> None:
        self.end = self.now()

    def totals(self) -> dict[str, list[float]]:
        """Per RL step: wall and CPU from one step's start to the next's (the last to ``finish``)."""
        marks = self.starts + [self.end]
        return {
            "wall": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
            "cpu": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
        }

    def per_step(self, stage: str, clock: str, steps: int) -> list[float]:
        table = (self.wall if clock == "wall" else self.cpu).get(stage, {})
        return [table.get(s, 0.0) for s in range(1, steps + 1)]

    def report(self, steps: int) -> dict:
        out = {"total": self.totals()}
        for stage in sorted(set(self.wall) | set(self.cpu)):
            out[stage] = {clock: self.per_step(stage, clock, steps) for clock in ("wall", "cpu")}
        return out


def wrap(owner, name: str, fn_for):
    """Replace ``owner.name`` by ``fn_for(original)``; returns the original."""
    original = getattr(owner, name)
    setattr(owner, name, fn_for(original))
    return original


def timed_call(clock: Clock, stage: str):
    def make(original):
        def call(*args, **kwargs):
            with clock.timed(stage):
                return original(*args, **kwargs)

        return call

    return make


def starts_step(clock: Clock, stage: str | None = None):
    """A wrapper maker: every call begins the next RL step on ``clock`` (and is timed as ``stage``)."""

    def make(original):
        def call(*args, **kwargs):
            clock.begin_step()
            if stage is None:
                return original(*args, **kwargs)
            with clock.timed(stage):
                return original(*args, **kwargs)

        return call

    return make


def finishes(clock: Clock):
    """A wrapper maker: the end of the call ends the last RL step on ``clock``."""

    def make(original):
        def call(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                clock.finish()

        return call

    return make


def log_prob_passes(clock: Clock, built: dict):
    """A wrapper maker for the no-grad log-prob pass: timed as ``old_log_prob`` when it runs the actor
    (``built["actor"]``, filled by ``records_parts``) and as ``ref`` otherwise."""

    def make(original):
        def call(model, *args, **kwargs):
            with clock.timed("old_log_prob" if model is built["actor"].for_inference() else "ref"):
                return original(model, *args, **kwargs)

        return call

    return make


def records_parts(built: dict):
    """A wrapper maker for ``build_parts``: keeps the built actor in ``built["actor"]``."""

    def make(original):
        def call(*args, **kwargs):
            parts = original(*args, **kwargs)
            built["actor"] = parts.actor
            return parts

        return call

    return make


@contextmanager
def patched(patches):
    """Every ``(owner, name, fn_for)`` of ``patches`` wrapped (``wrap``) for the block, then restored."""
    saved = {}
    try:
        for owner, name, make in patches:
            saved[owner, name] = wrap(owner, name, make)
        yield
    finally:
        for (owner, name), original in saved.items():
            setattr(owner, name, original)
