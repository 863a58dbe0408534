"""Who computes what: minibatch schedule, DP shards and microbatches, as lists of row indices.

Pure bookkeeping, no model. The minibatches depend on (seed, epoch) only, never on the DP size; the
shards and microbatches are deterministic functions of the rows and their token lengths. In
``shard_rows`` and ``budget_microbatches``, ``lengths[k]`` (and ``seq_ids[k]``) belong to ``rows[k]``.
"""

from __future__ import annotations

import torch

from splitproof.batch import BatchError


def _epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed from (seed, epoch) alone: a fixed 64-bit mix, so nearby pairs do not collide."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(epoch) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) % 2**64
    x ^= x >> 31
    return x % 2**63


def minibatch_schedule(
    num_sequences: int, mini_batch_size: int, *, epochs: int = 1, shuffle: bool = False, seed: int = 42
) -> list[list[int]]:
    """Rows of every optimizer minibatch, in order: per epoch a permutation of range(num_sequences)
    (identity unless ``shuffle``) cut into consecutive chunks of ``mini_batch_size``."""
    if num_sequences < 1:
        raise BatchError("ppo_mini_batch_size", f"the rollout batch is empty ({num_sequences} sequences)")
    if not 1 <= mini_batch_size <= num_sequences:
        raise BatchError(
            "ppo_mini_batch_size", f"must be in [1, {num_sequences}] (the rollout batch size), got {mini_batch_size}"
        )
    if num_sequences % mini_batch_size:
        raise BatchError(
            "ppo_mini_batch_size",
            f"{num_sequences} sequences are not a multiple of "
            f"ppo_mini_batch_size {mini_batch_size}; every minibatch must be full",
        )
    if epochs < 1:
        raise BatchError("ppo_epochs", f"must be >= 1, got {epochs}")
    schedule = []
    for epoch in range(epochs):
        if shuffle:
            g = torch.Generator().manual_seed(_epoch_seed(seed, epoch))
            order = torch.randperm(num_sequences, generator=g).tolist()
        else:
            order = list(range(num_sequences))
        for start in range(0, num_sequences, mini_batch_size):
            schedule.append(order[start : start + mini_batch_size])
    return schedule


def _check_parallel(rows: list[int], lengths: list[int], seq_ids: list[int] | None = None) -> None:
    if len(lengths) != len(rows):
        raise ValueError(f"lengths has {len(lengths)} entries for {len(rows)} rows (lengths[k] belongs to rows[k])")
    if seq_ids is not None and len(seq_ids) != len(rows):
        raise ValueError(f"seq_ids has {len(seq_ids)} entries for {len(rows)} rows (seq_ids[k] belongs to rows[k])")


def _longest_first(rows: list[int], lengths: list[int]) -> list[int]:
    """Positions k into rows, ordered by (length desc, row)."""
    return sorted(range(len(rows)), key=lambda k: (-int(lengths[k]), rows[k]))


def shard_rows(rows: list[int], lengths: list[int], dp_size: int) -> list[list[int]]:
    """Split a minibatch over ``dp_size`` ranks: longest first, dealt in snake order (0..D-1, D-1..0, ...).

    Shard sizes differ by at most one and token loads stay close. Rows ascend inside each shard.
    """
    _check_parallel(rows, lengths)
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    shards = [[] for _ in range(dp_size)]
    for i, k in enumerate(_longest_first(rows, lengths)):
        lap, pos = divmod(i, dp_size)
        rank = pos if lap % 2 == 0 else dp_size - 1 - pos
        shards[rank].append(rows[k])
    return [sorted(s) for s in shards]


def fixed_microbatches(rows: list[int], size: int) -> list[list[int]]:
    """Consecutive chunks of ``size`` rows (the last one may be shorter)."""
    if size < 1:
        raise BatchError("ppo_micro_batch_size_per_gpu", f"must be >= 1, got {size}")
    return [list(rows[i : i + size]) for i in range(0, len(rows), size)]


def budget_microbatches(
    rows: list[int],
    lengths: list[int],
    budget: int,
    *,
    seq_ids: list[int] | None = None,
    prompt_lengths: list[int] | None = None,
    packed: bool = False,
) -> list[list[int]]:
    """Microbatches under a budget on the tokens a microbatch computes, padding included.

    Cost of a microbatch: rows × its padded width. The width is the longest sequence, or — given
    ``prompt_lengths`` (prompts left-padded, responses right-padded, as the engine lays them out) — the
    longest prompt plus the longest response. The engine passes spans (``RolloutBatch.token_spans`` and
    ``prompt_spans``: from a sequence's first to its last real token), which is what it computes. ``packed``: sequences
    share rows (first fit,
    ``splitproof.engine.packing``), and the cost is packed rows × row width. Rows sorted by
    (length desc, row) are cut greedily into contiguous runs, which keeps padding low. No sequence is
    split; one over the budget is an error. Rows ascend inside each microbatch.
    """
    _check_parallel(rows, lengths, seq_ids)
    if budget < 1:
        raise BatchError("ppo_max_token_len_per_gpu", f"must be >= 1, got {budget}")
    prompts = [0] * len(rows) if prompt_lengths is None else [int(p) for p in prompt_lengths]
    responses = [int(n) - p for n, p in zip(lengths, prompts)]
    order = _longest_first(rows, lengths)
    if order and int(lengths[order[0]]) > budget:
        k = order[0]
        sid = seq_ids[k] if seq_ids is not None else rows[k]
        raise BatchError(
            "ppo_max_token_len_per_gpu",
            f"sequence {sid} has {int(lengths[k])} tokens > budget "
            f"{budget}; raise the budget (a sequence is never split)",
            sequence=int(sid),
        )
    if packed:
        return _packed_budget(rows, [int(n) for n in lengths], budget, order)
    microbatches, current, prompt_width, response_width = [], [], 0, 0
    for k in order:
        wider = max(prompt_width, prompts[k]) + max(response_width, responses[k])
        if current and (len(current) + 1) * wider > budget:
            microbatches.append(sorted(current))
            current, prompt_width, response_width = [], 0, 0
        current.append(rows[k])
        prompt_width, response_width = max(prompt_width, prompts[k]), max(response_width, responses[k])
    if current:
        microbatches.append(sorted(current))
    return microbatches


def _packed_budget(rows: list[int], lengths: list[int], budget: int, order: list[int]) -> list[list[int]]:
    """Longest first; a microbatch grows while its packed cost (``engine.packing``) fits the budget."""
    from .packing import RowPacking

    microbatches, current, packing = [], [], None
    for k in order:
        if current and packing.cost_with(lengths[k]) > budget:
            microbatches.append(sorted(current))
            current = []
        if not current:
            packing = RowPacking(lengths[k])
        packing.add(lengths[k])
        current.append(rows[k])
    if current:
        microbatches.append(sorted(current))
    return microbatches


def pad_microbatches(microbatches: list[list[int]], count: int) -> list[list[int]]:
    """Append empty microbatches so that this rank runs exactly ``count`` (the max over ranks)."""
    if len(microbatches) > count:
        raise ValueError(f"cannot pad {len(microbatches)} microbatches down to {count}")
    return [list(mb) for mb in microbatches] + [[] for _ in range(count - len(microbatches))]
