"""Metric logging of a `splitproof train` run (``trainer.logger``), and the learning curve at the end.

Backends, chosen by name:

- ``console``: a first line naming the model, the training data, the device and the output folder;
  then a progress line per step — step/total, training reward (``critic/score/mean``), the last held-out
  score of each data source with what it is (``val-core/<source>/<var>/mean@<n>``: ``<source>
  <var>/mean@<n>``), mean response length, step time, ETA (no line for a step 0 that evaluated nothing).
  On a terminal the line is rewritten in place (evaluation steps stay on screen); otherwise one line
  per step.
- ``file``: ``{default_local_dir}/metrics.jsonl``, one JSON object per step: ``"step"`` and verl's
  metric names. Non-finite values are written as Python's json writes them (``NaN``, ``Infinity``).
  Resuming from step N first drops the records after N, so the file ends up equal to an
  uninterrupted run's; a fresh run starts a fresh file.
- ``tensorboard``: event files in ``{default_local_dir}/tensorboard`` (extra ``splitproof[tensorboard]``);
  resuming from step N purges the events after N.
- ``wandb``: ``wandb.init(project=project_name, name=experiment_name, config=..., dir=default_local_dir)``
  (extra ``splitproof[wandb]``; ``WANDB_MODE=offline`` works). Each launch is its own wandb run.

Only rank 0 logs. ``finish`` writes ``{default_local_dir}/curve.png`` (drawn by ``curve``): training reward
and held-out score per step (from ``metrics.jsonl`` when resuming with the ``file`` logger, so the curve covers the
whole run).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from ...loss_config import ConfigError
from .curve import TRAIN_REWARD, can_plot, held_out_parts, is_held_out, write_curve

METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "curve.png"
TENSORBOARD_DIR = "tensorboard"
RESPONSE_LENGTH = "response_length/mean"
STEP_TIME = "timing_s/step"
_OPTIONAL = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


def check_backends(loggers) -> None:
    """A ``ConfigError`` naming ``trainer.logger`` when a chosen backend's package is not installed, or
    wandb has no credentials (and is not offline)."""
    for name in loggers:
        if name in _OPTIONAL:
            module, extra = _OPTIONAL[name]
            if importlib.util.find_spec(module) is None:
                raise ConfigError(
                    "trainer.logger", f"{name!r} needs the {module} package: pip install 'splitproof[{extra}]'"
                )
    if "wandb" in loggers and not wandb_can_log():
        raise ConfigError(
            "trainer.logger",
            "'wandb' is not logged in: run `wandb login` (or set WANDB_API_KEY), "
            "or log offline with WANDB_MODE=offline",
        )


def wandb_can_log(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``wandb.init`` will find credentials, as wandb looks for them (``WANDB_API_KEY``,
    ``WANDB_IDENTITY_TOKEN_FILE``, a netrc entry for its host), or need none (``WANDB_MODE`` offline,
    disabled or dryrun; ``WANDB_DISABLED``). Read without importing wandb."""
    from urllib.parse import urlparse

    if environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun"):
        return True
    if environ.get("WANDB_DISABLED", "").lower() in ("true", "1"):
        return True
    if environ.get("WANDB_API_KEY") or environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    candidates = [environ["NETRC"]] if environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for candidate in candidates:
        path = Path(candidate).expanduser()
        try:
            words = path.read_text(encoding="utf-8", errors="replace").split()
        except OSError:
            continue
        if any(word == "machine" and following == host for word, following in zip(words, words[1:])):
            return True
    return False


def _number(key: str, value) -> int | float:
    if hasattr(value, "item"):  # a one-element tensor or a NumPy scalar
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}")
    return value


def read_metrics(path: str | os.PathLike, *, up_to_step: int | None = None) -> list[dict]:
    """The records of a metrics.jsonl file (those with step <= up_to_step); stops at a torn last line."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break  # a line cut by a crash: nothing after it was written
            if up_to_step is None or record.get("step", math.inf) <= up_to_step:
                records.append(record)
    return records


def _format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class ConsoleProgress:
    """The progress line: one per step, or one rewritten line on a terminal."""

    def __init__(
        self, total_steps: int, stream: IO[str] | None = None, live: bool | None = None, header: str | None = None
    ):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty() if live is None else live
        if header:
            self.stream.write(header + "\n")
            self.stream.flush()
        self.held_out: dict[str, float] = {}
        self.held_out_step: int | None = None
        self.step_times: list[float] = []
        self._last_call: float | None = None
        self._open_line = False

    def format(self, step: int, metrics: Mapping[str, float]) -> str:
        parts = [f"step {step}/{self.total}"]
        if TRAIN_REWARD in metrics:
            parts.append(f"reward {metrics[TRAIN_REWARD]:.3f}")
        if self.held_out:
            scores = ", ".join(f"{source} {value:.3f}" for source, value in self.held_out.items())
            parts.append(f"held-out {scores} (step {self.held_out_step})")
        if RESPONSE_LENGTH in metrics:
            parts.append(f"resp len {metrics[RESPONSE_LENGTH]:.1f}")
        if self.step_times:
            mean = sum(self.step_times) / len(self.step_times)
            parts.append(f"{self.step_times[-1]:.2f} s/step")
            parts.append(f"ETA {_format_duration(mean * max(0, self.total - step))}")
        return " | ".join(parts)

    def _note_held_out(self, step: int, metrics: Mapping[str, float]) -> list[str]:
        evaluated = [k for k in metrics if is_held_out(k)]
        if evaluated:
            self.held_out = {" ".join(held_out_parts(k)): metrics[k] for k in sorted(evaluated)}
            self.held_out_step = step
        return evaluated

    def resume_from(self, records: list[dict]) -> None:
        """Show the last held-out score of the records before a resume until the next evaluation."""
        for record in records:
            self._note_held_out(record.get("step", 0), record)

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        now = time.perf_counter()
        evaluated = self._note_held_out(step, metrics)
        if STEP_TIME in metrics:
            self.step_times.append(float(metrics[STEP_TIME]))
        elif self._last_call is not None and step > 0:
            self.step_times.append(now - self._last_call)
        self._last_call = now
        line = self.format(step, metrics)
        if step == 0 and line == self.format(0, {}) and not self.held_out:
            return  # nothing evaluated before training: no empty line
        if self.live:
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if evaluated or step >= self.total else ""))
            self._open_line = not (evaluated or step >= self.total)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._open_line:
            self.stream.write("\n")
            self.stream.flush()
            self._open_line = False


class JsonlWriter:
    """``metrics.jsonl``: records after ``resume_step`` dropped first (all of them on a fresh run)."""

    def __init__(self, path: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = read_metrics(self.path, up_to_step=resume_step) if resume_step is not None else []
        tmp = self.path.with_name(f".tmp-{self.path.name}")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.kept = kept
        self.file = open(self.path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def sync(self) -> None:
        """On disk, not only in the OS's cache (before a checkpoint that follows these records)."""
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class TensorBoardWriter:
    def __init__(self, log_dir: str | os.PathLike, resume_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=0 if resume_step is None else resume_step + 1)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, *, project: str, name: str, config: dict | None, directory: str | os.PathLike):
        import wandb

        Path(directory).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, config=config, dir=str(directory))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


def start_line(cfg, total_steps: int) -> str:
    """The console's first line: what is trained on what, where, and where the outputs go."""
    files = cfg.data.train_files if isinstance(cfg.data.train_files, list) else [cfg.data.train_files]
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    if multi_turn.enable and multi_turn.verifiers_env:  # the environment's dataset is the data
        files = [f"verifiers:{multi_turn.verifiers_env}"]
    return (
        f"splitproof train: model {cfg.actor_rollout_ref.model.path} | data {', '.join(map(str, files))} | "
        f"{cfg.algorithm.adv_estimator}, {total_steps} steps | device {cfg.trainer.device} | "
        f"output {cfg.trainer.default_local_dir}"
    )


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class Tracker:
    """``trainer.logger`` backends behind one ``log(metrics, step)`` call per step; rank 0 only."""

    def __init__(
        self,
        loggers,
        *,
        local_dir: str | os.PathLike,
        total_steps: int,
        project_name: str = "splitproof",
        experiment_name: str = "default",
        config: dict | None = None,
        resume_step: int | None = None,
        rank: int | None = None,
        stream: IO[str] | None = None,
        live: bool | None = None,
        curve: bool = True,
        header: str | None = None,
    ):
        unknown = [name for name in loggers if name not in ("console", "file", "tensorboard", "wandb")]
        if unknown:
            raise ConfigError("trainer.logger", f"unknown logger {unknown[0]!r}")
        check_backends(loggers)
        self.active = (_default_rank() if rank is None else rank) == 0
        self.local_dir = Path(local_dir)
        self.title = f"{project_name} / {experiment_name}"
        self.console = None
        self.writers: list[Any] = []
        self.history: list[dict] = []
        self.curve = curve
        self.outputs: list[Path] = []  # the files and folders this tracker wrote (rank 0)
        if not self.active:
            return
        self.local_dir.mkdir(parents=True, exist_ok=True)
        if "console" in loggers:
            self.console = ConsoleProgress(total_steps, stream, live, header)
        if "file" in loggers:
            jsonl = JsonlWriter(self.local_dir / METRICS_FILE, resume_step)
            self.history = list(jsonl.kept)
            self.writers.append(jsonl)
            self.outputs.append(jsonl.path)
        if self.console is not None and resume_step is not None:
            self.console.resume_from(
                self.history or read_metrics(self.local_dir / METRICS_FILE, up_to_step=resume_step)
            )
        if "tensorboard" in loggers:
            self.writers.append(TensorBoardWriter(self.local_dir / TENSORBOARD_DIR, resume_step))
            self.outputs.append(self.local_dir / TENSORBOARD_DIR)
        if "wandb" in loggers:
            self.writers.append(
                WandbWriter(project=project_name, name=experiment_name, config=config, directory=self.local_dir)
            )

    @classmethod
    def from_config(cls, cfg, *, total_steps: int, resume_step: int | None = None, **kwargs) -> Tracker:
        """From a resolved ``TrainConfig`` (``trainer.logger``, ``default_local_dir``, project and experiment).
        With ``trainer.val_only`` only the console shows the evaluation: the run's files (metrics.jsonl,
        TensorBoard, wandb, curve.png) keep the training run's records, as an uninterrupted run left them."""
        from ..config.load import config_dict

        trainer = cfg.trainer
        loggers = [name for name in trainer.logger if name == "console"] if trainer.val_only else trainer.logger
        return cls(
            loggers,
            local_dir=trainer.default_local_dir,
            total_steps=total_steps,
            project_name=trainer.project_name,
            experiment_name=trainer.experiment_name,
            config=config_dict(cfg),
            resume_step=resume_step,
            curve=not trainer.val_only and can_plot(),
            header=start_line(cfg, total_steps),
            **kwargs,
        )

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """One call per step with all of that step's metrics (evaluation included)."""
        if not self.active:
            return
        values = {key: _number(key, value) for key, value in metrics.items()}
        self.history.append({"step": step, **values})
        for writer in self.writers:
            writer.write(step, values)
        if self.console is not None:
            self.console.update(step, values)

    def sync(self) -> None:
        """Every record logged so far on disk (the loop calls it before writing a checkpoint)."""
        for writer in self.writers:
            if hasattr(writer, "sync"):
                writer.sync()

    def finish(self) -> Path | None:
        """Close every backend and write ``curve.png``; returns its path (None if nothing to plot)."""
        if not self.active:
            return None
        if self.console is not None:
            self.console.close()
        for writer in self.writers:
            writer.close()
        self.writers = []
        curve = write_curve(self.history, self.local_dir / CURVE_FILE, self.title) if self.curve else None
        if curve is not None:
            self.outputs.append(curve)
        return curve

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.finish()
