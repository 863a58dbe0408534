"""Saving a run at a Ctrl-C (``splitproof.rl.stop``): the run after its last finished step, where that is exact.

A step changes nothing of the run before its update but the prompt sampler's position and the RNGs:
``Snapshot`` takes them before the step and puts them back, so a step abandoned in its rollout leaves the
run exactly as after the step before, which ``save_at_stop`` saves when that step has no checkpoint yet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .store import rng_state, set_rng_state


def can_save_at_stop(parts, pipeline) -> bool:
    """Whether the run after its last finished step can be saved at a stop (see the module docstring)."""
    cfg = parts.config
    return (
        pipeline is None
        and not cfg.algorithm.filter_groups.enable
        and cfg.trainer.save_freq > 0
        and not cfg.trainer.val_only
    )


@dataclass(frozen=True)
class Snapshot:
    """What a step changes before its update: the prompt sampler's position and the RNGs."""

    sampler: dict
    rngs: dict

    @classmethod
    def of(cls, sampler) -> Snapshot:
        return cls(sampler.state_dict(), rng_state())

    def restore(self, sampler) -> None:
        sampler.load_state_dict(self.sampler)
        set_rng_state(self.rngs)


def save_at_stop(parts, pipeline, step: int, save: Callable[[int], Path], saved_already: bool) -> Path | None:
    """``global_step_{step}`` saved by ``save(step)`` (the run being exactly the run after ``step``), unless
    there is no finished step, it is saved already, or the run cannot be saved at a stop; the path or None."""
    if step < 1 or saved_already or not can_save_at_stop(parts, pipeline):
        return None
    return save(step)
