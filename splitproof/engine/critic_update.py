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
from ..collective import LOCAL
from ..hf_models import unwrap
from ..loss_config import ConfigError
from ..stats import MinibatchStats
from ..value_objective import VALUE_METRICS, value_share
from .optimizer_step import Objective, Part, StepResult, group_ids, optimizer_steps, prepare_update
from .plan import MinibatchPlan
from .update_config import CriticUpdateConfig
from .validation import check_positions, validate_plans
from .values import response_values


def update_critic(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    config: CriticUpdateConfig,
    *,
    collective=None,
    first_optimizer_step: int = 0,
    make_objective: Callable[..., Objective] | None = None,
) -> list[StepResult]:
    """Run every optimizer step of one critic update over ``batch`` (the same rollout batch on every rank,
    with ``values`` from the critic's pass before the update and ``returns``).

    Metrics per step, verl's names: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``
    (global over the minibatch), ``critic/grad_norm`` (before clipping), ``critic/step_skipped``. Each
    step's J_V(ℬ) is ``make_objective(config, batch, plan, collective, step)``, by default
    :class:`ValueObjective`.
    """
    collective, batch, plans = prepare_update(model, batch, config, collective, validate_critic_update)
    make_objective = make_objective or ValueObjective
    return optimizer_steps(model, optimizer, batch, plans, make_objective, config, collective, first_optimizer_step)


def validate_critic_update(
    model: nn.Module, batch: RolloutBatch, config: CriticUpdateConfig, collective=LOCAL
) -> tuple[RolloutBatch, list[MinibatchPlan]]:
    """The validated batch and this rank's plan of every critic step; a batch without ``values`` or
    ``returns`` is a BatchError naming the field."""
    if not isinstance(config, CriticUpdateConfig):
        raise TypeError(f"config: expected a CriticUpdateConfig, got {type(config).__name__}")

    check_value_model(model)

    def critic_checks(batch: RolloutBatch) -> None:
        for name, what in (
            ("values", "the critic's predictions before the update (engine.compute_values)"),
            ("returns", "the critic's targets (e.g. GAE returns)"),
        ):
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
        raise ConfigError(
            "model",
            f"a value model has one output per position, got a causal LM "
            f"({type(inner).__name__}); build one with "
            "splitproof.value_model.value_model_from_pretrained",
        )


class ValueObjective:
    """The critic's J_V(ℬ) for :func:`~splitproof.engine.optimizer_step.optimizer_step`: values per microbatch and
    ``value_share``; no pass before or after the loop."""

    grad_norm_metric = "critic/grad_norm"
    skipped_metric = "critic/step_skipped"
    syncs_in_loop = True

    def __init__(self, config: CriticUpdateConfig, batch: RolloutBatch, plan: MinibatchPlan, collective, step: int):
        self.config = config
        self.loss = config.value_loss
        self.group_index = group_ids(batch, config.loss_agg_mode)

    def begin(self, model, stats: MinibatchStats) -> None:
        return None

    def before(self, model) -> None:
        pass

    def share(self, model, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        sub = part.batch
        vpreds = response_values(model, sub, packed=self.config.use_remove_padding)
        return value_share(
            vpreds,
            sub.values,
            sub.returns,
            sub.response_mask,
            self.loss,
            stats,
            index=group_ids(sub, self.loss.loss_agg_mode),
        )

    def after(self, model, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        pass

    def metric_names(self) -> list[str]:
        return list(VALUE_METRICS)
