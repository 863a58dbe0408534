"""A training run's checkpoint: what a run saves beside its models and optimizers, and how it resumes.

``checkpoint.save_checkpoint`` keeps the model, the optimizer, the LR schedule and every RNG (and the
same of the critic, when the run has one); the run adds its own state: the prompt sampler's position
(epoch, cursor), the KL controller's coefficient and the number of optimizer steps taken by the actor
and the critic (the engine's minibatch-shuffle streams are keyed by them), and a pipelined run's in-flight
rollouts (``rollout.pipeline``). That is everything the next step depends on, so a resumed run continues
the same trajectory: ``restore_run`` loads it into the parts and returns what the loop continues from
(``Restored``: the step, and the in-flight rollouts the pipeline starts from). The reference
model is not saved: it is the initial model, loaded again from ``actor_rollout_ref.model.path``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...loss_config import ConfigError
from ..config.schema import TrainConfig
from ..rollout.pipeline import check_resumable
from ..run import Parts
from .resume import check_resume_point, find_resume_checkpoint
from .store import Trainable, load_checkpoint, save_checkpoint


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
    step = check_resume_point(cfg, path)
    if step > total_steps:
        raise ConfigError(
            "trainer.total_training_steps",
            f"the run has {total_steps} steps but the checkpoint being resumed ({path}) is at step {step}",
        )
    if cfg.async_training.staleness_steps:  # a pipelined run needs the rollouts in flight at the checkpoint
        saved = torch.load(path / "trainer_state.pt", map_location="cpu", weights_only=True)["trainer_state"]
        check_resumable(saved.get("pipeline"), step, total_steps, cfg.async_training.staleness_steps)
    return ResumePoint(path=path, step=step)


@dataclass(frozen=True)
class Restored:
    """What a checkpoint gives the loop: the step to continue after and a pipelined run's in-flight
    rollouts (None: a synchronous run)."""

    step: int
    pipeline_state: dict | None = None


def run_state(parts: Parts, pipeline=None) -> dict:
    """The loop's state a checkpoint keeps (tensors, numbers, strings, lists and dicts only)."""
    return {
        "sampler": parts.prompts.sampler.state_dict(),
        "kl_ctrl": None if parts.kl_ctrl is None else parts.kl_ctrl.state_dict(),
        "optimizer_steps": parts.actor.optimizer_steps,
        "critic_optimizer_steps": None if parts.critic is None else parts.critic.optimizer_steps,
        "pipeline": None if pipeline is None else pipeline.state_dict(),
    }


def _critic(parts: Parts) -> Trainable | None:
    c = parts.critic
    return None if c is None else Trainable(c.model, c.optimizer, c.scheduler)


def save_run(parts: Parts, step: int, pipeline=None) -> Path:
    """``global_step_{step}`` under ``trainer.default_local_dir``, with ``pipeline``'s in-flight rollouts;
    every rank calls it."""
    cfg, actor = parts.config, parts.actor
    return save_checkpoint(
        cfg.trainer.default_local_dir,
        step,
        model=actor.model,
        optimizer=actor.optimizer,
        trainer_state=run_state(parts, pipeline),
        lr_scheduler=actor.scheduler,
        config_yaml=parts.config_yaml,
        tokenizer=parts.tokenizer,
        max_to_keep=cfg.trainer.max_actor_ckpt_to_keep,
        critic=_critic(parts),
    )


def restore_run(parts: Parts, point: ResumePoint) -> Restored:
    """Load ``point`` into the parts (models, optimizers, schedules, RNGs, sampler, KL controller, optimizer
    step counts); returns the step to continue after and the in-flight rollouts. Every rank calls it."""
    actor = parts.actor
    if parts.lora:
        check_base_unchanged(parts, point.path)
    resumed = load_checkpoint(
        point.path, model=actor.model, optimizer=actor.optimizer, lr_scheduler=actor.scheduler, critic=_critic(parts)
    )
    state = resumed.trainer_state
    parts.prompts.sampler.load_state_dict(state["sampler"])
    if parts.kl_ctrl is not None:
        parts.kl_ctrl.load_state_dict(state["kl_ctrl"])
    actor.optimizer_steps = int(state["optimizer_steps"])
    actor.refresh()
    if parts.critic is not None:
        parts.critic.optimizer_steps = int(state["critic_optimizer_steps"])
        parts.critic.refresh()
    return Restored(step=resumed.step, pipeline_state=state.get("pipeline"))


def check_base_unchanged(parts: Parts, path: Path) -> None:
    """A LoRA checkpoint holds the adapter only: the base weights loaded now must be the ones it was
    trained on (the digest its ``actor/`` adapter carries). Every rank calls it (a collective under FSDP2)."""
    from ...lora import base_digest, saved_digest

    saved, ours = saved_digest(Path(path) / "actor"), base_digest(parts.actor.model)
    if saved is not None and saved != ours:
        raise ConfigError(
            "actor_rollout_ref.model.path",
            f"the checkpoint {path} was trained on other base weights (digest {saved[:12]}, this model's {ours[:12]})",
        )
