"""Dynamic sampling (DAPO's ``algorithm.filter_groups``) whose kept set no generation knob can change.

The stream. A run with dynamic sampling consumes prompts one by one from a single stream: epoch 0's
order, then epoch 1's, and so on, each epoch the whole seeded permutation ``prompt_order(rows, seed,
epoch)``. Its state is a position (epoch, cursor), saved in checkpoints.

Step s. The candidates are the stream's prompts from its position on, c_1, c_2, ...; candidate c_i is
generated with n samples keyed (seed, s, uid, j) in the training sampling stream, or in stream 16 + k
for its k-th repeat, k the number of earlier occurrences of its uid among c_1..c_{i-1} (k = 0 unless the
step's candidates run into a later epoch that holds the prompt again). Its group is *eligible* when the filter metric
is not the same for all n samples (with n = 1,
always, as verl). The kept set is the first B = ``data.train_batch_size`` eligible candidates in stream
order; the step *consumes* c_1..c_m, c_m the B-th eligible one, and the stream moves past them.
Ineligible groups among them are dropped (for that pass over the data, as verl drops them).

Rounds. A round generates the next ``data.gen_batch_size`` candidates (all ranks share it); rounds
repeat until B candidates are eligible. Candidates after c_m that the last round generated are not
consumed: they stay at the head of the stream, in order, and step s+1 generates them again under its own
keys (the policy has changed). So ``gen_batch_size`` decides how many rounds a step takes and how many
generations are thrown away, never which prompts are kept, what they sample, or where the stream stands.

verl's recipe instead keeps the first B eligible groups of whole rounds and drops every prompt a round
generated, kept or not: which prompts train, and which are skipped, depend on ``gen_batch_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..rewards.scored import Rewards, ScoredSamples
from .prompts import prompt_order

# filter metrics that are the sequence's score (the reward manager's, before any KL in the reward)
SCORE_METRICS = ("reward", "seq_reward", "seq_final_reward")
# metrics that measure the generation rounds, which data.gen_batch_size sets (speed, not training)
ROUND_METRICS = ("train/num_gen_batches", "training/filter_groups/returned_prompts")


class FilterError(ValueError):
    """Dynamic sampling cannot fill a step (``max_num_gen_batches`` reached) or a metric is missing."""


class PromptStream:
    """Epoch after epoch of seeded prompt orders, consumed one prompt at a time (see the module docstring).

    Duck-types ``PromptSampler`` where a run needs it (``epoch``, ``state_dict``, ``load_state_dict``).
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True):
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 1:
            raise ValueError(f"PromptStream: num_rows must be an integer >= 1, got {num_rows!r}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, bool(shuffle)
        self.epoch, self.cursor = 0, 0
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {e: o for e, o in self._orders.items() if e >= self.epoch}  # keep the cache small
            self._orders[epoch] = prompt_order(self.num_rows, self.seed, epoch, self.shuffle)
        return self._orders[epoch]

    def peek(self, offset: int, count: int) -> list[int]:
        """The uids at stream positions offset..offset+count-1 counted from the current position."""
        uids = []
        for position in range(self.cursor + offset, self.cursor + offset + count):
            epoch, index = divmod(position, self.num_rows)
            uids.append(self._order(self.epoch + epoch)[index])
        return uids

    def advance(self, count: int) -> None:
        epochs, self.cursor = divmod(self.cursor + count, self.num_rows)
        self.epoch += epochs

    def state_dict(self) -> dict:
        return {
            "kind": "stream",
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the dataset size, seed and shuffle must be the same."""
        if state.get("kind") != "stream":
            raise ValueError(
                "PromptStream: the checkpoint holds a batch sampler's position, not a stream's "
                "(algorithm.filter_groups.enable differs from the saved run)"
            )
        for key in ("num_rows", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptStream: the saved {key}={state[key]!r} differs from this run's {getattr(self, key)!r}"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor < self.num_rows:
            raise ValueError(f"PromptStream: invalid saved position epoch={epoch} cursor={cursor}")
        self.epoch, self.cursor = epoch, cursor


def occurrences(uids: Sequence[int]) -> list[int]:
    """k of each candidate: how many times its uid occurs before it in ``uids``."""
    seen: dict[int, int] = {}
    out = []
    for uid in uids:
        out.append(seen.get(uid, 0))
        seen[uid] = out[-1] + 1
    return out


def is_eligible(values: Sequence[float]) -> bool:
    """A group is kept when its metric is not the same for every sample (a single sample: always).
    verl tests ``np.std(values) > 0``; the two differ only where the mean of equal floats rounds."""
    return len(values) == 1 or any(v != values[0] for v in values)


@dataclass
class Round:
    """One generation round's result for its candidates: per candidate, whatever the step keeps of it
    (``groups``) and its metric values (one per sample)."""

    groups: list
    metric_values: list[list[float]]


@dataclass
class Selection:
    """The step's kept groups in stream order, with the positions (0-based, from the step's start) of the
    candidates they came from; the uids the step consumed, how many candidates it generated, its rounds."""

    groups: list
    positions: list[int]
    consumed_uids: list[int]
    generated: int
    rounds: int

    @property
    def consumed(self) -> int:
        return len(self.consumed_uids)


def select_groups(
    stream: PromptStream,
    batch_size: int,
    gen_batch_size: int,
    max_rounds: int,
    generate_round: Callable[[list[int], list[int]], Round],
    metric: str,
) -> Selection:
    """Run rounds until ``batch_size`` candidates are eligible; ``generate_round(uids, occurrences)``
    generates and scores the candidates of one round. Advances ``stream`` past the consumed candidates.
    ``max_rounds`` <= 0: no bound (verl's rule); reaching it is a ``FilterError``."""
    kept, positions, generated, rounds = [], [], 0, 0
    counts: list[int] = []
    while len(kept) < batch_size:
        if max_rounds > 0 and rounds >= max_rounds:
            raise FilterError(
                f"algorithm.filter_groups.max_num_gen_batches={max_rounds} generation rounds of "
                f"data.gen_batch_size={gen_batch_size} prompts kept {len(kept)} of the {batch_size} groups a step "
                f"needs (groups whose {metric!r} differs between samples); raise max_num_gen_batches (0: no "
                "bound) or use easier data"
            )
        uids = stream.peek(generated, gen_batch_size)
        counts = occurrences(stream.peek(0, generated + gen_batch_size))
        result = generate_round(uids, counts[generated:])
        rounds += 1
        for i, (group, values) in enumerate(zip(result.groups, result.metric_values)):
            if any(isinstance(v, float) and math.isnan(v) for v in values):
                raise FilterError(
                    f"algorithm.filter_groups.metric={metric!r}: the reward function gave no "
                    f"value for a sample of prompt uid {uids[i]}"
                )
            if len(kept) < batch_size and is_eligible(values):
                kept.append(group)
                positions.append(generated + i)
        generated += len(uids)
    consumed = stream.peek(0, positions[-1] + 1)
    stream.advance(len(consumed))
    return Selection(groups=kept, positions=positions, consumed_uids=consumed, generated=generated, rounds=rounds)


def filtered_batch(
    stream: PromptStream,
    *,
    batch_size: int,
    gen_batch_size: int,
    max_rounds: int,
    metric: str,
    n: int,
    rows: int,
    generate_scored: Callable,
) -> ScoredSamples:
    """Generation rounds of ``gen_batch_size`` prompts until ``batch_size`` groups are eligible: the kept
    groups flattened in stream order (their uids, each sample's group id, the consumed uids, and the
    step's ``train/`` and ``training/filter_groups/`` metrics).

    ``generate_scored(uids, repeats)`` -> (samples, rewards [len(uids) · n]): one round's ``n`` scored
    samples of each candidate, in candidate order. ``metric``: a score metric or an extra key."""

    def generate_round(uids: list[int], repeats: list[int]) -> Round:
        samples, rewards = generate_scored(uids, repeats)
        values = rewards.scores.tolist() if metric in SCORE_METRICS else rewards.extra.get(metric)
        if values is None:
            raise FilterError(
                f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such "
                f"value (it returned: {', '.join(sorted(rewards.extra)) or 'a number only'})"
            )
        groups = []
        for g, (uid, k) in enumerate(zip(uids, repeats)):
            part = slice(g * n, (g + 1) * n)
            groups.append((samples[part], rewards.rows(part), uid + k * rows))
        return Round(groups, [values[g * n : (g + 1) * n] for g in range(len(uids))])

    selection = select_groups(stream, batch_size, gen_batch_size, max_rounds, generate_round, metric)
    groups = selection.groups
    return ScoredSamples(
        samples=[s for group in groups for s in group[0]],
        rewards=Rewards.concat([group[1] for group in groups]),
        uids=[group[0][0].uid for group in groups],
        group_ids=[group[2] for group in groups for _ in range(n)],
        consumed=selection.consumed_uids,
        metrics={
            "train/num_gen_batches": float(selection.rounds),
            "training/filter_groups/evicted_samples": float((selection.consumed - len(groups)) * n),
            "training/filter_groups/consumed_prompts": float(selection.consumed),
            "training/filter_groups/returned_prompts": float(selection.generated - selection.consumed),
        },
    )
