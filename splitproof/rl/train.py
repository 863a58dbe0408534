"""A whole `splitproof train` run, from a resolved config to the learning curve.

1. Setup, with no model loaded and no file written: the logger backends, the output directory
   (``trainer.default_local_dir`` creatable and writable), the model's config, the tokenizer, the
   data, the reward function against every row's data source, the prompt sampler, and the checkpoint
   to resume from (its result-affecting keys compared with this config). Any failure is a one-line
   ``SetupError``, raised on every rank alike (the ranks compare their outcomes), so none is left
   waiting.
2. The model, the optimizer and, when resuming, the checkpoint restored.
3. The tracker (``metrics.jsonl`` cut back to the resumed step), the loop, ``curve.png``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ..collective import default_collective
from ..devices import deterministic, this_process_device
from ..loss_config import ConfigError
from .checkpoint.disk import checkpoint_count, part_bytes, size_notice
from .checkpoint.resume import finished_message, latest_checkpoint
from .checkpoint.run_state import Restored, ResumePoint, restore_run, resume_point
from .config.derive import critic_enabled
from .config.paths import check_paths
from .config.schema import TrainConfig
from .data.prompts import overlong_notice
from .host_memory import kept_freed_memory
from .loop import fit
from .run import Parts, RunInputs, build_parts, prepare_inputs
from .stop import stop_points
from .tracking.curve import can_plot
from .tracking.hints import budget_hint
from .tracking.loggers import METRICS_FILE, Tracker, check_backends

SETUP_ERRORS = (ValueError, OSError, ImportError)  # ConfigError, DataError, RewardError are ValueErrors


class SetupError(Exception):
    """A user mistake found before any model was loaded: one line, exit status 2."""


@dataclass
class TrainResult:
    parts: Parts | None  # None: the run was already complete, so nothing was loaded
    records: list[dict]  # this launch's records (those before ``start_step`` are in metrics.jsonl)
    start_step: int
    total_steps: int
    curve: Path | None
    outputs: list[Path]  # what the tracker wrote (metrics.jsonl, tensorboard/, curve.png), rank 0


def check_output_dir(path: str) -> None:
    """``ConfigError`` unless ``path`` is a writable directory or can be created as one (probed with a
    temporary file in its nearest existing folder, removed at once)."""
    key = "trainer.default_local_dir"
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(key, f"{path} exists and is not a directory")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(key, f"cannot create {path}: {existing} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".splitproof-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(key, f"cannot write in {existing} ({e.strerror or type(e).__name__})") from None


def check_model_config(cfg: TrainConfig) -> None:
    """The model directories (the actor's, and the critic's when it is on) hold a config ``transformers`` can
    read (the weights are loaded later)."""
    from transformers import AutoConfig

    from .models.policy import model_directory

    models = [("actor_rollout_ref.model.path", cfg.actor_rollout_ref.model)]
    if critic_enabled(cfg):
        models.append(("critic.model.path", cfg.critic.model))
    for key, model in models:
        try:
            config = AutoConfig.from_pretrained(
                model_directory(model.path, key), local_files_only=True, trust_remote_code=model.trust_remote_code
            )
        except ConfigError:
            raise
        except (OSError, ValueError) as e:
            first = " ".join(str(e).split(". ")[0].split())
            raise ConfigError(key, f"cannot read the model's config: {first}") from None
        positions = getattr(config, "max_position_embeddings", None)
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        if isinstance(positions, int) and longest > positions:
            raise ConfigError(
                "data.max_prompt_length",
                f"data.max_prompt_length + data.max_response_length = {longest} "
                f"exceeds the model's max_position_embeddings ({positions}, {key})",
            )


def check_lora(cfg: TrainConfig) -> None:
    """The actor's LoRA keys against the model's config and a saved adapter's files (no weights loaded)."""
    from ..lora import check_before_loading
    from .config.derive import lora_settings
    from .models.policy import model_directory

    model = cfg.actor_rollout_ref.model
    check_before_loading(lora_settings(cfg), model_directory(model.path), trust_remote_code=model.trust_remote_code)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _agreed(collective, work: Callable):
    """``work()`` on every rank; a setup error on any rank is a ``SetupError`` on every rank (the first
    failing rank's message)."""
    try:
        value, failure = work(), None
    except SETUP_ERRORS as e:
        value, failure = None, _one_line(e)
    failures = [f for f in collective.gather_objects(failure) if f is not None]
    if failures:
        raise SetupError(failures[0])
    return value


def setup(cfg: TrainConfig) -> tuple[RunInputs, ResumePoint | None]:
    """Everything checked before a model is loaded (see the module's docstring)."""
    check_paths(cfg)  # a missing file or folder first: it blocks the rest
    check_backends(cfg.trainer.logger)
    check_output_dir(cfg.trainer.default_local_dir)
    check_model_config(cfg)
    check_lora(cfg)
    inputs = prepare_inputs(cfg)
    return inputs, resume_point(cfg, inputs.total_steps)


def train(
    cfg: TrainConfig,
    *,
    stop_requested: Callable[[], bool] | None = None,
    on_message: Callable[[str], None] | None = None,
    console=None,
    on_step=None,
) -> TrainResult:
    """Run ``cfg`` to its last step (resuming per ``trainer.resume_mode``).

    ``stop_requested()`` is this process's wish to stop (Ctrl-C); the ranks agree on it between stages
    and the loop raises ``loop.Interrupted``. ``on_message`` receives progress notes (resuming, ...);
    ``console`` is the console logger's stream. Raises ``SetupError`` (before any model is loaded),
    ``loop.StepFailed``, ``loop.Interrupted``.
    """
    keep = cfg.trainer.cpu_keep_freed_memory and cfg.trainer.device == "cpu"
    with cpu_threads(cfg.trainer.cpu_threads), kept_freed_memory(keep, on_message):
        return _train(cfg, stop_requested=stop_requested, on_message=on_message, console=console, on_step=on_step)


@contextmanager
def cpu_threads(count: int | None):
    """torch's intra-op CPU threads set to ``count`` for the run (None: unchanged), restored after. Results
    do not depend on it; a busy machine does: threads that spin-wait for a core stall every operation."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _train(cfg: TrainConfig, *, stop_requested, on_message, console, on_step) -> TrainResult:
    device = this_process_device(cfg.trainer.device)
    collective = default_collective(device)
    say = on_message or (lambda message: None)
    settings = deterministic(device)  # before any model or product on the device
    if settings:
        say(f"notice: {settings}")
    inputs, point = _agreed(collective, lambda: setup(cfg))
    for notice in _input_notices(cfg, inputs):
        say(f"notice: {notice}")
    if point is not None and point.step >= inputs.total_steps and not cfg.trainer.val_only:
        say(finished_message(cfg, point.path, point.step))  # no model loaded, no file touched
        return TrainResult(
            parts=None, records=[], start_step=point.step, total_steps=inputs.total_steps, curve=None, outputs=[]
        )
    previous = Path(cfg.trainer.default_local_dir) / METRICS_FILE
    if point is None and previous.is_file() and "file" in cfg.trainer.logger and not cfg.trainer.val_only:
        why = (
            "trainer.resume_mode=disable"
            if cfg.trainer.resume_mode == "disable"
            else "no complete checkpoint there to resume from"
        )
        say(f"starting over ({why}): {previous} and the curve beside it are replaced")
    restored = Restored(step=0)
    try:
        parts = build_parts(cfg, collective=collective, inputs=inputs)
        if point is not None:
            restored = restore_run(parts, point)
            say(f"resuming from {point.path} (step {restored.step} of {parts.total_steps})")
        disk = _disk_notice(parts, restored.step)
        if disk and not cfg.trainer.val_only:
            say(f"notice: {disk}")
    except ConfigError as e:  # found with the weights (LoRA: an adapter or checkpoint of other ones), on every rank
        raise SetupError(_one_line(e)) from None

    def should_stop() -> bool:
        wish = int(bool(stop_requested and stop_requested()))
        return collective.max_int(wish) > 0

    start_step = restored.step
    if "file" in cfg.trainer.logger and not cfg.trainer.val_only and not can_plot():
        say("notice: no curve.png: matplotlib is not installed (metrics.jsonl holds every record)")
    tracker = Tracker.from_config(
        cfg, total_steps=parts.total_steps, resume_step=start_step if point is not None else None, stream=console
    )
    curve = None
    if cfg.trainer.val_only:
        say(
            f"trainer.val_only: evaluating the weights of step {start_step}; the result is shown, not recorded "
            "(the run's metrics.jsonl, TensorBoard, wandb and curve.png stay as the training run left them)"
        )
    optimizers = [parts.actor.optimizer, None if parts.critic is None else parts.critic.optimizer]
    try:
        inside = nullcontext() if stop_requested is None else stop_points(stop_requested, collective, optimizers)
        with inside:  # Ctrl-C inside a step
            records = fit(
                parts,
                log=tracker.log,
                sync=tracker.sync,
                start_step=start_step,
                pipeline_state=restored.pipeline_state,
                on_step=_with_hints(parts, on_step, say),
                save_checkpoints=True,
                should_stop=should_stop if stop_requested is not None else None,
            )
    finally:
        curve = tracker.finish()
    if parts.lora and records and int(records[-1].get("training/global_step", 0)) >= parts.total_steps:
        path = export_merged_policy(parts)
        say(f"wrote the merged model (base + LoRA adapter) to {path}")
        tracker.outputs.append(path)
    return TrainResult(
        parts=parts,
        records=records,
        start_step=start_step,
        total_steps=parts.total_steps,
        curve=curve,
        outputs=tracker.outputs,
    )


def _input_notices(cfg: TrainConfig, inputs) -> list[str]:
    """The notices of the data and environment checks: dropped overlong prompts, then the inputs' own."""
    notices = [
        overlong_notice(data, files_key, cfg.data.max_prompt_length)
        for files_key, data in (("data.train_files", inputs.train_data), ("data.val_files", inputs.val_data))
        if data is not None and data.dropped
    ]
    return notices + list(inputs.notices)


def _with_hints(parts: Parts, on_step, say):
    """``on_step`` that also says a step's ``tracking.hints`` (once per launch)."""
    said: list[int] = []
    cfg = parts.config

    def seen(step, output) -> None:
        hint = (
            None
            if said
            else budget_hint(
                output.scored.samples,
                cfg.data.max_response_length,
                cfg.actor_rollout_ref.rollout.multi_turn.max_tool_response_length,
            )
        )
        if hint:
            said.append(step)
            say(f"notice: step {step}: {hint}")
        if on_step is not None:
            on_step(step, output)

    return seen


def _disk_notice(parts: Parts, start_step: int) -> str | None:
    learners = [parts.actor] + ([] if parts.critic is None else [parts.critic])
    trainer = parts.config.trainer
    size = sum(part_bytes(learner.model, learner.optimizer) for learner in learners)
    return size_notice(
        size,
        checkpoint_count(start_step, parts.total_steps, trainer.save_freq),
        trainer.max_actor_ckpt_to_keep,
        trainer.save_freq,
    )


MERGED_DIR = "merged"  # under trainer.default_local_dir: the merged model of a LoRA run's last step


def export_merged_policy(parts: Parts) -> Path:
    """Write the LoRA policy merged (W + s·B·A) as a Hugging Face directory with the tokenizer, on rank 0,
    into ``{trainer.default_local_dir}/merged``; the live base weights are not touched."""
    from ..lora import export_merged

    path = Path(parts.config.trainer.default_local_dir) / MERGED_DIR
    if parts.collective.rank == 0:
        if path.exists():
            import shutil

            shutil.rmtree(path)
        export_merged(parts.actor.for_inference(), path)
        parts.tokenizer.save_pretrained(path)
    return path


def newest_checkpoint(cfg: TrainConfig) -> Path | None:
    """The newest complete checkpoint under ``trainer.default_local_dir`` (what ``resume_mode=auto`` picks)."""
    return latest_checkpoint(cfg.trainer.default_local_dir)
