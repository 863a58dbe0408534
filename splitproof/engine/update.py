"""The update engine: one RL policy update of a causal LM from a rollout batch (docs/architecture.md).

Per optimizer minibatch, through the shared step (:mod:`splitproof.engine.optimizer_step`): statistics over the
whole minibatch (all ranks) → for KL-Cov/Clip-Cov the minibatch-wide selection
(:mod:`splitproof.engine.cov_strategy`) → forward/backward of each microbatch's share of J(ℬ)
(``policy_objective.minibatch_share``) → one gradient reduction over ranks → clip by total norm → step (or skip
on a non-finite norm). Splitting and DP only change how the sum J(ℬ) is computed, never its value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch
from ..policy_objective import metric_names, minibatch_share
from ..stats import MinibatchStats
from .cov_strategy import CovSelection
from .logprobs import response_log_probs
from .optimizer_step import Objective, Part, StepResult, group_ids, optimizer_steps, prepare_update
from .plan import MinibatchPlan
from .update_config import UpdateConfig
from .validation import validate_update

# builds one optimizer step's objective: (config, validated batch, the step's plan, collective, step number)
MakeObjective = Callable[[UpdateConfig, RolloutBatch, MinibatchPlan, object, int], Objective]


def update_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    config: UpdateConfig,
    *,
    collective=None,
    first_optimizer_step: int = 0,
    make_objective: MakeObjective | None = None,
) -> list[StepResult]:
    """Run every optimizer step of one update over ``batch`` (the same rollout batch on every rank).

    ``first_optimizer_step`` numbers the first optimizer step (Clip-Cov's hash input). Each step's J(ℬ) is
    ``make_objective(config, batch, plan, collective, step)``, by default :class:`PolicyObjective`
    (the diagnosis passes its own, e.g. other frameworks' per-microbatch statistics).
    """
    collective, batch, plans = prepare_update(model, batch, config, collective, validate_update)
    make_objective = make_objective or PolicyObjective
    return optimizer_steps(model, optimizer, batch, plans, make_objective, config, collective, first_optimizer_step)


def policy_log_probs(
    model: nn.Module, part: RolloutBatch, config: UpdateConfig, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """The part's response log-probs (and entropy) at the config's temperature, packing and prefix grouping."""
    return response_log_probs(
        model,
        part,
        temperature=config.temperature,
        with_entropy=with_entropy,
        packed=config.use_remove_padding,
        prefix_grouper=config.use_prefix_grouper,
    )


class PolicyObjective:
    """The policy's J(ℬ) for one optimizer step: log-probs (and entropy) per microbatch and
    ``minibatch_share``; for KL-Cov/Clip-Cov the minibatch-wide selection (:class:`CovSelection`)."""

    grad_norm_metric = "grad_norm"
    skipped_metric = "step_skipped"

    def __init__(self, config: UpdateConfig, batch: RolloutBatch, plan: MinibatchPlan, collective, step: int):
        self.config, self.loss = config, config.loss
        self.with_entropy = config.loss.entropy_coeff != 0
        self.group_index = group_ids(batch, config.loss.loss_agg_mode)
        self.cov = CovSelection(config, batch, plan, collective, step) if config.loss.is_cov else None

    @property
    def selection(self) -> Tensor | None:
        """This rank's KL-Cov/Clip-Cov selection, once made ([B_rollout, T])."""
        return self.cov.selection if self.cov is not None else None

    def begin(self, model: nn.Module, stats: MinibatchStats) -> str | None:
        return self.cov.choose(model, stats) if self.cov is not None else None

    @property
    def syncs_in_loop(self) -> bool:
        return self.cov is None or self.cov.syncs_in_loop

    def before(self, model: nn.Module) -> None:
        if self.cov is not None:
            self.cov.before(model)

    def share(self, model: nn.Module, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        sub = part.batch
        log_prob, entropy = policy_log_probs(model, sub, self.config, self.with_entropy)
        selection = self.cov.part_selection(part, log_prob) if self.cov is not None else None
        return minibatch_share(
            log_prob,
            sub.old_log_probs,
            sub.advantages,
            sub.response_mask,
            self.loss,
            stats,
            ref_log_prob=sub.ref_log_probs,
            rollout_is_weights=sub.rollout_is_weights,
            entropy=entropy,
            selection=selection,
            index=group_ids(sub, self.loss.loss_agg_mode),
        )

    def after(self, model: nn.Module, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        if self.cov is not None:
            self.cov.after(model, stats, metric_sums)

    def metric_names(self) -> list[str]:
        return metric_names(self.loss, self.with_entropy)
