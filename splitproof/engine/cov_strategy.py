"""KL-Cov / Clip-Cov in the update: how one optimizer step obtains the minibatch-wide token selection.

The selection is made over the whole minibatch (every microbatch, every rank) from the current log-probs,
so it never depends on the split. Two strategies give the same update:

- `prepass`: a no-grad forward over the same microbatches before the loop, then select; the loop's shares
  use the selection.
- `deferred`: the loop runs the base loss (no token selected) and keeps its detached log-probs; after the
  loop, select from them and forward/backward only the sequences the selection touches, adding the
  selection's correction (``policy_objective.correction_share``). It needs a deterministic forward.

`auto` takes `deferred` when its correction touches fewer than a third of the minibatch's sequences and
the forward is deterministic, else `prepass`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch
from ..loss_config import LossConfig
from ..policy_objective import correction_share, merge_metric_shares, policy_inputs
from ..selection import quota, select_tokens, shard_cov_sums
from ..stats import MinibatchStats
from .distributed import gradient_sync, needs_lockstep
from .logprobs import response_log_probs
from .optimizer_step import Part, group_ids, part_of
from .plan import MinibatchPlan, split_rows
from .row_invariant import row_invariant
from .update_config import UpdateConfig
from .validation import active_dropout, check_cov_strategy

# A correction over fewer than this fraction of the sequences costs less than a no-grad forward over all
# of them (a forward is about a third of a forward+backward).
DEFERRED_MAX_TOUCHED_FRACTION = 1 / 3


class CovSelection:
    """One optimizer step's KL-Cov/Clip-Cov selection, for the policy objective of that step.

    ``choose`` picks the strategy (before the gradients are zeroed), ``before`` runs the `prepass`,
    ``part_selection`` gives each microbatch its rows of the selection (and keeps `deferred`'s log-probs),
    ``after`` runs `deferred`'s correction. ``selection`` is the [B_rollout, T] mask of this rank's shard
    once made (after ``before`` for `prepass`, after ``after`` for `deferred`).
    """

    def __init__(self, config: UpdateConfig, batch: RolloutBatch, plan: MinibatchPlan, collective, step: int):
        self.config, self.batch, self.plan, self.collective, self.step = config, batch, plan, collective, step
        self.strategy: str | None = None
        self.selection: Tensor | None = None
        self.kept: Tensor | None = None  # `deferred`: the loop's detached log-probs

    def choose(self, model: nn.Module, stats: MinibatchStats) -> str:
        self.strategy = choose_strategy(model, self.config, stats)
        return self.strategy

    @property
    def syncs_in_loop(self) -> bool:
        return self.strategy != "deferred"

    def before(self, model: nn.Module) -> None:
        if self.strategy == "prepass":
            self.selection = prepass_selection(model, self.batch, self.plan, self.config, self.collective, self.step)
        elif self.strategy == "deferred":
            self.kept = log_prob_buffer(self.batch)

    def part_selection(self, part: Part, log_prob: Tensor) -> Tensor | None:
        """The part's rows of the selection (None in `deferred`'s loop: the base loss)."""
        if self.kept is not None and part.live:
            self.kept[part.rows] = log_prob.detach().to(self.kept.dtype)
        return rows_of(self.selection, part)

    def after(self, model: nn.Module, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        if self.strategy == "deferred":
            self.selection = select_shard(
                self.batch, self.plan, self.kept, self.config.loss, self.collective, self.step
            )
            deferred_correction(
                model, self.batch, self.plan, self.config, self.collective, stats, self.selection, metric_sums
            )


def choose_strategy(model: nn.Module, config: UpdateConfig, stats: MinibatchStats) -> str:
    """`auto`: deferred when its correction touches few sequences and the forward is deterministic."""
    check_cov_strategy(model, config)
    if config.cov_strategy != "auto":
        return config.cov_strategy
    if active_dropout(model):
        return "prepass"
    ratio = config.loss.kl_cov_ratio if config.loss.loss_mode == "kl_cov" else config.loss.clip_cov_ratio
    touched = min(quota(stats.num_tokens, ratio), stats.num_sequences)
    return "deferred" if touched < DEFERRED_MAX_TOUCHED_FRACTION * stats.num_sequences else "prepass"


def rows_of(selection: Tensor | None, part: Part) -> Tensor | None:
    """A part's rows of a [B_rollout, T] selection (all False for a stand-in row)."""
    if selection is None:
        return None
    return selection[part.rows] if part.live else torch.zeros_like(part.batch.response_mask)


def select_shard(
    batch: RolloutBatch, plan: MinibatchPlan, log_probs: Tensor, loss: LossConfig, collective, step: int
) -> Tensor:
    """The minibatch-wide selection from this rank's shard log-probs, as a [B_rollout, T] mask."""
    shard = plan.shard
    selection = torch.zeros_like(batch.response_mask)
    x = policy_inputs(log_probs[shard], batch.old_log_probs[shard], batch.advantages[shard], batch.response_mask[shard])
    sums = shard_cov_sums(batch.advantages[plan.rows], batch.response_mask[plan.rows], x.log_prob, x.mask, collective)
    selection[shard] = select_tokens(x, loss, batch.seq_ids[shard], step=step, sums=sums, collective=collective)
    return selection


def _log_probs(model: nn.Module, part: RolloutBatch, config: UpdateConfig, align_within: float = 0) -> Tensor:
    log_prob, _ = response_log_probs(
        model,
        part,
        temperature=config.temperature,
        packed=config.use_remove_padding,
        prefix_grouper=config.use_prefix_grouper,
        align_within=align_within,
    )
    return log_prob


@torch.no_grad()
def prepass_selection(
    model: nn.Module, batch: RolloutBatch, plan: MinibatchPlan, config: UpdateConfig, collective, step: int
) -> Tensor:
    """`prepass`: a no-grad forward over the same microbatches, then select."""
    log_probs = log_prob_buffer(batch)
    with row_invariant(model):  # the selection sees the same log-probs in every layout
        for rows in plan.microbatches:
            part = part_of(batch, rows, plan, model)
            if part is None:
                continue
            budget = config.ppo_max_token_len_per_gpu if config.use_dynamic_bsz else math.inf
            log_prob = _log_probs(model, part.batch, config, align_within=budget)
            if part.live:
                log_probs[rows] = log_prob.to(log_probs.dtype)
    return select_shard(batch, plan, log_probs, config.loss, collective, step)


def deferred_correction(
    model: nn.Module,
    batch: RolloutBatch,
    plan: MinibatchPlan,
    config: UpdateConfig,
    collective,
    stats: MinibatchStats,
    selection: Tensor,
    metric_sums: dict[str, Tensor],
) -> None:
    """`deferred`: forward/backward the selection's correction over only the sequences it touches."""
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
            log_prob = _log_probs(model, sub, config)
            share, shares = correction_share(
                log_prob,
                sub.old_log_probs,
                sub.advantages,
                sub.response_mask,
                config.loss,
                stats,
                rows_of(selection, part),
                rollout_is_weights=sub.rollout_is_weights,
                index=group_ids(sub, config.loss.loss_agg_mode),
            )
            share.backward()
        merge_metric_shares(metric_sums, shares)


def log_prob_buffer(batch: RolloutBatch) -> Tensor:
    """[B, T] store for detached current log-probs, at least float32 (bf16 models return float32)."""
    dtype = torch.promote_types(batch.old_log_probs.dtype, torch.float32)
    return torch.zeros(batch.old_log_probs.shape, dtype=dtype, device=batch.old_log_probs.device)
