"""The whole update planned before anything runs: minibatches, this rank's shard, its microbatches.

Every rank holds the rollout batch and computes the same plan for all ranks, so the microbatch count
is agreed without communication and bad input (a sequence over the token budget) fails on every rank
before any forward, gradient or weight is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..batch import RolloutBatch
from .microbatch import budget_microbatches, fixed_microbatches, minibatch_schedule, pad_microbatches, shard_rows
from .update_config import SplitSettings


@dataclass(frozen=True)
class MinibatchPlan:
    rows: list[int]  # the minibatch, rows of the rollout batch
    shard: list[int]  # this rank's rows
    microbatches: list[list[int]]  # this rank's; padded with [] to the same count on every rank
    stand_in: int  # a row run masked-out where a rank has nothing to compute (see stand_in_row)


def split_rows(rows: list[int], batch: RolloutBatch, config: SplitSettings) -> list[list[int]]:
    """Cut rows into microbatches: a token budget, a fixed size, or one microbatch."""
    if not rows:
        return []
    if config.use_dynamic_bsz:
        return budget_microbatches(
            rows,
            batch.token_spans()[rows].tolist(),
            config.ppo_max_token_len_per_gpu,
            seq_ids=batch.seq_ids[rows].tolist(),
            prompt_lengths=batch.prompt_spans()[rows].tolist(),
            packed=config.use_remove_padding,
        )
    if config.ppo_micro_batch_size_per_gpu is not None:
        return fixed_microbatches(rows, config.ppo_micro_batch_size_per_gpu)
    return [list(rows)]


def stand_in_row(batch: RolloutBatch, rows: list[int]) -> int:
    """The row with the longest response: run masked-out where a rank has nothing to compute, so that the
    model still runs (DDP/FSDP2 need every rank in every forward/backward)."""
    lengths = batch.attention_mask[rows, batch.prompt_width :].sum(dim=1)
    return rows[int(lengths.argmax())]


def plan_update(batch: RolloutBatch, config: SplitSettings, world_size: int, rank: int) -> list[MinibatchPlan]:
    """Every optimizer step of the update, from this rank's point of view."""
    lengths = batch.token_spans().tolist()
    plans = []
    for rows in minibatch_schedule(
        len(batch),
        config.minibatch_sequences,
        epochs=config.ppo_epochs,
        shuffle=config.shuffle,
        seed=config.data_loader_seed,
    ):
        shards = shard_rows(rows, [lengths[r] for r in rows], world_size)
        per_rank = [split_rows(shard, batch, config) for shard in shards]
        count = max(len(m) for m in per_rank)
        plans.append(
            MinibatchPlan(
                rows, shards[rank], pad_microbatches(per_rank[rank], count), stand_in=stand_in_row(batch, rows)
            )
        )
    return plans
