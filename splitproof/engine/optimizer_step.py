"""One optimizer step over one minibatch, for any objective: the loop the actor and the critic share.

Statistics over the whole minibatch (all ranks) → the objective's preparation → forward/backward of each
microbatch's share of J(ℬ) (float64 RMSNorm gradients: ``norm_gradients``) → the objective's closing pass → one
gradient reduction over ranks (a sum) → metrics summed over ranks → clip by total norm → step, or skip on a
non-finite norm. A failed step leaves weights and optimizer state as they were.

What differs between the policy and the value model is an :class:`Objective`: which forward a
microbatch runs (log-probs or values) and how a part's share of J and of each metric follows from it and
the minibatch statistics. Splitting and DP only change how the sum J(ℬ) is computed, never its value.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch
from ..collective import default_collective
from ..loss_config import GROUP_AGG
from ..policy_objective import merge_metric_shares
from ..stats import MinibatchStats
from .distributed import gradient_sync, needs_lockstep, reduce_gradients_as_sum
from .norm_gradients import float64_norm_gradients
from .plan import MinibatchPlan


@dataclass
class StepResult:
    """One optimizer step: its metrics (global over ℬ) and whether the weights moved."""

    metrics: dict[str, float]
    skipped: bool
    cov_strategy: str | None = None


@dataclass(frozen=True)
class Part:
    """A microbatch to run: its rows of the rollout batch, its sub-batch, and whether it is live (a
    stand-in row run masked-out to keep ranks in lockstep is not)."""

    rows: list[int]
    batch: RolloutBatch
    live: bool


class Objective(Protocol):
    """What one optimizer step computes; the step itself (:func:`optimizer_step`) is shared.

    ``begin`` runs before the gradients are zeroed (a choice that may raise, e.g. a strategy), ``before``
    and ``after`` around the microbatch loop (a no-grad prepass, a correction pass that backpropagates
    itself). ``syncs_in_loop`` says whether the loop's last backward reduces gradients over ranks (else
    ``after``'s last backward does). ``share`` runs one microbatch's forward and returns its share of J
    (differentiable) and of each metric (detached); ``metric_names`` lists every metric any rank may report.
    The engine's are ``update.PolicyObjective`` and ``critic_update.ValueObjective``; ``update_policy`` and
    ``update_critic`` take another through ``make_objective`` (the diagnosis wraps or replaces them).
    """

    grad_norm_metric: str
    skipped_metric: str
    group_index: Tensor | None  # the batch's group ids when the aggregation needs them (group-mean-token-mean)

    def begin(self, model: nn.Module, stats: MinibatchStats) -> str | None: ...

    @property
    def syncs_in_loop(self) -> bool: ...

    def before(self, model: nn.Module) -> None: ...

    def share(self, model: nn.Module, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]: ...

    def after(self, model: nn.Module, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None: ...

    def metric_names(self) -> list[str]: ...


def prepare_update(
    model: nn.Module, batch: RolloutBatch, config, collective, validate
) -> tuple[object, RolloutBatch, list[MinibatchPlan]]:
    """Before an update's first step: the collective (by default the model device's), the batch checked by
    ``validate(model, batch, config, collective)`` and moved to the model's device, and this rank's plans."""
    collective = collective or default_collective(device_of(model))
    if collective.world_size > 1 and not needs_lockstep(model):
        raise ValueError("model: with several ranks, wrap the model with DDP or FSDP2 (splitproof.engine.wrap_model)")
    batch, plans = validate(model, batch, config, collective)
    return collective, batch.to(device_of(model)), plans


def optimizer_steps(model, optimizer, batch: RolloutBatch, plans, make_objective, config, collective, first_step: int):
    """One :func:`optimizer_step` per plan, in order; step i's objective is
    ``make_objective(config, batch, plan, collective, first_step + i)``."""
    results = []
    for step, plan in enumerate(plans, start=first_step):
        objective = make_objective(config, batch, plan, collective, step)
        results.append(
            optimizer_step(
                model, optimizer, batch, plan, objective, grad_clip=config.grad_clip, collective=collective, step=step
            )
        )
    return results


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    plan: MinibatchPlan,
    objective: Objective,
    *,
    grad_clip: float,
    collective,
    step: int = 0,
) -> StepResult:
    """One optimizer step of ``objective`` over the minibatch ``plan.rows``; ``batch`` is validated."""
    reduce_gradients_as_sum(model)
    stats = minibatch_stats(batch, plan, objective.group_index, collective)
    strategy = objective.begin(model, stats)
    optimizer.zero_grad(set_to_none=True)
    metric_sums: dict[str, Tensor] = {}
    try:
        with float64_norm_gradients(model):  # no float32 rounding in a float64 model's backward
            objective.before(model)
            last = len(plan.microbatches) - 1
            for i, rows in enumerate(plan.microbatches):
                part = part_of(batch, rows, plan, model)
                if part is None:
                    continue
                with gradient_sync(model, enabled=(i == last and objective.syncs_in_loop)):
                    share, shares = objective.share(model, part, stats)
                    share.backward()  # the wrapper sums the ranks' gradients
                merge_metric_shares(metric_sums, shares)
            objective.after(model, stats, metric_sums)
        metrics = reduce_metrics(metric_sums, objective.metric_names(), collective)
        grad_norm = clip_gradients(model, grad_clip)
    except BaseException:
        optimizer.zero_grad(set_to_none=True)  # a failed step leaves weights and optimizer state as they were
        raise
    metrics[objective.grad_norm_metric] = grad_norm
    skipped = not math.isfinite(grad_norm)
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        warnings.warn(
            f"non-finite gradient norm ({grad_norm}) at step {step}: step skipped, weights untouched", stacklevel=3
        )
    else:
        optimizer.step()
    metrics[objective.skipped_metric] = float(skipped)
    return StepResult(metrics, skipped, strategy)


def part_of(batch: RolloutBatch, rows: list[int], plan: MinibatchPlan, model) -> Part | None:
    """The microbatch to run. A microbatch with no response token to compute is skipped — or, where ranks
    must stay in lockstep, replaced by a masked-out stand-in row."""
    if rows:
        part = batch.select(rows)
        if part.attention_mask[:, part.prompt_width :].any():
            return Part(rows, part, True)
    if not needs_lockstep(model):
        return None
    stand_in = batch.select([plan.stand_in])
    return Part(rows, replace(stand_in, response_mask=torch.zeros_like(stand_in.response_mask)), False)


def group_ids(batch: RolloutBatch, agg_mode: str) -> Tensor | None:
    """The batch's group id per row where the aggregation needs them (group-mean-token-mean), else None."""
    return batch.index if agg_mode == GROUP_AGG else None


def minibatch_stats(batch: RolloutBatch, plan: MinibatchPlan, index: Tensor | None, collective) -> MinibatchStats:
    """N, G (and n_g per group when ``index`` gives group ids) of the minibatch: this rank's shard summed
    over ranks. Every rank holds the whole batch, so all agree on the minibatch's group ids without asking."""
    keys = sorted(set(index[plan.rows].tolist())) if index is not None else []
    shard = MinibatchStats.of(
        batch.response_mask[plan.shard], batch.response_width, None if index is None else index[plan.shard]
    )
    return MinibatchStats.from_tensor(collective.sum(shard.as_tensor(keys)), batch.response_width, keys)


def reduce_metrics(sums: dict[str, Tensor], names: list[str], collective) -> dict[str, float]:
    """Sum each metric's shares over ranks; every rank sends the same names (0 for a share it lacks)."""
    zero = torch.zeros((), dtype=torch.float64, device="cpu")  # the metric sums travel on the host
    packed = collective.sum(torch.stack([sums[n].detach().double().cpu() if n in sums else zero for n in names]))
    return {n: float(v) for n, v in zip(names, packed.tolist())}


def clip_gradients(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device if not hasattr(p, "to_local") else p.to_local().device
    return torch.device("cpu")
