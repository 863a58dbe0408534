"""A trained model and everything that steps it: the actor and the critic have this one shape.

A ``Learner`` holds its model (wrapped for DDP or FSDP2 under torchrun), its optimizer and LR schedule,
the engine's update settings, how its no-grad pass is split, and the plain module that no-grad passes
and generation run on: the model itself under DDP or on one process, a frozen copy refreshed after each
update under FSDP2 (whose sharded forward would need every rank in lockstep). ``update`` runs every
optimizer step of one update, steps the schedule once (as verl does, per training step) and refreshes
the copy. It counts its optimizer steps (the engine's minibatch-shuffle streams are keyed by them).

The reference policy is the initial policy: a frozen copy, or with LoRA the actor's inference policy
with its adapter disabled (the base model, unmerged, no copy).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ...engine import CriticUpdateConfig, UpdateConfig, update_critic, update_policy, wrap_model
from ...hf_models import unwrap
from ...lora import adapter_disabled
from ..tracking.metrics import CRITIC_METRICS, actor_metrics, step_means
from .policy import frozen_copy, refresh_copy


def critic_metrics(step_metrics) -> dict[str, float]:
    return step_means(step_metrics, CRITIC_METRICS)


@dataclass
class Learner:
    """The actor (``kind="actor"``) or the critic (``kind="critic"``); see the module docstring."""

    kind: str
    model: nn.Module  # wrapped for DDP/FSDP2 under torchrun
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update_config: UpdateConfig | CriticUpdateConfig
    no_grad_split: dict  # its no-grad pass: ``micro_batch_size`` or ``max_token_len``
    inference_copy: nn.Module | None = None  # FSDP2 only
    trainable_only: bool = False  # LoRA: the copy refreshes the adapter alone (the base never changes)
    optimizer_steps: int = 0  # optimizer steps taken so far

    def for_inference(self) -> nn.Module:
        return self.inference_copy if self.inference_copy is not None else unwrap(self.model)

    def refresh(self) -> None:
        """Refresh the FSDP2 inference copy from the sharded model (every rank takes part)."""
        refresh_copy(self.model, self.inference_copy, trainable_only=self.trainable_only)

    def update(self, batch, collective) -> dict[str, float]:
        """Every optimizer step over ``batch``, then one step of the LR schedule; ``{kind}/*`` metrics
        (``{kind}/lr``: the rate these steps used)."""
        actor = self.kind == "actor"
        engine_update, summarize = (update_policy, actor_metrics) if actor else (update_critic, critic_metrics)
        self.model.train()
        results = engine_update(
            self.model,
            self.optimizer,
            batch,
            self.update_config,
            collective=collective,
            first_optimizer_step=self.optimizer_steps,
        )
        self.optimizer_steps += len(results)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scheduler.step()
        self.refresh()
        return {**summarize(r.metrics for r in results), f"{self.kind}/lr": lr}


def wrap_for_ranks(model: nn.Module, strategy: str, world_size: int) -> tuple[nn.Module, nn.Module | None]:
    """``model`` wrapped for ``strategy`` under several ranks, and its inference copy (FSDP2 only)."""
    if world_size <= 1:
        return model, None
    copy = frozen_copy(model) if strategy == "fsdp2" else None
    return wrap_model(model, strategy), copy


def no_grad_split(micro_batch_size, use_dynamic_bsz, max_token_len) -> dict:
    """A no-grad pass's split: a token budget with ``use_dynamic_bsz``, else fixed micro-batches."""
    if use_dynamic_bsz:
        return {"max_token_len": int(max_token_len)}
    return {"micro_batch_size": micro_batch_size}


@dataclass(frozen=True)
class ReferencePolicy:
    """The initial policy for the reference log-probs: ``frozen`` (a copy), or with LoRA the ``actor``'s
    inference policy with its adapter disabled."""

    frozen: nn.Module | None = None
    actor: Learner | None = None

    @contextmanager
    def model(self):
        if self.actor is None:
            yield self.frozen
            return
        with adapter_disabled(self.actor.for_inference()) as base:
            yield base
