"""A first Ctrl-C stops a run within seconds, at a point that loses nothing, and says where it resumes.

The run's wish to stop (``wish()``, this process's Ctrl-C) is asked between stages by the loop, and,
while ``stop_points`` is installed, inside the two long stages of a step:

- between decode steps of the hf rollout (``decode_point``; one process only: under torchrun the ranks
  decode different numbers of tokens, so they agree at the next optimizer step instead);
- before each optimizer step of the actor and of the critic (a torch step pre-hook: every rank takes the
  same optimizer steps, so the ranks agree there).

There the step is abandoned (``StepAbandoned``) and discarded. Stopped while decoding (``exact``), the step
has changed nothing of the run but the prompt sampler's position and the RNGs, which ``Snapshot`` takes
before the step and puts back: the run is then exactly the run after the last finished step, which
``save_at_stop`` saves when that step has no checkpoint yet. Stopped before an optimizer step, weights may
already have moved (an earlier minibatch, the critic): nothing is saved and the run resumes from its newest
checkpoint. A pipelined run (rollouts in flight) and a dynamic-sampling run (a prompt stream shared by
rounds) are not saved at a stop either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager


class StepAbandoned(Exception):
    """A stop requested inside a step: ``stage`` says where; ``exact``: nothing but the sampler and the RNGs
    changed (``Snapshot`` puts them back)."""

    def __init__(self, stage: str, exact: bool):
        super().__init__(f"stopped in the step's {stage}")
        self.stage = stage
        self.exact = exact


_decode_wish: Callable[[], bool] | None = None  # set by stop_points for the run of this process


def decode_point() -> None:
    """Between two decode steps: abandon the step when a stop is wished (one-process runs)."""
    if _decode_wish is not None and _decode_wish():
        raise StepAbandoned("rollout", exact=True)


@contextmanager
def stop_points(wish: Callable[[], bool], collective, optimizers: Iterable):
    """Stop points inside steps while the block runs: decode steps (one process) and optimizer steps (the
    ranks agree through ``collective.max_int``)."""
    global _decode_wish

    def before_optimizer_step(optimizer, args, kwargs) -> None:
        if collective.max_int(int(bool(wish()))) > 0:
            raise StepAbandoned("update", exact=False)

    handles = [o.register_step_pre_hook(before_optimizer_step) for o in optimizers if o is not None]
    previous, _decode_wish = _decode_wish, (wish if collective.world_size == 1 else None)
    try:
        yield
    finally:
        _decode_wish = previous
        for handle in handles:
            handle.remove()
