"""A training run's checkpoint: what a ``Run`` saves beside its model and optimizer, and how it resumes.

``checkpoint.save_checkpoint`` keeps the model, the optimizer, the LR schedule and every RNG (and the
same of the critic, when the run has one); the run adds its own state: the prompt sampler's position
(epoch, cursor), the KL controller's coefficient and the number of optimizer steps taken by the actor
and the critic (the engine's minibatch-shuffle streams are keyed by them), and a pipelined run's in-flight
rollouts (``rollout.pipeline``). That is
everything the next step depends on, so a resumed run continues the same trajectory. The reference
model is not saved: it is the initial model, loaded again from ``actor_rollout_ref.model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...loss_config import ConfigError
from .store import (STEP_DIR, Resumed, Trainable, check_resume_config, find_resume_checkpoint,
                         load_checkpoint, save_checkpoint)
from ..config.schema import TrainConfig
from ..config.check import critic_enabled
from ..config.load import dump_config
from ..rollout.pipeline import check_resumable
from ..run import Run


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from, and its step."""

    path: Path
    step: int


def resume_point(cfg: TrainConfig, total_steps: int) -> ResumePoint | None:
    """The checkpoint ``trainer.resume_mode`` picks (None: start at step 0), checked against ``cfg``
    without loading its models: a result-affecting key that changed, a run shorter than the checkpoint, or
    a pipelined run whose in-flight rollouts the checkpoint lacks, is a ``ConfigError`` naming the key."""
    path = find_resume_checkpoint(cfg.trainer)
    if path is None:
        return None
    step = int(STEP_DIR.match(path.name).group(1))
    check_resume_config(Resumed(path=path, step=step, trainer_state={},
                                config_yaml=(path / "config.yaml").read_text()), cfg)
    if critic_enabled(cfg) and not (path / "critic_state").is_dir():
        raise ConfigError("critic.enable", f"the run trains a critic but the checkpoint being resumed ({path}) holds none")
    if step > total_steps:
        raise ConfigError("trainer.total_training_steps",
                          f"the run has {total_steps} steps but the checkpoint being resumed ({path}) is at step {step}")
    if cfg.async_training.staleness_steps:  # a pipelined run needs the rollouts in flight at the checkpoint
        saved = torch.load(path / "trainer_state.pt", weights_only=True)["trainer_state"]
        check_resumable(saved.get("pipeline"), step, total_steps, cfg.async_training.staleness_steps)
    return ResumePoint(path=path, step=step)


def run_state(run: Run) -> dict:
    """The loop's state a checkpoint keeps (tensors, numbers, strings, lists and dicts only)."""
    return {"sampler": run.sampler.state_dict(),
            "kl_ctrl": None if run.kl_ctrl is None else run.kl_ctrl.state_dict(),
            "optimizer_steps": run.optimizer_steps,
            "critic_optimizer_steps": None if run.critic is None else run.critic.optimizer_steps,
            "pipeline": None if run.pipeline is None else run.pipeline.state_dict()}


def _critic(run: Run) -> Trainable | None:
    c = run.critic
    return None if c is None else Trainable(c.model, c.optimizer, c.scheduler)


def save_run(run: Run, step: int) -> Path:
    """``global_step_{step}`` under ``trainer.default_local_dir``; every rank calls it."""
    cfg = run.config
    return save_checkpoint(cfg.trainer.default_local_dir, step, model=run.policy, optimizer=run.optimizer,
                           trainer_state=run_state(run), lr_scheduler=run.scheduler, config_yaml=dump_config(cfg),
                           tokenizer=run.tokenizer, max_to_keep=cfg.trainer.max_actor_ckpt_to_keep,
                           critic=_critic(run))


def restore_run(run: Run, point: ResumePoint) -> int:
    """Load ``point`` into ``run`` (models, optimizers, schedules, RNGs, sampler, KL controller, optimizer
    step counts); returns the step to continue after. Every rank calls it."""
    if run.lora:
        check_base_unchanged(run, point.path)
    resumed = load_checkpoint(point.path, model=run.policy, optimizer=run.optimizer, lr_scheduler=run.scheduler,
                              critic=_critic(run))
    state = resumed.trainer_state
    run.sampler.load_state_dict(state["sampler"])
    if run.kl_ctrl is not None:
        run.kl_ctrl.load_state_dict(state["kl_ctrl"])
    run.optimizer_steps = int(state["optimizer_steps"])
    run.extra["pipeline_state"] = state.get("pipeline")  # the in-flight rollouts of a pipelined run
    run.after_update()
    if run.critic is not None:
        run.critic.optimizer_steps = int(state["critic_optimizer_steps"])
        run.critic.after_update()
    return resumed.step


def check_base_unchanged(run: Run, path: Path) -> None:
    """A LoRA checkpoint holds the adapter only: the base weights loaded now must be the ones it was
    trained on (the digest its ``actor/`` adapter carries). Every rank calls it (a collective under FSDP2)."""
    from ...lora import base_digest, saved_digest

    saved, ours = saved_digest(Path(path) / "actor"), base_digest(run.policy)
    if saved is not None and saved != ours:
        raise ConfigError("actor_rollout_ref.model.path", f"the checkpoint {path} was trained on other base weights "
                          f"(digest {saved[:12]}, this model's {ours[:12]})")
