"""The critic's update: the value model's clipped loss through the engine's own optimizer step.

Everything but the objective is the policy update's machinery: the plan (minibatches by (seed, epoch),
shards, microbatches, token budgets, packing), validation before anything runs, the minibatch statistics
summed over ranks, gradients summed over ranks once per step, clipping, and skipping a non-finite step
(:mod:`splitproof.engine.optimizer_step`). Only the forward (values instead of log-probs) and the share
(``value_objective.value_share``) differ, so the critic's update is split-, order- and DP-invariant
exactly as the policy's is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..batch import BatchError, RolloutBatch, require_group_index
from ..collective import LOCAL, default_collective
from ..loss_config import GROUP_AGG, ConfigError
from ..hf_models import unwrap
from ..stats import MinibatchStats
from ..value_objective import VALUE_METRICS, value_share
from .update_config import CriticUpdateConfig
from .distributed import needs_lockstep
from .plan import MinibatchPlan
from .optimizer_step import Part, StepResult, device_of, optimizer_step
from .validation import check_positions, validate_plans
from .values import response_values


def update_critic(model: nn.Module, optimizer: torch.optim.Optimizer, batch: RolloutBatch,
                  config: CriticUpdateConfig, *, collective=None, optimizer_step: int = 0,
                  on_gradients: Callable[[nn.Module], None] | None = None) -> list[StepResult]:
    """Run every optimizer step of one critic update over ``batch`` (the same rollout batch on every rank,
    with ``values`` from the critic's pass before the update and ``returns``).

    Metrics per step, verl's names: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``
    (global over the minibatch), ``critic/grad_norm`` (before clipping), ``critic/step_skipped``.
    """
    collective = collective or default_collective(device_of(model))
    if collective.world_size > 1 and not needs_lockstep(model):
        raise ValueError("model: with several ranks, wrap the model with DDP or FSDP2 (splitproof.engine.wrap_model)")
    batch, plans = validate_critic_update(model, batch, config, collective)
    batch = batch.to(device_of(model))
    return [train_critic_minibatch(model, optimizer, batch, plan, config, collective=collective,
                                   step=optimizer_step + i, on_gradients=on_gradients) for i, plan in enumerate(plans)]


def validate_critic_update(model: nn.Module, batch: RolloutBatch, config: CriticUpdateConfig,
                           collective=LOCAL) -> tuple[RolloutBatch, list[MinibatchPlan]]:
    """The validated batch and this rank's plan of every critic step; a batch without ``values`` or
    ``returns`` is a BatchError naming the field."""
    if not isinstance(config, CriticUpdateConfig):
        raise TypeError(f"config: expected a CriticUpdateConfig, got {type(config).__name__}")

    check_value_model(model)

    def critic_checks(batch: RolloutBatch) -> None:
        for name, what in (("values", "the critic's predictions before the update (engine.compute_values)"),
                           ("returns", "the critic's targets (e.g. GAE returns)")):
            if getattr(batch, name) is None:
                raise BatchError(name, f"the critic's update needs {what}; the batch has none")
        require_group_index(batch.index, config.loss_agg_mode)
        check_positions(model, batch)

    return validate_plans(model, batch, config, collective, critic_checks)


def check_value_model(model: nn.Module) -> None:
    """A causal LM (an output embedding over the vocabulary) is not a value model: refuse it before any forward."""
    inner = unwrap(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if head is not None:
        raise ConfigError("model", f"a value model has one output per position, got a causal LM "
                          f"({type(inner).__name__}); build one with splitproof.value_model.value_model_from_pretrained")


def train_critic_minibatch(model, optimizer, batch: RolloutBatch, plan: MinibatchPlan, config: CriticUpdateConfig,
                           *, collective=LOCAL, step: int = 0, on_gradients=None) -> StepResult:
    """One critic optimizer step over the minibatch ``plan.rows``; ``batch`` is validated."""
    objective = ValueObjective(config, collective.world_size, batch.index)
    return optimizer_step(model, optimizer, batch, plan, objective, grad_clip=config.grad_clip,
                          collective=collective, step=step, on_gradients=on_gradients)


class ValueObjective:
    """The critic's J_V(ℬ) for :func:`~splitproof.engine.optimizer_step.optimizer_step`: values per microbatch and
    ``value_share``; no pass before or after the loop.

    ``statistics_scope="microbatch"`` (the diagnosis's emulation of verl before its PR #6957): each
    microbatch normalised by its own N, G, and the shares divided by the DP size D, as verl's wrapper
    averages the ranks' gradients — the sum of K local means instead of one mean over the minibatch.
    """

    grad_norm_metric = "critic/grad_norm"
    skipped_metric = "critic/step_skipped"
    syncs_in_loop = True

    def __init__(self, config: CriticUpdateConfig, world_size: int = 1, index: Tensor | None = None):
        self.config = config
        self.loss = config.value_loss
        self.world_size = world_size
        self.group_index = index if config.loss_agg_mode == GROUP_AGG else None

    def begin(self, model, stats: MinibatchStats) -> None:
        return None

    def before(self, model) -> None:
        pass

    def share(self, model, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        sub = part.batch
        index = sub.index if self.group_index is not None else None
        vpreds = response_values(model, sub, packed=self.config.use_remove_padding)
        scale = 1.0
        if self.config.statistics_scope == "microbatch":
            stats, scale = MinibatchStats.of(sub.response_mask, index=index), 1.0 / self.world_size
        return value_share(vpreds, sub.values, sub.returns, sub.response_mask, self.loss, stats, scale=scale,
                           index=index)

    def after(self, model, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        pass

    def metric_names(self) -> list[str]:
        return list(VALUE_METRICS)
