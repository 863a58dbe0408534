"""The training loop: validate, then step after step, logging each step's metrics.

``fit`` is deliberately short; everything a step does is in ``step.train_step``.
"""

from __future__ import annotations

from collections.abc import Callable

from .run import Run
from .step import StepOutput, train_step
from .validate import validate


def fit(run: Run, *, log: Callable[[dict, int], None] | None = None, start_step: int = 0,
        on_step: Callable[[int, StepOutput], None] | None = None) -> list[dict]:
    """Train from ``start_step`` to ``run.total_steps``; return every logged record (``step`` included).
    ``on_step(step, output)`` sees each step's output (its rollouts included)."""
    cfg = run.config.trainer
    records = []

    def emit(metrics: dict, step: int) -> None:
        record = {"step": step, **metrics}
        records.append(record)
        if log is not None:
            log(metrics, step)

    if cfg.val_before_train and start_step == 0:
        emit(validate(run, 0), 0)
    for step in range(start_step + 1, run.total_steps + 1):
        uids = run.sampler.next_batch()
        output = train_step(run, step, uids)
        if on_step is not None:
            on_step(step, output)
        metrics = dict(output.metrics)
        if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or step == run.total_steps):
            metrics.update(validate(run, step))
        emit(metrics, step)
    return records
