"""The critic of PPO with GAE (``algorithm.adv_estimator=gae``): built beside the policy, updated every step.

The critic is the policy's architecture with a scalar head (``AutoModelForTokenClassification``,
``num_labels=1``), loaded from ``critic.model.path`` (the actor's model unless set: the built-in model
when the actor is the built-in model), its head seeded by ``trainer.seed``. Under torchrun it is wrapped
for DDP or FSDP2 (``critic.strategy``) like the policy, and its no-grad values pass runs on a plain module
with the same weights (a full copy refreshed after each update under FSDP2). It has its own optimizer and
LR schedule (``critic.optim``), stepped once per training step after its update, as verl steps them.

Within a step (verl's order): values → advantages and returns → critic update → actor update (from step
``max(1, trainer.critic_warmup)`` on). The value loss is the engine's: clipped around the values before
the update, aggregated over the critic's whole minibatch, so its split never changes the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...engine import CriticUpdateConfig, update_critic, wrap_model
from ...hf_models import unwrap
from ..config.schema import TrainConfig
from ..config.check import critic_strategy, to_critic_update_config
from ..tracking.metrics import CRITIC_METRICS, step_means
from .policy import MODEL_DTYPES, frozen_copy, load_value_model, refresh_copy
from .optim import make_optimizer, make_scheduler


@dataclass
class Critic:
    """The value model, its optimizer and LR schedule, and how its passes are split."""

    model: nn.Module  # wrapped for DDP/FSDP2 under torchrun
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    update_config: CriticUpdateConfig
    forward_split: dict  # the values pass: ``micro_batch_size`` or ``max_token_len``
    inference_copy: nn.Module | None = None  # FSDP2 only
    optimizer_steps: int = 0

    def for_inference(self) -> nn.Module:
        return self.inference_copy if self.inference_copy is not None else unwrap(self.model)

    def after_update(self) -> None:
        """Refresh the FSDP2 inference copy from the sharded critic (every rank takes part)."""
        refresh_copy(self.model, self.inference_copy)


def build_critic(cfg: TrainConfig, *, world_size: int, total_steps: int, vocab_size: int | None = None) -> Critic:
    """The critic from ``critic.model.path`` with its optimizer and schedule (``critic.*`` keys)."""
    c = cfg.critic
    model = load_value_model(c.model, dtype=MODEL_DTYPES[c.fsdp.model_dtype], seed=cfg.trainer.seed,
                             vocab_size=vocab_size)
    inference_copy = None
    if world_size > 1:
        strategy = critic_strategy(cfg)
        if strategy == "fsdp2":
            inference_copy = frozen_copy(model)
        model = wrap_model(model, strategy)
    optimizer = make_optimizer(model, c.optim)
    scheduler = make_scheduler(optimizer, c.optim, total_steps)
    split = ({"max_token_len": int(c.forward_max_token_len_per_gpu)} if c.use_dynamic_bsz
             else {"micro_batch_size": c.forward_micro_batch_size_per_gpu})
    return Critic(model=model, optimizer=optimizer, scheduler=scheduler, update_config=to_critic_update_config(cfg),
                  forward_split=split, inference_copy=inference_copy)


def train_critic(critic: Critic, batch, *, collective) -> dict[str, float]:
    """Every critic optimizer step over ``batch`` (with ``values`` and ``returns``), then one step of its LR
    schedule; its metrics under verl's names (``critic/lr``: the rate these steps used)."""
    critic.model.train()
    results = update_critic(critic.model, critic.optimizer, batch, critic.update_config, collective=collective,
                            step=critic.optimizer_steps)
    critic.optimizer_steps += len(results)
    lr = critic.optimizer.param_groups[0]["lr"]
    critic.scheduler.step()
    critic.after_update()
    return {**step_means((r.metrics for r in results), CRITIC_METRICS), "critic/lr": lr}
