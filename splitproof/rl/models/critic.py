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

import torch

from ...engine.precision import compute_in
from ..config.derive import critic_strategy, to_critic_update_config
from ..config.mixed_precision import critic_precision
from ..config.schema import TrainConfig
from .learner import Learner, no_grad_split, wrap_for_ranks
from .optim import make_optimizer, make_scheduler
from .policy import MODEL_DTYPES, autocast_dtype, load_value_model


def build_critic(
    cfg: TrainConfig,
    *,
    world_size: int,
    total_steps: int,
    vocab_size: int | None = None,
    device: torch.device | str = "cpu",
) -> Learner:
    """The critic from ``critic.model.path`` on ``device`` with its optimizer and schedule (``critic.*`` keys)."""
    c = cfg.critic
    model = load_value_model(
        c.model, dtype=MODEL_DTYPES[c.fsdp.model_dtype], seed=cfg.trainer.seed, vocab_size=vocab_size, device=device
    )
    model = compute_in(model, autocast_dtype(critic_precision(cfg)))
    model, inference_copy = wrap_for_ranks(model, critic_strategy(cfg) if world_size > 1 else "", world_size)
    optimizer = make_optimizer(model, c.optim)
    scheduler = make_scheduler(optimizer, c.optim, total_steps)
    split = no_grad_split(c.forward_micro_batch_size_per_gpu, c.use_dynamic_bsz, c.forward_max_token_len_per_gpu)
    return Learner(
        kind="critic",
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        update_config=to_critic_update_config(cfg),
        no_grad_split=split,
        inference_copy=inference_copy,
    )
