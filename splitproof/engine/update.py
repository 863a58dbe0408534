"""The update engine: one RL policy update of a causal LM from a rollout batch (docs/architecture.md).

Per optimizer minibatch, through the shared step (:mod:`splitproof.engine.optimizer_step`): statistics over the
whole minibatch (all ranks) → for KL-Cov/Clip-Cov the minibatch-wide selection → forward/backward of each
microbatch's share of J(ℬ) → one gradient reduction over ranks → clip by total norm → step (or skip on a
non-finite norm). Splitting and DP only change how the sum J(ℬ) is computed, never its value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch
from ..collective import LOCAL, default_collective
from ..loss_config import GROUP_AGG, LossConfig
from ..objective import correction_share, merge_metric_shares, metric_names, minibatch_share, policy_inputs
from ..selection import quota, select_tokens, shard_cov_sums
from ..stats import MinibatchStats
from .update_config import UpdateConfig
from .distributed import gradient_sync, needs_lockstep
from .logprobs import response_log_probs
from .row_invariant import row_invariant
from .plan import MinibatchPlan, split_rows
from .optimizer_step import Part, StepResult, device_of, optimizer_step, part_of
from .validation import active_dropout, check_cov_strategy, validate_update

# A correction over fewer than this share of the sequences costs less than a no-grad forward over all
# of them (a forward is about a third of a forward+backward).
DEFERRED_MAX_TOUCHED_SHARE = 1 / 3


def update_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    config: UpdateConfig,
    *,
    collective=None,
    optimizer_step: int = 0,
    on_gradients: Callable[[nn.Module], None] | None = None,
    on_selection: Callable[[Tensor, Tensor], None] | None = None,
) -> list[StepResult]:
    """Run every optimizer step of one update over ``batch`` (the same rollout batch on every rank).

    ``optimizer_step`` numbers the first optimizer step (Clip-Cov's hash input); ``on_gradients`` sees the model
    after accumulation, before clipping (the diagnosis reads the accumulated gradient there);
    ``on_selection(mask, seq_ids)`` sees every KL-Cov/Clip-Cov selection this rank makes.
    """
    collective = collective or default_collective(device_of(model))
    if collective.world_size > 1 and not needs_lockstep(model):
        raise ValueError("model: with several ranks, wrap the model with DDP or FSDP2 (splitproof.engine.wrap_model)")
    batch, plans = validate_update(model, batch, config, collective)
    batch = batch.to(device_of(model))
    if config.loss.is_cov and config.cov_strategy == "microbatch" and config.statistics_scope == "minibatch":
        warnings.warn("cov_strategy 'microbatch' selects tokens per microbatch: the update then depends on "
                      "the split (kept for the diagnosis's comparison only)", stacklevel=2)
    return [train_minibatch(model, optimizer, batch, plan, config, collective=collective, step=optimizer_step + i,
                            on_gradients=on_gradients, on_selection=on_selection) for i, plan in enumerate(plans)]


def train_minibatch(model, optimizer, batch: RolloutBatch, plan: MinibatchPlan, config: UpdateConfig, *,
                    collective=LOCAL, step: int = 0, on_gradients=None, on_selection=None) -> StepResult:
    """One optimizer step over the minibatch ``plan.rows``; ``batch`` is validated."""
    objective = PolicyObjective(config, batch, plan, collective, step, on_selection)
    return optimizer_step(model, optimizer, batch, plan, objective, grad_clip=config.grad_clip,
                          collective=collective, step=step, on_gradients=on_gradients)


class PolicyObjective:
    """The policy's J(ℬ) for :func:`~splitproof.engine.optimizer_step.optimizer_step`: log-probs (and entropy) per
    microbatch, ``minibatch_share``, and for KL-Cov/Clip-Cov the minibatch-wide selection (a `prepass`
    before the loop, or a `deferred` correction after it)."""

    grad_norm_metric = "grad_norm"
    skipped_metric = "step_skipped"

    def __init__(self, config: UpdateConfig, batch: RolloutBatch, plan: MinibatchPlan, collective, step: int,
                 on_selection=None):
        self.config, self.batch, self.plan, self.collective, self.step = config, batch, plan, collective, step
        self.on_selection = on_selection
        self.with_entropy = config.loss.entropy_coeff != 0
        self.strategy: str | None = None
        self.selection: Tensor | None = None
        self.kept: Tensor | None = None
        self.group_index = _group_ids(batch, config.loss)  # group ids when the statistics need them

    def begin(self, model, stats: MinibatchStats) -> str | None:
        self.strategy = _cov_strategy(model, self.config, stats) if self.config.loss.is_cov else None
        return self.strategy

    @property
    def syncs_in_loop(self) -> bool:
        return self.strategy != "deferred"

    def before(self, model) -> None:
        if self.strategy == "prepass":
            self.selection = _prepass_selection(model, self.batch, self.plan, self.config, self.collective, self.step)
            if self.on_selection is not None:
                self.on_selection(self.selection, self.batch.seq_ids)
        if self.strategy == "deferred":
            self.kept = _log_prob_buffer(self.batch)

    def share(self, model, part: Part, stats: MinibatchStats):
        config, loss_config = self.config, self.config.loss
        log_prob, entropy = _log_probs(model, part.batch, config, self.with_entropy)
        part_selection = _slice(self.selection, part.rows, part.batch, part.live)
        if self.strategy == "microbatch" or (loss_config.is_cov and config.statistics_scope == "microbatch"):
            part_selection = _local_selection(part.batch, log_prob, loss_config, self.step)
            if self.on_selection is not None:
                self.on_selection(part_selection, part.batch.seq_ids)
        part_stats = stats if config.statistics_scope == "minibatch" else MinibatchStats.of(
            part.batch.response_mask, index=_group_ids(part.batch, loss_config))
        if self.kept is not None and part.live:
            self.kept[part.rows] = log_prob.detach().to(self.kept.dtype)
        return _share(part.batch, log_prob, entropy, loss_config, part_stats, part_selection)

    def after(self, model, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        if self.strategy == "deferred":
            _deferred_correction(model, self.batch, self.plan, self.config, self.collective, stats, self.kept,
                                 self.step, metric_sums, self.on_selection)

    def metric_names(self) -> list[str]:
        return metric_names(self.config.loss, self.with_entropy)


def _log_probs(model, part: RolloutBatch, config: UpdateConfig, with_entropy: bool = False):
    return response_log_probs(model, part, temperature=config.temperature, with_entropy=with_entropy,
                              packed=config.use_remove_padding)


def _slice(selection: Tensor | None, rows: list[int], part: RolloutBatch, live: bool) -> Tensor | None:
    """A part's rows of a [B_rollout, T] selection (all False for a stand-in row)."""
    if selection is None:
        return None
    return selection[rows] if live else torch.zeros_like(part.response_mask)


def _share(part: RolloutBatch, log_prob, entropy, config: LossConfig, stats: MinibatchStats, selection):
    if stats.num_tokens == 0:  # legacy scope on an all-padding microbatch: nothing to add
        zero = (log_prob * 0).sum()
        return zero, {}
    return minibatch_share(log_prob, part.old_log_probs, part.advantages, part.response_mask, config, stats,
                           ref_log_prob=part.ref_log_probs, rollout_is_weights=part.rollout_is_weights,
                           entropy=entropy, selection=selection, index=_group_ids(part, config))


def _group_ids(part: RolloutBatch, config: LossConfig) -> Tensor | None:
    return part.index if config.loss_agg_mode == GROUP_AGG else None


def _cov_strategy(model: nn.Module, config: UpdateConfig, stats: MinibatchStats) -> str:
    """`auto`: deferred when its correction touches few sequences and the forward is deterministic."""
    chosen = config.cov_strategy
    if config.statistics_scope == "microbatch":
        return "microbatch"
    check_cov_strategy(model, config)
    if chosen != "auto":
        return chosen
    if active_dropout(model):
        return "prepass"
    ratio = config.loss.kl_cov_ratio if config.loss.loss_mode == "kl_cov" else config.loss.clip_cov_ratio
    touched = min(quota(stats.num_tokens, ratio), stats.num_sequences)
    return "deferred" if touched < DEFERRED_MAX_TOUCHED_SHARE * stats.num_sequences else "prepass"


def _local_selection(part: RolloutBatch, log_prob: Tensor, config: LossConfig, step: int) -> Tensor:
    """Per-microbatch selection (other frameworks' behaviour): the microbatch's own means and quota."""
    if not part.response_mask.any():
        return torch.zeros_like(part.response_mask)
    x = policy_inputs(log_prob.detach(), part.old_log_probs, part.advantages, part.response_mask)
    return select_tokens(x, config, part.seq_ids, step=step, collective=LOCAL)


def _select_shard(batch, plan, log_probs: Tensor, config: LossConfig, collective, step: int) -> Tensor:
    """The minibatch-wide selection from this rank's shard log-probs, as a [B_rollout, T] mask."""
    shard = plan.shard
    selection = torch.zeros_like(batch.response_mask)
    x = policy_inputs(log_probs[shard], batch.old_log_probs[shard], batch.advantages[shard],
                      batch.response_mask[shard])
    sums = shard_cov_sums(batch.advantages[plan.rows], batch.response_mask[plan.rows], x.log_prob, x.mask,
                          collective)
    selection[shard] = select_tokens(x, config, batch.seq_ids[shard], step=step, sums=sums, collective=collective)
    return selection


@torch.no_grad()
def _prepass_selection(model, batch, plan, config: UpdateConfig, collective, step) -> Tensor:
    """`prepass`: a no-grad forward over the same microbatches, then select."""
    log_probs = _log_prob_buffer(batch)
    with row_invariant(model):  # the selection sees the same log-probs in every layout
        for rows in plan.microbatches:
            part = part_of(batch, rows, plan, model)
            if part is None:
                continue
            log_prob, _ = _log_probs(model, part.batch, config)
            if part.live:
                log_probs[rows] = log_prob.to(log_probs.dtype)
    return _select_shard(batch, plan, log_probs, config.loss, collective, step)


def _deferred_correction(model, batch, plan, config: UpdateConfig, collective, stats, kept, step, metric_sums,
                         on_selection=None):
    """`deferred`: select from the kept log-probs, then forward/backward only the sequences it touches."""
    selection = _select_shard(batch, plan, kept, config.loss, collective, step)
    if on_selection is not None:
        on_selection(selection, batch.seq_ids)
    touched = [r for r in plan.shard if selection[r].any()]
    microbatches = split_rows(touched, batch, config)
    count = collective.max_int(len(microbatches))
    if needs_lockstep(model):
        count = max(count, 1)  # the step's gradient reduction happens in the last backward
    microbatches += [[] for _ in range(count - len(microbatches))]
    for i, rows in enumerate(microbatches):
        part = part_of(batch, rows, plan, model)
        if part is None:
            continue
        sub = part.batch
        with gradient_sync(model, enabled=(i == count - 1)):
            log_prob, _ = _log_probs(model, sub, config)
            share, shares = correction_share(log_prob, sub.old_log_probs, sub.advantages, sub.response_mask,
                                             config.loss, stats, _slice(selection, rows, sub, part.live),
                                             rollout_is_weights=sub.rollout_is_weights,
                                             index=_group_ids(sub, config.loss))
            share.backward()
        merge_metric_shares(metric_sums, shares)


def _log_prob_buffer(batch: RolloutBatch) -> Tensor:
    """[B, T] store for detached current log-probs, at least float32 (bf16 models return float32)."""
    dtype = torch.promote_types(batch.old_log_probs.dtype, torch.float32)
    return torch.zeros(batch.old_log_probs.shape, dtype=dtype, device=batch.old_log_probs.device)
