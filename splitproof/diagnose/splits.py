"""Split specs: how one optimizer minibatch is cut into microbatches, ranks and an order.

Grammar (parts joined by ``+``, each kind at most once, at most one microbatch kind)::

    even:K         K microbatches per rank, sizes as equal as possible (differ by at most one)
    sizes:a,b,c    microbatches of a, b, c sequences per rank (must sum to the rank's sequences)
    tokens:B       a token budget: rows x (longest prompt + longest response) <= B per microbatch
    packed:B       a token budget on packed microbatches (use_remove_padding): packed rows x width <= B
    shuffle:S      permute the rows of the minibatch with seed S before anything else
    dp:D           D data-parallel ranks (real torch.distributed processes, gloo on CPU)

Without a microbatch kind each rank runs its whole shard as one microbatch. ``plan_split`` turns a spec
into per-rank microbatches with the engine's own planners (``shard_rows``, ``budget_microbatches``) and
refuses, with a one-line :class:`SplitError`, what the minibatch cannot honour.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitproof.batch import BatchError, RolloutBatch
from splitproof.engine.microbatch import budget_microbatches, pad_microbatches, shard_rows
from splitproof.engine.plan import MinibatchPlan, stand_in_row

MICRO_KINDS = ("even", "sizes", "tokens", "packed")
KINDS = MICRO_KINDS + ("shuffle", "dp")
BASELINE = "one microbatch, one rank"


class SplitError(ValueError):
    """A malformed split spec, or one the scenario cannot honour. The message is one line."""


@dataclass(frozen=True)
class Split:
    """A parsed split spec. ``micro`` is None (one microbatch per rank) or (kind, value)."""

    spec: str
    micro: tuple[str, object] | None = None
    shuffle: int | None = None
    ranks: int = 1


def _int(text: str, what: str, spec: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise SplitError(f"split {spec!r}: {what} must be an integer, got {text!r}") from None
    if value < minimum:
        raise SplitError(f"split {spec!r}: {what} must be >= {minimum}, got {value}")
    return value


def parse_split(text: str) -> Split:
    """Parse ``even:K | sizes:a,b,.. | tokens:B | shuffle:S | dp:D`` joined by ``+``."""
    spec = text.strip()
    if not spec:
        raise SplitError("split '': empty spec; expected e.g. even:4, sizes:3,5, tokens:512, shuffle:1, dp:2")
    micro, shuffle, ranks, seen = None, None, 1, set()
    canonical = []
    for part in spec.split("+"):
        kind, sep, value = part.strip().partition(":")
        kind = kind.strip().lower()
        value = value.strip()
        if kind not in KINDS:
            raise SplitError(f"split {spec!r}: unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
        if not sep or not value:
            raise SplitError(f"split {spec!r}: {kind} needs a value, e.g. {kind}:{'3,5' if kind == 'sizes' else 2}")
        if kind in seen:
            raise SplitError(f"split {spec!r}: {kind} given twice")
        seen.add(kind)
        if kind in MICRO_KINDS:
            if micro is not None:
                raise SplitError(f"split {spec!r}: combine at most one of {', '.join(MICRO_KINDS)}")
            if kind == "sizes":
                sizes = tuple(_int(v.strip(), "each size", spec, 1) for v in value.split(","))
                micro = ("sizes", sizes)
                value = ",".join(map(str, sizes))
            elif kind == "even":
                micro = ("even", _int(value, "K", spec, 1))
                value = str(micro[1])
            else:
                micro = (kind, _int(value, "the token budget", spec, 1))
                value = str(micro[1])
        elif kind == "shuffle":
            shuffle = _int(value, "the seed", spec, 0)
            value = str(shuffle)
        else:
            ranks = _int(value, "D", spec, 1)
            value = str(ranks)
        canonical.append(f"{kind}:{value}")
    return Split("+".join(canonical), micro, shuffle, ranks)


@dataclass(frozen=True)
class SplitPlan:
    """A split made concrete for one batch: a row permutation and each rank's microbatches."""

    split: Split
    order: list[int] | None  # rows of the original batch, in the order the split sees them
    per_rank: list[list[list[int]]]  # rank -> microbatches (padded to the same count) -> rows

    @property
    def ranks(self) -> int:
        return len(self.per_rank)

    @property
    def microbatches(self) -> int:
        """Microbatches per rank (every rank runs the same count; some may be empty)."""
        return len(self.per_rank[0])

    def batch_for(self, batch: RolloutBatch) -> RolloutBatch:
        return batch if self.order is None else batch.select(self.order)

    def minibatch_plan(self, rank: int, batch: RolloutBatch) -> MinibatchPlan:
        """Rank ``rank``'s plan over ``batch`` as this split sees it (``batch_for``'s result)."""
        shards = [sorted(r for mb in mbs for r in mb) for mbs in self.per_rank]
        rows = sorted(r for s in shards for r in s)
        return MinibatchPlan(
            rows, shards[rank], [list(mb) for mb in self.per_rank[rank]], stand_in=stand_in_row(batch, rows)
        )

    def describe(self) -> str:
        sizes = ["/".join(str(len(mb)) for mb in mbs) for mbs in self.per_rank]
        return " | ".join(sizes)


def _chunks(rows: list[int], sizes: list[int]) -> list[list[int]]:
    out, start = [], 0
    for n in sizes:
        out.append(rows[start : start + n])
        start += n
    return out


def _even_sizes(n: int, k: int) -> list[int]:
    q, r = divmod(n, k)
    return [q + 1] * r + [q] * (k - r)


def plan_split(split: Split, batch: RolloutBatch) -> SplitPlan:
    """Per-rank microbatches of ``batch`` (one minibatch) for ``split``; SplitError if it cannot be honoured."""
    spec = split.spec
    num = len(batch)
    if split.ranks > num:
        raise SplitError(
            f"split {spec!r}: dp:{split.ranks} needs at least {split.ranks} sequences, the minibatch has {num}"
        )
    order = None
    if split.shuffle is not None:
        g = torch.Generator().manual_seed(split.shuffle)
        order = torch.randperm(num, generator=g).tolist()
    view = batch if order is None else batch.select(order)
    lengths = view.token_spans().tolist()
    rows = list(range(num))
    shards = shard_rows(rows, lengths, split.ranks)
    per_rank = []
    for rank, shard in enumerate(shards):
        where = f" on rank {rank} ({len(shard)} sequences)" if split.ranks > 1 else f" ({len(shard)} sequences)"
        if split.micro is None:
            mbs = [shard]
        elif split.micro[0] == "even":
            k = split.micro[1]
            if k > len(shard):
                raise SplitError(f"split {spec!r}: {k} microbatches need at least {k} sequences{where}")
            mbs = _chunks(shard, _even_sizes(len(shard), k))
        elif split.micro[0] == "sizes":
            sizes = list(split.micro[1])
            if sum(sizes) != len(shard):
                raise SplitError(
                    f"split {spec!r}: sizes sum to {sum(sizes)}, but the minibatch has "
                    f"{len(shard)} sequences{where if split.ranks > 1 else ''}"
                )
            mbs = _chunks(shard, sizes)
        else:
            budget = split.micro[1]
            longest = max(shard, key=lambda r: (lengths[r], -r), default=None)
            if longest is not None and lengths[longest] > budget:
                raise SplitError(
                    f"split {spec!r}: sequence {int(view.seq_ids[longest])} has {lengths[longest]} tokens "
                    f"(prompt + response), more than the budget {budget}; a sequence is never split"
                )
            try:
                prompts = view.prompt_spans().tolist()
                mbs = budget_microbatches(
                    shard,
                    [lengths[r] for r in shard],
                    budget,
                    seq_ids=[int(view.seq_ids[r]) for r in shard],
                    prompt_lengths=[prompts[r] for r in shard],
                    packed=split.micro[0] == "packed",
                )
            except BatchError as exc:
                raise SplitError(f"split {spec!r}: {exc}") from None
        per_rank.append(mbs)
    count = max(len(m) for m in per_rank)
    per_rank = [pad_microbatches(m, count) for m in per_rank]
    return SplitPlan(split, order, per_rank)


def baseline_plan(batch: RolloutBatch) -> SplitPlan:
    """One microbatch holding the whole minibatch, one rank: what every split is compared with."""
    return SplitPlan(Split(BASELINE), None, [[list(range(len(batch)))]])
