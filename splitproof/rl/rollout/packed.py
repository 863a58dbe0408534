"""Packed forwards over per-sequence KV slots: any set of sequences, each feeding any number of new tokens,
in one forward (what lets multi-turn episodes leave and rejoin a running batch, ``rl/rollout/continuous.py``).

A forward's input is one row ``[1, N]``: the new tokens of every sequence in it, side by side (a decode
step's one token, a prompt, or a turn's last sampled token and the tool's tokens). Each sequence owns a
slot of a :class:`SlotCache` (per layer ``[slots, kv_heads, capacity, head_dim]``); token n, at position
``p`` of the sequence in slot ``s``, writes its keys and values at column ``p`` of slot ``s`` and attends to
columns ``0 .. width - 1`` of that slot, those past ``p`` masked, ``width`` the forward's longest sequence
rounded up to a multiple of ``pad_multiple``. Two products compute the attention (:class:`PackedStep`):

- a token fed alone (a decode step) is a row of the *slot pass*, one product over the slots from the first
  to the last such token, in place: slot s's query rows are its token's query heads of each key head (the
  kernel computes each slot and key head on its own, so which slots share the product moves no bit);
- the tokens of a longer feed (a prompt, a tool's reply) are rows of *tiles* of ``TILE`` query rows: the
  token at position p is row ``p mod TILE`` of the tile of block ``p // TILE`` of its slot, whose keys are
  gathered.

What keeps a token's numbers a function of its sequence and of how that sequence was fed (the lengths of
its feeds, a function of the episode), whichever sequences share the forward, in which order and slots:
the linear layers run in fixed row tiles (``engine.row_invariant``); norms and element-wise operations are
per row; in both attention products a token's query sits in a row fixed by the model's shape and its
position, against keys at fixed columns from 0, and what the company changes is only how many masked
columns follow, in whole blocks of ``pad_multiple`` (the rule of the padded layouts, ``rl/rollout/hf.py``);
a forward's token count times each layer width is a multiple of :data:`ROW_BYTES` over the element size
(:func:`row_multiple`; filler tokens, which skip the attention), since ATen's element-wise kernels run two vectors
at a time and the elements past the last such pair through a scalar path that rounds differently
(measured: float32 SiLU on AVX-512, 16 elements of a row of 176 at odd row counts).
``tests/test_packed.py``: float32 and float64, with and without grouped-query attention, with AVX-512 and
AVX2 kernels (measured on an Intel CPU).

Needs a Hugging Face model whose attention layers go through transformers' attention interface
(``_supports_attention_backend``: Llama, Qwen2/3, Mistral, SmolLM2, ...) with full attention in every
layer and no logit soft-capping: :func:`supports_packed`. The forward runs with the implementation
:data:`NAME` registered there, the cache handled here (the model gets no cache of its own), and only the
logits that are sampled.
"""

from __future__ import annotations

import contextlib
import math
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from splitproof.engine.forward_output import logits_of, takes_logits_to_keep
from splitproof.engine.logprobs import param_dtype
from splitproof.engine.row_invariant import MIN_ROWS
from splitproof.engine.row_invariant import TILE as LINEAR_TILE
from splitproof.hf_models import base_model_of

from .decoder_stack import Stack, stack_forward, stack_of

NAME = "splitproof_packed"
TILE = 16  # query rows per attention product: a token is row (position mod TILE) of its tile
ROW_BYTES = 128  # a forward's token count is a multiple of ROW_BYTES / element size: two 64-byte vectors


def long_tensor(values: list[int], device: torch.device) -> Tensor:
    """``torch.tensor(values, dtype=torch.long)`` on ``device``, through an ``array`` (a third of the time)."""
    return (
        torch.frombuffer(array("q", values), dtype=torch.long).to(device)
        if values
        else torch.zeros(0, dtype=torch.long, device=device)
    )


class SlotCache:
    """Keys and values of ``slots`` sequences, per layer ``[slots, kv_heads, capacity, head_dim]`` (made at
    the first forward, from the model's own key shapes); a slot's columns are its sequence's positions."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def write(self, layer: int, key: Tensor, value: Tensor, rows: Tensor) -> None:
        """Key and value ``[N, kv_heads, head_dim]`` (the real tokens) at the flat rows ``rows`` [N · kv_heads] of
        the layer's ``[slots · kv_heads · capacity, head_dim]`` (:attr:`PackedStep.write_rows`)."""
        if layer not in self.keys:
            n, h, d = key.shape
            self.keys[layer] = key.new_zeros(self.slots, h, self.capacity, d)
            self.values[layer] = value.new_zeros(self.slots, h, self.capacity, d)
        d = key.shape[-1]
        self.keys[layer].view(-1, d).index_copy_(0, rows, key.reshape(-1, d))
        self.values[layer].view(-1, d).index_copy_(0, rows, value.reshape(-1, d))

    def copy(self, sources: list[int], targets: list[int], length: int) -> None:
        """Columns ``0 .. length - 1`` of slot ``sources[i]`` into slot ``targets[i]``, every layer (a target's
        columns past its own sequence's length are masked until it writes them)."""
        device = next(iter(self.keys.values())).device
        source, target = long_tensor(sources, device), long_tensor(targets, device)
        for cache in (*self.keys.values(), *self.values.values()):
            columns = cache[:, :, :length]
            columns.index_copy_(0, target, columns.index_select(0, source))


class PackedStep:
    """One packed forward's inputs and where its tokens go, built from its feeds (:func:`packed_forward`;
    fillers pad the token count to a multiple of ``packed.rows``, at least ``MIN_ROWS``, and take neither
    pass): ``ids``, ``position``, ``keep`` (the rows whose logits are sampled; ``rows``: those, then copies of
    the first up to a whole number of the LM head's row tiles), ``width`` (the key columns).
    A token fed alone (its sequence's only new token: a decode step) is a query of the *slot pass*: one
    product over every slot's columns, query row g of slot s for query head g of each key head,
    ``slot_mask`` [slots, 1, 1, width] up to its position. The other tokens are row ``position % TILE`` of a
    *tile*: tile t holds block ``position // TILE`` of slot ``tile_slot[t]``, its keys gathered, ``tile_mask``
    [tiles, 1, groups · TILE, width] letting row (g, r) see the columns up to ``block · TILE + r`` (rows
    without a token too: output dropped). Every gather and scatter is one ``index_select`` or ``index_copy_``
    over rows of ``head_dim`` numbers: ``write_rows`` (a real token's keys into the cache), ``slot_rows`` /
    ``tile_rows`` (the passes' queries, from the token-major queries ``[N · heads]``), ``out_rows`` (each
    token's outputs from the passes' outputs side by side, tiles first, each ordered (batch, query row, key
    head) as the attention kernel writes them)."""

    def __init__(self, packed: PackedModel, cache: SlotCache, feeds: list[tuple], last: list[int], pad_multiple: int):
        self.cache = cache
        heads, kv, slots, capacity = packed.heads, packed.heads // packed.groups, cache.slots, cache.capacity
        real = sum(len(tokens) for _, _, tokens in feeds)
        n = max(MIN_ROWS, -(-real // packed.rows) * packed.rows)
        ids, position, write = [], [], []
        limit = [0] * slots  # the last column a slot's decode query sees (column 0: any slot)
        slot_token = [0] * slots  # its query's first row (any: output dropped)
        alone, base, chunked, tile_slot, first_column, cell = [], [0] * n, [0] * n, [], [], []
        m = 0  # the feed's first token
        for s, start, tokens in feeds:
            end = start + len(tokens)
            ids += tokens
            position += range(start, end)
            write += range(s * kv * capacity + start, s * kv * capacity + end)
            if len(tokens) == 1:
                alone.append((m, s))
                limit[s], slot_token[s] = start, m * heads
            p = start
            while p < end and len(tokens) > 1:  # a tile per block of TILE positions
                r, t = p % TILE, len(tile_slot)
                k, count = m + p - start, min(end, p - r + TILE) - p  # the block's first token, and tokens
                tile_slot.append(s)
                first_column.append(p - r)
                cell += [0] * r + list(range(k * heads, (k + count) * heads, heads)) + [0] * (TILE - r - count)
                row = t * TILE * heads + r * kv  # token k's output row (t, g=0, r, h=0)
                base[k : k + count] = range(row, row + count * kv, kv)
                chunked[k : k + count] = [1] * count
                p += count
            m += len(tokens)
        lo, hi = (min(s for _, s in alone), max(s for _, s in alone) + 1) if alone else (0, 0)
        self.slot_range = lo, hi  # the slot pass runs over these slots (a view of the cache)
        for k, s in alone:
            base[k] = len(tile_slot) * TILE * heads + (s - lo) * heads  # the slot pass's outputs after the tiles'
        self.passes = bool(alone), bool(tile_slot)
        self.width = width = -(-(max(position) + 1) // pad_multiple) * pad_multiple
        fill = [0] * (n - real)
        lists = (
            ids + fill,
            position + fill,
            last + [0] * (max(MIN_ROWS, -(-len(last) // LINEAR_TILE) * LINEAR_TILE) - len(last)),
            write,
            base,
            chunked,
            limit[lo:hi],
            slot_token[lo:hi],
            tile_slot,
            first_column,
            cell,
        )
        flat = long_tensor([i for part in lists for i in part], packed.device)
        self.ids, self.position, self.rows, write, base, chunked, limit, slot_token, self.tile_slot, first, cell = (
            flat.split([len(part) for part in lists])
        )
        self.keep = self.rows[: len(last)]
        self.write_rows = (write[:, None] + packed.key_heads * cache.capacity).view(-1)
        self.out_rows = (base[:, None] + packed.head_rows.index_select(0, chunked)).view(-1)
        columns = torch.arange(width, device=packed.device)
        if alone:
            self.slot_rows = (slot_token[:, None] + packed.query_heads).view(-1)  # [slots, kv, groups] order
            self.slot_mask = torch.where(columns <= limit[:, None], packed.zero, packed.minus_inf)[:, None, None]
        if tile_slot:
            rows = cell.view(-1, 1, TILE) + packed.query_heads[:, None]
            self.tile_rows = rows.view(-1)  # [tiles, kv, groups, TILE] order
            last_column = first[:, None] + packed.tile_offsets
            self.tile_mask = torch.where(columns <= last_column[:, :, None], packed.zero, packed.minus_inf)[:, None]


def attend(step: PackedStep, layer: int, query: Tensor, key: Tensor, value: Tensor, scale: float | None) -> Tensor:
    """softmax(q Kᵀ · scale + mask) V per token over its slot, in the slot pass and the tiles of
    :class:`PackedStep`, for ``query`` ``[N, heads, d]``, ``key``/``value`` ``[N, kv_heads, d]`` of the packed
    tokens (whose keys and values it writes into the cache first); ``[N, heads, d]`` (fillers: any numbers).
    The query heads of a key head are rows of one product (no copy of the keys per query head)."""
    (n, heads, d), kv_heads = query.shape, key.shape[1]
    real = step.write_rows.shape[0] // kv_heads
    step.cache.write(layer, key[:real], value[:real], step.write_rows)
    q = query.reshape(n * heads, d)  # token-major: row n · heads + head
    keys = step.cache.keys[layer][:, :, : step.width]  # every slot, in place
    values = step.cache.values[layer][:, :, : step.width]
    outs = []
    if step.passes[1]:
        tiles = step.tile_slot.shape[0]
        cells = q.index_select(0, step.tile_rows).view(tiles, kv_heads, heads // kv_heads * TILE, d)
        tiled = F.scaled_dot_product_attention(
            cells,
            keys.index_select(0, step.tile_slot),
            values.index_select(0, step.tile_slot),
            attn_mask=step.tile_mask,
            scale=scale,
        )
        outs.append(tiled.transpose(1, 2).reshape(-1, d))
    if step.passes[0]:
        lo, hi = step.slot_range
        rows = q.index_select(0, step.slot_rows).view(hi - lo, kv_heads, heads // kv_heads, d)
        alone = F.scaled_dot_product_attention(rows, keys[lo:hi], values[lo:hi], attn_mask=step.slot_mask, scale=scale)
        outs.append(alone.transpose(1, 2).reshape(-1, d))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).index_select(0, step.out_rows).view(n, heads, d)


def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """:func:`attend` behind transformers' attention-interface signature (``query`` ``[1, heads, N, d]``,
    ``key``/``value`` ``[1, kv_heads, N, d]``; ``[1, N, heads, d]`` back), for ``model(...)``."""
    t = (query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    return attend(kwargs["packed"], module.layer_idx, *t, kwargs.get("scaling"))[None], None


def _register() -> bool:
    try:
        from transformers import AttentionInterface
    except ImportError:  # pragma: no cover - transformers without the attention interface
        return False
    AttentionInterface.register(NAME, packed_attention)
    return True


_REGISTERED = _register()


def supports_packed(model: nn.Module) -> bool:
    """Whether packed forwards can run on ``model``: a Hugging Face model on transformers' attention interface
    whose layers number their caches (``layer_idx``) and which keeps only asked-for logits."""
    base = base_model_of(model)
    if not _REGISTERED or not getattr(base, "_supports_attention_backend", False):
        return False
    if not hasattr(base, "set_attn_implementation") or not takes_logits_to_keep(model):
        return False
    attention = [m for m in base.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
    config = base.config
    full = all(kind == "full_attention" for kind in getattr(config, "layer_types", None) or ["full_attention"])
    plain = getattr(config, "sliding_window", None) is None and getattr(config, "attn_logit_softcapping", None) is None
    return bool(attention) and full and plain


@contextlib.contextmanager
def packed_forwards(model: nn.Module) -> Iterator[None]:
    """Within: the model's attention is :func:`packed_attention` (the implementation it had is restored)."""
    base = base_model_of(model)
    before = base.config._attn_implementation
    base.set_attn_implementation(NAME)
    try:
        yield
    finally:
        base.set_attn_implementation(before)


def row_multiple(model: nn.Module) -> int:
    """The token counts a forward is padded to a multiple of: every element-wise pass over ``rows × width``
    elements (width: a linear layer's input or output, the LM head's aside) then ends on a whole pair of
    vectors of :data:`ROW_BYTES` (1 for SmolLM2-135M in float32, whose widths are multiples of 32; 2 for the
    built-in model, width 176), and every linear layer takes whole row tiles as they are (4 rows:
    ``engine.row_invariant``, whose products would otherwise copy zero rows in)."""
    elements = ROW_BYTES // param_dtype(model).itemsize
    head = base_model_of(model).get_output_embeddings()  # runs on the sampled rows only
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and m is not head]
    widths = {w for m in linears for w in (m.in_features, m.out_features)}
    return math.lcm(LINEAR_TILE, *(elements // math.gcd(elements, w) for w in widths))


@dataclass(frozen=True)
class PackedModel:
    """What packed forwards need of a model, read once per rollout: its token-count multiple
    (:func:`row_multiple`), query heads and query heads per key head, parameter dtype, device, its decoder
    stack when ``rl/rollout/decoder_stack.py`` runs it (None: ``model(...)``), and the constants of every
    :class:`PackedStep`: ``key_heads`` and ``query_heads`` (aranges), ``head_rows`` [2, heads] (query head
    h · groups + g's output row g · kv_heads + h in the slot pass, g · TILE · kv_heads + h in a tile),
    ``tile_offsets`` (row (g, r) of a tile: r), and the mask values 0 and -inf."""

    model: nn.Module
    rows: int
    heads: int
    groups: int
    dtype: torch.dtype
    device: torch.device
    stack: Stack | None
    key_heads: Tensor
    query_heads: Tensor
    head_rows: Tensor
    tile_offsets: Tensor
    zero: Tensor
    minus_inf: Tensor


def packed_model(model: nn.Module, *, stack: bool = True) -> PackedModel:
    """``model``'s :class:`PackedModel`; ``stack=False`` runs every forward through ``model(...)``."""
    config = base_model_of(model).config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    groups, device, dtype = heads // kv, next(model.parameters()).device, param_dtype(model)
    h, g = torch.arange(kv, device=device)[:, None], torch.arange(groups, device=device)
    return PackedModel(
        model,
        row_multiple(model),
        heads,
        groups,
        dtype,
        device,
        stack_of(model) if stack else None,
        key_heads=torch.arange(kv, device=device),
        query_heads=torch.arange(heads, device=device),
        head_rows=torch.stack([(g * kv + h).view(-1), (g * TILE * kv + h).view(-1)]),
        tile_offsets=torch.arange(TILE, device=device).repeat(groups),
        zero=torch.zeros((), dtype=dtype, device=device),
        minus_inf=torch.full((), float("-inf"), dtype=dtype, device=device),
    )


def packed_forward(
    packed: PackedModel,
    cache: SlotCache,
    feeds: list[tuple[int, int, list[int]]],
    last: list[int],
    *,
    pad_multiple: int,
) -> Tensor:
    """The logits ``[K, V]`` at the packed tokens ``last`` after a forward of ``feeds``: ``(slot, position,
    tokens)``, the new tokens of the sequence in ``slot`` from ``position`` on (each slot at most once), side
    by side in that order; it writes their keys and values into ``cache``. The token count is padded to a
    multiple of ``packed.rows``, at least ``MIN_ROWS``; the keys to a multiple of ``pad_multiple`` columns."""
    step = PackedStep(packed, cache, feeds, last, pad_multiple)
    if packed.stack is not None:
        logits = stack_forward(packed.stack, step.ids, step.position, step.rows, partial(attend, step), step.width)
        return logits[: len(last)]  # the LM head took whole row tiles, its rows as they are
    dummy_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packed.device)  # 4-D: taken as is, never read
    out = packed.model(
        input_ids=step.ids.unsqueeze(0),
        attention_mask=dummy_mask,
        position_ids=step.position.unsqueeze(0),
        use_cache=False,
        logits_to_keep=step.keep,
        packed=step,
    )
    return logits_of(out)[0]
