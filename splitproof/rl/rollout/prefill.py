"""The prefill of a chunk of requests, and the KV caches a multi-turn episode keeps across its turns.

Layout (what keeps a row's numbers a function of the row): a request's new tokens — the whole prompt, or
the tokens after the part its kept cache covers — are right-aligned in a query block of
``canonical_prompt_width(max new tokens)`` columns, a multiple of ``pad_multiple``; a kept cache ends on a
multiple of ``pad_multiple`` columns (zero columns after it, masked) and is right-aligned before the query
block. Between two layouts a row's tokens then only move by multiples of ``pad_multiple`` (masked zero
columns come and go in whole blocks), the rule the single-turn prefill follows (``rl/rollout/hf.py``).

Requests without a kept cache and with the same prompt share one prefill row.

A kept cache (:class:`KeptRow`) is saved when its row stops generating: its columns from the block of
``pad_multiple`` holding its first token, the tokens they cover (the prompt and every fed token — the last
sampled token is not in it) and the mask. The next turn's request continues it when its ids start with
those tokens: only the rest (the last sampled token, the tool's tokens) is prefilled. The numbers are a
function of the episode alone, but not the ones of a fresh prefill of the whole episode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from splitproof.engine.forward_output import cache_keyword, cache_of, logits_of, takes_logits_to_keep
from splitproof.rl.rollout.kv_cache import ReservedLayer, cache_from_layers, cache_layers, reserve


def canonical_prompt_width(length: int, pad_multiple: int) -> int:
    """Columns a prompt of ``length`` tokens is left-padded to: the next multiple above ``length``."""
    return (length // pad_multiple + 1) * pad_multiple


@dataclass
class KeptRow:
    """A row's KV cache after a turn: per layer ``[heads, S, head_dim]``; ``mask`` [S] 1 on token columns;
    ``ids`` the tokens it covers."""

    ids: list[int]
    keys: list[Tensor]
    values: list[Tensor]
    mask: Tensor


@dataclass
class TurnCache:
    """The kept rows of one multi-turn rollout, by (uid, sample index); each is used once."""

    rows: dict[tuple[int, int], KeptRow] = field(default_factory=dict)

    def take(self, key: tuple[int, int], ids: Sequence[int]) -> KeptRow | None:
        row = self.rows.pop(key, None)
        if row is None or len(row.ids) >= len(ids) or list(ids[: len(row.ids)]) != row.ids:
            return None
        return row


def prefill(
    model: nn.Module,
    prompts: list[list[int]],
    kept: list[KeptRow | None],
    rows: int,
    extra: int,
    *,
    pad_multiple: int,
    pad_id: int,
    device: torch.device,
):
    """``(logits [rows, V], cache, mask)`` after the prefill of ``prompts`` (batch row r holds request r,
    rows past them copies of request 0), each continuing ``kept[r]`` when not None; the cache has room for
    ``extra`` more columns."""
    distinct: dict[tuple, int] = {}
    source = [
        distinct.setdefault(tuple(p) if k is None else ("kept", r), len(distinct))
        for r, (p, k) in enumerate(zip(prompts, kept))
    ]
    order = [source.index(d) for d in range(len(distinct))]  # the first row of each distinct prefill row
    news = [prompts[r][len(kept[r].ids) :] if kept[r] is not None else prompts[r] for r in order]
    width = max(canonical_prompt_width(len(p), pad_multiple) for p in news)
    spans = [0 if kept[r] is None else -(-kept[r].mask.numel() // pad_multiple) * pad_multiple for r in order]
    past = max(spans)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in news], dtype=torch.long, device=device)
    mask = torch.zeros(len(order), past + width, dtype=torch.long, device=device)
    for i, p in enumerate(news):
        mask[i, past + width - len(p) :] = 1
    cache = None
    if past:
        cache = _kept_cache([kept[r] for r in order], spans, past, width + extra, mask)
    kwargs = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    if cache is not None:
        kwargs[cache_keyword(model)] = cache
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0)[:, past:],
        use_cache=True,
        **kwargs,
    )
    index = torch.tensor(source + [source[0]] * (rows - len(prompts)), device=device)
    logits = logits_of(out)[:, -1].index_select(0, index)
    return logits, reserve(cache_of(out), extra, index), mask.index_select(0, index)


def _kept_cache(kept: list[KeptRow | None], spans: list[int], past: int, room: int, mask: Tensor):
    """A cache of ``past`` columns holding each kept row right-aligned on its span (zeros elsewhere)."""
    ref = next(k for k in kept if k is not None)
    layers = []
    for layer in range(len(ref.keys)):
        h, _, d = ref.keys[layer].shape
        keys = ref.keys[layer].new_zeros(len(kept), h, past + room, d)
        values = torch.zeros_like(keys)
        for i, (row, span) in enumerate(zip(kept, spans)):
            if row is not None:
                s = row.mask.numel()
                keys[i, :, past - span : past - span + s] = row.keys[layer]
                values[i, :, past - span : past - span + s] = row.values[layer]
        layers.append(ReservedLayer(keys, values, past))
    for i, (row, span) in enumerate(zip(kept, spans)):
        if row is not None:
            mask[i, past - span : past - span + row.mask.numel()] = row.mask
    return cache_from_layers(layers)


def keep_rows(
    turns: TurnCache,
    cache,
    mask: Tensor,
    ended: list[int],
    keys: list[tuple[int, int]],
    ids: list[list[int]],
    pad_multiple: int,
) -> None:
    """Save the batch rows ``ended`` (their request keys and covered tokens beside) into ``turns``."""
    layers = cache_layers(cache)
    if layers is None:
        return
    index = torch.tensor(ended, device=mask.device)
    picked = [(layer.keys.index_select(0, index), layer.values.index_select(0, index)) for layer in layers]
    rows_mask = mask.index_select(0, index)
    starts = (rows_mask.argmax(-1) // pad_multiple * pad_multiple).tolist()
    for i, (start, key, row_ids) in enumerate(zip(starts, keys, ids)):
        turns.rows[key] = KeptRow(
            ids=row_ids,
            keys=[k[i, :, start:] for k, _ in picked],
            values=[v[i, :, start:] for _, v in picked],
            mask=rows_mask[i, start:],
        )
