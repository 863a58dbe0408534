"""The training loop: step after step, each validated when due, logged, then checkpointed when due.

Within step k (1-based, as verl counts):

1. ``train_step`` (generate, score, log-probs, advantages, update);
2. validation when ``trainer.test_freq`` divides k, or k is the last step (its wall time is the record's
   ``timing_s/testing``, verl's name);
3. the step's record logged (rank 0), on disk before anything follows;
4. ``global_step_k`` saved when ``trainer.save_freq`` divides k, or k is the last step (save_freq > 0,
   as verl saves).

A checkpoint is written only after its step's record, so a crash never leaves a checkpoint whose
metrics are missing; records after the newest checkpoint are dropped on resume and replayed, so the
metrics file ends equal to an uninterrupted run's. (verl saves before it logs.) Validation before
training (step 0) runs on a fresh start only: a resumed run's records already hold it.

``should_stop`` is asked between stages (before a step, after it, after its validation), and inside the
rollout and the update (``splitproof.rl.stop``); when it says yes the loop raises ``Interrupted`` naming
the last step whose record was logged (the unfinished step is discarded), after saving that step's
checkpoint when it has none and the stop came where the run is exactly that step's
(``at_stop.save_at_stop``). A failure inside a
step (a reward function that raises, a rank that fails) is a ``StepFailed``: nothing of that step is
logged or saved.

Test pause points (``splitproof.rl.pause``): ``step{k}:trained``, ``step{k}:logged``,
``step{k}:checkpoint:{stage}`` (the stages of ``checkpoint.store.save_checkpoint``), ``step{k}:done``;
with dynamic sampling ``step{k}:round{r}`` (generation round r of step k scored, nothing updated yet).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

from . import pause, stop
from .checkpoint import at_stop, store
from .checkpoint.run_state import save_run
from .data.dynamic_sampling import FilterError
from .evaluate import evaluate_held_out
from .parallel import RankFailure, first_rank_only
from .rewards.functions import RewardError
from .rollout.pipeline import PIPELINE_ERRORS, pipelined
from .run import Parts
from .step import StepResult, train_step
from .tracking.generations import generation_rows, write_generations


class Interrupted(Exception):
    """The loop stopped on request; ``step`` is the last step whose record was logged; ``detail`` says what
    was discarded and saved."""

    def __init__(self, step: int, detail: str = ""):
        super().__init__(f"stopped after step {step}{detail}")
        self.step = step
        self.detail = detail


class StepFailed(Exception):
    """Step ``step`` failed (a reward function, a rank, a rollout process); nothing of it was saved, and
    nothing logged unless ``logged`` (its checkpoint failed: a pipelined run's rollout process died)."""

    def __init__(self, step: int, cause: BaseException, *, logged: bool = False):
        super().__init__(f"step {step}: {cause}")
        self.step = step
        self.cause = cause
        self.logged = logged


def is_due(step: int, total: int, freq: int) -> bool:
    """verl's rule for ``test_freq`` and ``save_freq``: every ``freq`` steps and at the last step; never
    when ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == total)


@contextmanager
def _checkpoint_pauses(step: int):
    if not pause.enabled():
        yield
        return
    previous = store._progress_hook
    store._progress_hook = lambda stage: pause.pause_point(f"step{step}:checkpoint:{stage}")
    try:
        yield
    finally:
        store._progress_hook = previous


def _failing(step: int, fn: Callable, *args):
    try:
        return fn(*args)
    except (RewardError, RankFailure, FilterError, *PIPELINE_ERRORS) as e:
        raise StepFailed(step, e) from e


def fit(
    parts: Parts,
    *,
    log: Callable[[dict, int], None] | None = None,
    sync: Callable[[], None] | None = None,
    start_step: int = 0,
    pipeline_state: dict | None = None,
    on_step: Callable[[int, StepResult], None] | None = None,
    save_checkpoints: bool = False,
    should_stop: Callable[[], bool] | None = None,
) -> list[dict]:
    """Train from ``start_step`` to ``parts.total_steps``; return every logged record (``step`` included).

    ``log(metrics, step)`` records a step; ``sync()`` puts the records on disk before a checkpoint;
    ``pipeline_state``: a resumed pipelined run's in-flight rollouts (``checkpoint.run_state.Restored``);
    ``on_step(step, output)`` sees each step's output (its samples included); ``save_checkpoints``
    saves ``global_step_k`` when ``trainer.save_freq`` says so.
    """
    cfg = parts.config.trainer
    records = []

    def emit(metrics: dict, step: int) -> None:
        records.append({"step": step, **metrics})
        if log is not None:
            log(metrics, step)

    def check_stop(last_logged: int) -> None:
        if should_stop is not None and should_stop():
            raise Interrupted(last_logged)

    try:
        if cfg.val_only:
            emit(_failing(start_step, evaluate_held_out, parts, start_step), start_step)
            return records
        with pipelined(parts, start_step, pipeline_state) as pipeline:  # the rollout process starts in step 0
            if cfg.val_before_train and start_step == 0:
                emit(_failing(start_step, evaluate_held_out, parts, start_step), start_step)
            for step in range(start_step + 1, parts.total_steps + 1):
                _one_step(parts, pipeline, step, emit, check_stop, on_step, sync, save_checkpoints)
    except stop.StepAbandoned as e:  # in a validation: the step it belongs to is discarded
        last = records[-1]["step"] if records else start_step
        raise Interrupted(last, f" (stopped in a validation's {e.stage}; nothing after step {last} kept)") from None
    return records


def _stop_inside(
    parts: Parts,
    pipeline,
    step: int,
    e: stop.StepAbandoned,
    snapshot: at_stop.Snapshot | None,
    sync,
    save_checkpoints: bool,
) -> Interrupted:
    """The ``Interrupted`` of a stop inside step ``step``'s train_step, after saving step ``step - 1`` where
    that is exact (``at_stop.save_at_stop``)."""
    saved = None
    if e.exact and save_checkpoints and snapshot is not None:
        snapshot.restore(parts.prompts.sampler)
        saved = _save_at_stop(parts, pipeline, step - 1, sync)
    kept = f"; saved global_step_{step - 1} at the stop" if saved else ""
    return Interrupted(step - 1, f" (stopped in step {step}'s {e.stage}; step {step} is discarded{kept})")


def _save_at_stop(parts: Parts, pipeline, step: int, sync):
    """``global_step_{step}`` saved at a stop when that is exact and it has none yet (``at_stop.save_at_stop``)."""

    def save(s: int):
        if sync is not None:
            sync()
        return save_run(parts, s, pipeline)

    due = is_due(step, parts.total_steps, parts.config.trainer.save_freq)
    return at_stop.save_at_stop(parts, pipeline, step, save, saved_already=due)


def _one_step(parts: Parts, pipeline, step: int, emit, check_stop, on_step, sync, save_checkpoints: bool) -> None:
    """Step ``step``: train, validate when due, log, checkpoint when due (the order of the module docstring)."""
    cfg = parts.config.trainer
    try:
        check_stop(step - 1)
    except Interrupted:  # between steps: the run is exactly step - 1's
        saved = save_checkpoints and _save_at_stop(parts, pipeline, step - 1, sync)
        raise Interrupted(step - 1, f" (saved global_step_{step - 1} at the stop)" if saved else "") from None
    sampler = parts.prompts.sampler
    snapshot = at_stop.Snapshot.of(sampler) if at_stop.can_save_at_stop(parts, pipeline) else None
    if parts.config.algorithm.filter_groups.enable:
        uids = None  # dynamic sampling: the step draws its prompts from the stream
    else:
        uids = sampler.next_batch() if pipeline is None else pipeline.uids(step)
    try:
        output = _failing(step, train_step, parts, step, uids, pipeline)
    except stop.StepAbandoned as e:
        raise _stop_inside(parts, pipeline, step, e, snapshot, sync, save_checkpoints) from None
    pause.pause_point(f"step{step}:trained")
    if on_step is not None:
        on_step(step, output)
    if cfg.rollout_data_dir and first_rank_only(parts.collective):
        scored = output.scored
        write_generations(
            cfg.rollout_data_dir,
            step,
            generation_rows(
                parts.tokenizer,
                parts.prompts.train,
                scored.samples,
                scored.rewards.scores.tolist(),
                scored.rewards.extra,
                step,
            ),
        )
    check_stop(step - 1)
    metrics = dict(output.metrics)
    if is_due(step, parts.total_steps, cfg.test_freq):
        started = time.perf_counter()
        metrics.update(_failing(step, evaluate_held_out, parts, step))
        metrics["timing_s/testing"] = time.perf_counter() - started
        check_stop(step - 1)
    emit(metrics, step)
    pause.pause_point(f"step{step}:logged")
    if save_checkpoints and is_due(step, parts.total_steps, cfg.save_freq):
        if sync is not None:
            sync()
        with _checkpoint_pauses(step):
            try:
                save_run(parts, step, pipeline)
            except PIPELINE_ERRORS as e:  # the in-flight rollouts it waits for never came
                raise StepFailed(step, e, logged=True) from e
    pause.pause_point(f"step{step}:done")
