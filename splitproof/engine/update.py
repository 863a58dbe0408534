"""The update engine: one RL policy update of a causal LM from a rollout batch (docs/architecture.md).

Per optimizer minibatch: statistics over the whole minibatch (all ranks) → for KL-Cov/Clip-Cov the
minibatch-wide selection → forward/backward of each microbatch's share of J(ℬ) → one gradient reduction
over ranks → clip by total norm → step (or skip on a non-finite norm). Splitting and DP only change how
the sum J(ℬ) is computed, never its value.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from ..batch import RolloutBatch
from ..collective import LOCAL, default_collective
from ..config import GROUP_AGG, LossConfig
from ..objective import correction_share, merge_metric_shares, metric_names, minibatch_share, policy_inputs
from ..selection import quota, select_tokens, shard_cov_sums
from ..stats import MinibatchStats
from .config import UpdateConfig
from .distributed import gradient_sync, needs_lockstep, reduce_gradients_as_sum
from .logprobs import response_log_probs
from .plan import MinibatchPlan, split_rows
from .validation import active_dropout, check_cov_strategy, validate_update

# A correction over fewer than this share of the sequences costs less than a no-grad forward over all
# of them (a forward is about a third of a forward+backward).
DEFERRED_MAX_TOUCHED_SHARE = 1 / 3


@dataclass
class StepResult:
    """One optimizer step: its metrics (global over ℬ) and whether the weights moved."""

    metrics: dict[str, float]
    skipped: bool
    cov_strategy: str | None = None


def update_policy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: RolloutBatch,
    config: UpdateConfig,
    *,
    collective=None,
    step: int = 0,
    on_gradients: Callable[[nn.Module], None] | None = None,
    on_selection: Callable[[Tensor, Tensor], None] | None = None,
) -> list[StepResult]:
    """Run every optimizer step of one update over ``batch`` (the same rollout batch on every rank).

    ``step`` numbers the first optimizer step (Clip-Cov's hash input); ``on_gradients`` sees the model
    after accumulation, before clipping (the diagnosis reads the accumulated gradient there);
    ``on_selection(mask, seq_ids)`` sees every KL-Cov/Clip-Cov selection this rank makes.
    """
    collective = collective or default_collective(_device_of(model))
    if collective.world_size > 1 and not needs_lockstep(model):
        raise ValueError("model: with several ranks, wrap the model with DDP or FSDP2 (splitproof.engine.wrap_model)")
    batch, plans = validate_update(model, batch, config, collective)
    batch = batch.to(_device_of(model))
    if config.loss.is_cov and config.cov_strategy == "microbatch" and config.statistics_scope == "minibatch":
        warnings.warn("cov_strategy 'microbatch' selects tokens per microbatch: the update then depends on "
                      "the split (kept for the diagnosis's comparison only)", stacklevel=2)
    return [train_minibatch(model, optimizer, batch, plan, config, collective=collective, step=step + i,
                            on_gradients=on_gradients, on_selection=on_selection) for i, plan in enumerate(plans)]


def train_minibatch(model, optimizer, batch: RolloutBatch, plan: MinibatchPlan, config: UpdateConfig, *,
                    collective=LOCAL, step: int = 0, on_gradients=None, on_selection=None) -> StepResult:
    """One optimizer step over the minibatch ``plan.rows``; ``batch`` is validated."""
    loss_config = config.loss
    reduce_gradients_as_sum(model)
    stats = _minibatch_stats(batch, plan, config.loss, collective)
    strategy = _cov_strategy(model, config, stats) if loss_config.is_cov else None
    with_entropy = loss_config.entropy_coeff != 0
    optimizer.zero_grad(set_to_none=True)
    metric_sums: dict[str, Tensor] = {}
    try:
        selection = _prepass_selection(model, batch, plan, config, collective, step) if strategy == "prepass" else None
        if selection is not None and on_selection is not None:
            on_selection(selection, batch.seq_ids)
        kept = _log_prob_buffer(batch) if strategy == "deferred" else None
        last = len(plan.microbatches) - 1
        for i, rows in enumerate(plan.microbatches):
            part, live = _part(batch, rows, plan, model)
            if part is None:
                continue
            with gradient_sync(model, enabled=(i == last and strategy != "deferred")):
                log_prob, entropy = _log_probs(model, part, config, with_entropy)
                part_selection = _slice(selection, rows, part, live)
                if strategy == "microbatch" or (loss_config.is_cov and config.statistics_scope == "microbatch"):
                    part_selection = _local_selection(part, log_prob, loss_config, step)
                    if on_selection is not None:
                        on_selection(part_selection, part.seq_ids)
                part_stats = stats if config.statistics_scope == "minibatch" else MinibatchStats.of(
                    part.response_mask, index=part.index)
                share, shares = _share(part, log_prob, entropy, loss_config, part_stats, part_selection)
                share.backward()  # the wrapper sums the ranks' gradients
            merge_metric_shares(metric_sums, shares)
            if kept is not None and live:
                kept[rows] = log_prob.detach().to(kept.dtype)
        if strategy == "deferred":
            _deferred_correction(model, batch, plan, config, collective, stats, kept, step, metric_sums, on_selection)
        metrics = _reduce_metrics(metric_sums, metric_names(loss_config, with_entropy), collective)
        if on_gradients is not None:
            on_gradients(model)
        grad_norm = _clip(model, config.grad_clip)
    except BaseException:
        optimizer.zero_grad(set_to_none=True)  # a failed step leaves weights and optimizer state as they were
        raise
    metrics["grad_norm"] = grad_norm
    skipped = not torch.isfinite(torch.tensor(grad_norm))
    if skipped:
        optimizer.zero_grad(set_to_none=True)
        warnings.warn(f"non-finite gradient norm ({grad_norm}) at step {step}: step skipped, weights untouched", stacklevel=2)
    else:
        optimizer.step()
    metrics["step_skipped"] = float(skipped)
    return StepResult(metrics, skipped, strategy)


def _part(batch: RolloutBatch, rows: list[int], plan: MinibatchPlan, model) -> tuple[RolloutBatch | None, bool]:
    """The microbatch to run, and whether it is live. A microbatch with no response token to compute is
    skipped — or, where ranks must stay in lockstep, replaced by a masked-out stand-in row."""
    if rows:
        part = batch.select(rows)
        if part.attention_mask[:, part.prompt_width:].any():
            return part, True
    if not needs_lockstep(model):
        return None, False
    stand_in = batch.select([plan.stand_in])
    return replace(stand_in, response_mask=torch.zeros_like(stand_in.response_mask)), False


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


def _minibatch_stats(batch: RolloutBatch, plan: MinibatchPlan, config: LossConfig, collective) -> MinibatchStats:
    """N, G (and n_g per group for group-mean-token-mean) of the minibatch: this rank's shard summed over
    ranks. Every rank holds the whole batch, so all agree on the minibatch's group ids without asking."""
    index = _group_ids(batch, config)
    keys = sorted(set(index[plan.rows].tolist())) if index is not None else []
    shard = MinibatchStats.of(batch.response_mask[plan.shard], batch.response_width,
                              None if index is None else index[plan.shard])
    return MinibatchStats.from_tensor(collective.sum(shard.as_tensor(keys)), batch.response_width, keys)


def _reduce_metrics(sums: dict[str, Tensor], names: list[str], collective) -> dict[str, float]:
    """Sum each metric's shares over ranks; every rank sends the same names (0 for a share it lacks)."""
    zero = torch.zeros((), dtype=torch.float64)
    packed = collective.sum(torch.stack([sums[n].detach().double().cpu() if n in sums else zero for n in names]))
    return {n: float(v) for n, v in zip(names, packed.tolist())}


def _clip(model: nn.Module, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


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
    for rows in plan.microbatches:
        part, live = _part(batch, rows, plan, model)
        if part is None:
            continue
        log_prob, _ = _log_probs(model, part, config)
        if live:
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
        part, live = _part(batch, rows, plan, model)
        if part is None:
            continue
        with gradient_sync(model, enabled=(i == count - 1)):
            log_prob, _ = _log_probs(model, part, config)
            share, shares = correction_share(log_prob, part.old_log_probs, part.advantages, part.response_mask,
                                             config.loss, stats, _slice(selection, rows, part, live),
                                             rollout_is_weights=part.rollout_is_weights,
                                             index=_group_ids(part, config.loss))
            share.backward()
        merge_metric_shares(metric_sums, shares)


def _log_prob_buffer(batch: RolloutBatch) -> Tensor:
    """[B, T] store for detached current log-probs, at least float32 (bf16 models return float32)."""
    dtype = torch.promote_types(batch.old_log_probs.dtype, torch.float32)
    return torch.zeros(batch.old_log_probs.shape, dtype=dtype, device=batch.old_log_probs.device)


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device if not hasattr(p, "to_local") else p.to_local().device
    return torch.device("cpu")
