"""Finding the checkpoint a run resumes from, and checking it against the run's config: paths and YAML
only, no torch, so that a rerun of a finished run is answered at once (``finished_run``).

A checkpoint ``global_step_N`` is complete when it holds its ``complete`` file; ``latest_checkpointed_iteration.txt``
(verl's name) names the newest. Resuming compares the checkpoint's saved config with the run's: a key that
changes results (anything outside ``LAYOUT_KEYS``) is an error naming it.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ...loss_config import ConfigError
from ..config.derive import critic_enabled
from ..config.schema import TrainConfig, TrainerConfig

TRACKER = "latest_checkpointed_iteration.txt"
STEP_DIR = re.compile(r"^global_step_(\d+)$")
COMPLETE = "complete"

# keys that may change between a checkpoint and its resumption: they never change a result
LAYOUT_KEYS = (
    "*micro_batch_size_per_gpu",
    "*max_token_len_per_gpu",
    "*use_dynamic_bsz",
    "*.strategy",
    "*use_remove_padding",
    "actor_rollout_ref.rollout.max_num_seqs",
    "actor_rollout_ref.rollout.max_num_batched_tokens",  # the vLLM engine's scheduling and memory
    "actor_rollout_ref.rollout.max_model_len",
    "actor_rollout_ref.rollout.enable_chunked_prefill",
    "actor_rollout_ref.rollout.enable_prefix_caching",
    "actor_rollout_ref.rollout.enforce_eager",
    "actor_rollout_ref.rollout.gpu_memory_utilization",
    "actor_rollout_ref.rollout.free_cache_engine",
    "*model.enable_gradient_checkpointing",
    "actor_rollout_ref.nccl_timeout",
    "actor_rollout_ref.actor.policy_loss.cov_strategy",
    "data.val_batch_size",
    "trainer.logger",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.total_training_steps",
    "trainer.total_epochs",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.resume_allow_config_change",
    "trainer.default_local_dir",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.val_before_train",
    "trainer.val_only",
    "trainer.cpu_threads",
    "trainer.cpu_keep_freed_memory",
    "data.gen_batch_size",
    "algorithm.filter_groups.max_num_gen_batches",
    "trainer.rollout_data_dir",
    "trainer.validation_data_dir",
)
# ... except the run length, when the LR schedule is a function of it
SCHEDULE_LENGTH_KEYS = ("trainer.total_training_steps", "trainer.total_epochs")


@dataclass
class Resumed:
    """What a loaded checkpoint hands back to the loop (model, optimizer, schedule and RNGs are restored)."""

    path: Path
    step: int
    trainer_state: dict
    config_yaml: str


# ----------------------------------------------------------------------------------------------- paths


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{step}"


def is_complete(path: str | os.PathLike) -> bool:
    path = Path(path)
    return STEP_DIR.match(path.name) is not None and (path / COMPLETE).is_file()


def complete_steps(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for e in root.iterdir() if (m := STEP_DIR.match(e.name)) and is_complete(e))


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The checkpoint the tracker file names if it is complete, else the complete one with the highest step."""
    root = Path(root)
    tracker = root / TRACKER
    if tracker.is_file():
        text = tracker.read_text().strip()
        if text.isdigit() and is_complete(checkpoint_dir(root, int(text))):
            return checkpoint_dir(root, int(text))
    steps = complete_steps(root)
    return checkpoint_dir(root, steps[-1]) if steps else None


# ----------------------------------------------------------------------------------------------- resume


def find_resume_checkpoint(trainer: TrainerConfig) -> Path | None:
    """The checkpoint to resume from under ``trainer.resume_mode``, or None to start fresh."""
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "auto":
        return latest_checkpoint(trainer.default_local_dir)
    path = Path(trainer.resume_from_path)
    if not path.exists():
        raise ConfigError("trainer.resume_from_path", f"{path} does not exist")
    if is_complete(path):
        return path
    if STEP_DIR.match(path.name) is None:
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise ConfigError(
        "trainer.resume_from_path",
        f"{path} is not a complete checkpoint (a global_step_N directory with its '{COMPLETE}' file)",
    )


def _flat(tree, prefix: str = "") -> dict:
    """Leaf (dotted key, value) pairs; an empty mapping is a leaf of its own, so that a key added to it
    (``+data.apply_chat_template_kwargs.enable_thinking=true``) shows as a change."""
    if isinstance(tree, dict) and tree:
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: tree}


def schedule_uses_run_length(cfg: TrainConfig) -> bool:
    """Whether an LR schedule (the actor's, or the critic's when it is on) depends on the run's length."""
    optims = [cfg.actor_rollout_ref.actor.optim] + ([cfg.critic.optim] if critic_enabled(cfg) else [])
    return any(
        o.total_training_steps == -1 and (o.lr_scheduler_type != "constant" or o.lr_warmup_steps_ratio > 0)
        for o in optims
    )


def resume_changes(saved_yaml: str, cfg: TrainConfig) -> list[tuple[str, object, object]]:
    """``(key, checkpoint's value, this run's value)`` for each result-affecting key whose value differs
    between the checkpoint's config and ``cfg``, or that one of them has and the other lacks (a key added to
    or removed from a mapping-valued setting; the missing side is ``MISSING``), by key."""
    from omegaconf import OmegaConf

    from ..config.load import config_dict

    saved = _flat(OmegaConf.to_container(OmegaConf.create(saved_yaml), resolve=True))
    now = _flat(config_dict(cfg))
    free = [p for p in LAYOUT_KEYS if not (p in SCHEDULE_LENGTH_KEYS and schedule_uses_run_length(cfg))]
    return [
        (k, saved.get(k, MISSING), now.get(k, MISSING))
        for k in sorted(saved.keys() | now.keys())
        if saved.get(k, MISSING) != now.get(k, MISSING) and not any(fnmatch.fnmatchcase(k, p) for p in free)
    ]


class _Missing:
    def __repr__(self) -> str:
        return "(unset)"


MISSING = _Missing()


def resume_differences(saved_yaml: str, cfg: TrainConfig) -> list[str]:
    """The keys of ``resume_changes``."""
    return [key for key, _, _ in resume_changes(saved_yaml, cfg)]


def check_resume_config(resumed: Resumed, cfg: TrainConfig) -> None:
    """A ``ConfigError`` naming every result-affecting key that changed, with the checkpoint's value and
    this run's, unless the user allows it."""
    if cfg.trainer.resume_allow_config_change:
        return
    changes = resume_changes(resumed.config_yaml, cfg)
    if changes:
        shown = "; ".join(f"{key} was {old!r} there, {new!r} now" for key, old, new in changes)
        raise ConfigError(
            ", ".join(key for key, _, _ in changes),
            f"differs from the checkpoint being resumed ({resumed.path}): {shown}; resume with the "
            "checkpoint's values, or set trainer.resume_allow_config_change=true",
        )


def finished_run(cfg: TrainConfig) -> tuple[Path, int] | None:
    """``(checkpoint, step)`` when ``trainer.resume_mode`` picks a checkpoint at or past the run's last step
    (``trainer.total_training_steps``; unset, the length needs the data, and None is returned), checked as a
    resume is (``ConfigError``); else None. No model, data or torch needed."""
    total = cfg.trainer.total_training_steps
    if total is None or cfg.trainer.val_only:
        return None
    path = find_resume_checkpoint(cfg.trainer)
    if path is None:
        return None
    step = check_resume_point(cfg, path)
    return (path, step) if step >= total else None


def check_resume_point(cfg: TrainConfig, path: Path) -> int:
    """The step of checkpoint ``path``, after checking it fits ``cfg`` (result-affecting keys, the critic)."""
    step = int(STEP_DIR.match(path.name).group(1))
    check_resume_config(
        Resumed(path=path, step=step, trainer_state={}, config_yaml=(path / "config.yaml").read_text()), cfg
    )
    if critic_enabled(cfg) and not (path / "critic_state").is_dir():
        raise ConfigError(
            "critic.enable", f"the run trains a critic but the checkpoint being resumed ({path}) holds none"
        )
    return step


def finished_message(cfg: TrainConfig, checkpoint: Path, step: int) -> str:
    """What a rerun of a finished run says: nothing to do, and how to train further or start over."""
    further = (
        ""
        if schedule_uses_run_length(cfg)
        else f"To train further: trainer.total_training_steps=N with N > {step} (it continues from this checkpoint). "
    )
    return (
        f"the run is complete (checkpoint {checkpoint} at step {step}); nothing to do, metrics.jsonl and "
        f"curve.png are left as they are. {further}To start over: trainer.resume_mode=disable, or another "
        "trainer.default_local_dir"
    )
