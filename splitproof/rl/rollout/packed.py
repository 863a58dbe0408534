"""Packed forwards over per-sequence KV slots: any set of sequences, each feeding any number of new tokens,
in one forward (what lets multi-turn episodes leave and rejoin a running batch, ``rl/rollout/continuous.py``).

A forward's input is one row ``[1, N]``: the new tokens of every sequence in it, side by side (a decode
step's one token, a prompt, or a turn's last sampled token and the tool's tokens). Each sequence owns a
slot of a :class:`SlotCache` (per layer ``[slots, kv_heads, capacity, head_dim]``); token n, at position
``p`` of the sequence in slot ``s``, writes its keys and values at column ``p`` of slot ``s`` and attends to
columns ``0 .. width - 1`` of that slot, those past ``p`` masked, ``width`` the forward's longest sequence
rounded up to a multiple of ``pad_multiple``. Two products compute the attention (:class:`PackedStep`):

- a token fed alone (a decode step) is a row of the *slot pass*, one product over every slot in place:
  slot s's query rows are its token's query heads of each key head;
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
from collections.abc import Iterator
from dataclasses import dataclass

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


class SlotCache:
    """Keys and values of ``slots`` sequences, per layer ``[slots, kv_heads, capacity, head_dim]`` (made at
    the first forward, from the model's own key shapes); a slot's columns are its sequence's positions."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: dict[int, Tensor] = {}
        self.values: dict[int, Tensor] = {}

    def write(self, layer: int, key: Tensor, value: Tensor, slot: Tensor, position: Tensor) -> None:
        """Key and value ``[N, kv_heads, head_dim]`` of token n at column ``position[n]`` of slot ``slot[n]``."""
        if layer not in self.keys:
            n, h, d = key.shape
            self.keys[layer] = key.new_zeros(self.slots, h, self.capacity, d)
            self.values[layer] = value.new_zeros(self.slots, h, self.capacity, d)
        self.keys[layer][slot, :, position] = key
        self.values[layer][slot, :, position] = value

    def copy(self, source: int, target: int, length: int) -> None:
        """Columns ``0 .. length - 1`` of slot ``source`` into slot ``target``, every layer."""
        for layer in self.keys:
            self.keys[layer][target, :, :length] = self.keys[layer][source, :, :length]
            self.values[layer][target, :, :length] = self.values[layer][source, :, :length]


class PackedStep:
    """Where a packed forward's tokens go and how they attend, from the Python lists of the real tokens
    (fillers take neither pass). A token fed alone (its sequence's only new token: a decode step) is a query
    of the *slot pass*: one product over every slot's columns, row g of slot ``alone_slot`` for query head g
    of each key head, ``slot_mask`` [slots, 1, 1, width] up to its position. The other tokens are row
    ``position % TILE`` of a *tile*: tile t holds block ``position // TILE`` of slot ``tile_slot[t]``, its keys
    gathered, ``tile_mask`` [tiles, 1, groups · TILE, width] letting row (g, r) see the columns up to
    ``block · TILE + r`` (rows without a token too: output dropped); ``cell`` is a token's row
    ``t · TILE + r`` among the tiles' rows."""

    def __init__(
        self, cache: SlotCache, slot: list[int], position: list[int], width: int, *, groups: int, dtype, device
    ):
        self.cache, self.width, self.real = cache, width, len(slot)
        limit = [0] * cache.slots  # the last column a slot's decode query sees (column 0: any slot)
        alone, alone_slot, chunked, cell, tile_slot, tile_block = [], [], [], [], [], []
        n = 0
        while n < len(slot):  # a sequence's new tokens are consecutive and in order
            end = n + 1
            while end < len(slot) and slot[end] == slot[n]:
                end += 1
            if end - n == 1:
                alone.append(n)
                alone_slot.append(slot[n])
                limit[slot[n]] = position[n]
            else:
                for m in range(n, end):
                    block = position[m] // TILE
                    if m == n or block != tile_block[-1]:  # a new tile
                        tile_slot.append(slot[n])
                        tile_block.append(block)
                    chunked.append(m)
                    cell.append((len(tile_slot) - 1) * TILE + position[m] % TILE)
            n = end
        lists = (slot, position, alone, alone_slot, chunked, cell, tile_slot, tile_block, limit)
        flat = torch.tensor([i for part in lists for i in part], dtype=torch.long, device=device)
        (
            self.slot,
            self.position,
            self.alone,
            self.alone_slot,
            self.chunked,
            self.cell,
            self.tile_slot,
            block,
            limit,
        ) = flat.split([len(part) for part in lists])
        columns = torch.arange(width, device=device)
        self.slot_mask = _additive(columns <= limit[:, None], dtype)[:, None, None]
        last_column = block[:, None] * TILE + torch.arange(TILE, device=device).repeat(groups)
        self.tile_mask = _additive(columns <= last_column[:, :, None], dtype)[:, None]


def _additive(visible: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where ``visible``, -inf elsewhere: the float mask scaled_dot_product_attention makes of a boolean one
    at every call, made once per forward."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def packed_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' attention-interface signature: ``query`` ``[1, heads, N, d]``, ``key``/``value``
    ``[1, kv_heads, N, d]`` of the packed tokens; softmax(q Kᵀ · scaling + mask) V per token over its slot,
    in the slot pass and the tiles of :class:`PackedStep` (fillers: zeros). The query heads of a key head
    are rows of one product (no copy of the keys per query head)."""
    step: PackedStep = kwargs["packed"]
    layer, scale, real = module.layer_idx, kwargs.get("scaling"), step.real
    step.cache.write(
        layer, key[0, :, :real].transpose(0, 1), value[0, :, :real].transpose(0, 1), step.slot, step.position
    )
    kv_heads, (heads, n, d) = key.shape[1], query.shape[1:]
    groups = heads // kv_heads
    q = query[0].view(kv_heads, groups, n, d).permute(2, 0, 1, 3)  # [N, kv_heads, groups, d]
    out = query.new_zeros(n, kv_heads, groups, d)
    keys = step.cache.keys[layer][:, :, : step.width]  # every slot, in place
    values = step.cache.values[layer][:, :, : step.width]
    if len(step.alone):
        rows = query.new_zeros(step.cache.slots, kv_heads, groups, d)
        rows.index_copy_(0, step.alone_slot, q.index_select(0, step.alone))
        alone = F.scaled_dot_product_attention(rows, keys, values, attn_mask=step.slot_mask, scale=scale)
        out.index_copy_(0, step.alone, alone.index_select(0, step.alone_slot))
    if len(step.chunked):
        tiles = len(step.tile_slot)
        cells = query.new_zeros(tiles * TILE, kv_heads, groups, d)
        cells.index_copy_(0, step.cell, q.index_select(0, step.chunked))
        cells = cells.view(tiles, TILE, kv_heads, groups, d).permute(0, 2, 3, 1, 4)
        tiled = F.scaled_dot_product_attention(
            cells.reshape(tiles, kv_heads, groups * TILE, d),
            keys.index_select(0, step.tile_slot),
            values.index_select(0, step.tile_slot),
            attn_mask=step.tile_mask,
            scale=scale,
        )
        tiled = tiled.view(tiles, kv_heads, groups, TILE, d).permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, groups, d)
        out.index_copy_(0, step.chunked, tiled.index_select(0, step.cell))
    return out.view(1, n, heads, d), None  # [1, N, heads, d]


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
    (:func:`row_multiple`), query heads per key head, parameter dtype, device, and its decoder stack when
    ``rl/rollout/decoder_stack.py`` runs it (None: ``model(...)``)."""

    model: nn.Module
    rows: int
    groups: int
    dtype: torch.dtype
    device: torch.device
    stack: Stack | None


def packed_model(model: nn.Module, *, stack: bool = True) -> PackedModel:
    """``model``'s :class:`PackedModel`; ``stack=False`` runs every forward through ``model(...)``."""
    config = base_model_of(model).config
    heads = config.num_attention_heads
    groups = heads // (getattr(config, "num_key_value_heads", None) or heads)
    parameter = next(model.parameters())
    found = stack_of(model) if stack else None
    return PackedModel(model, row_multiple(model), groups, param_dtype(model), parameter.device, found)


def packed_forward(
    packed: PackedModel,
    cache: SlotCache,
    ids: list[int],
    slot: list[int],
    position: list[int],
    last: list[int],
    *,
    pad_multiple: int,
) -> Tensor:
    """The logits ``[K, V]`` at the packed tokens ``last`` after a forward of ``ids`` (token n at
    ``position[n]`` of the sequence in ``slot[n]``), which writes their keys and values into ``cache``;
    the token count is padded to a multiple of ``packed.rows``, at least ``MIN_ROWS``."""
    width = -(-(max(position) + 1) // pad_multiple) * pad_multiple
    fill = max(MIN_ROWS, -(-len(ids) // packed.rows) * packed.rows) - len(ids)  # fillers: in neither pass
    tokens = torch.tensor(
        [ids + [0] * fill, position + [0] * fill, last + [0] * (len(ids) + fill - len(last))],
        dtype=torch.long,
        device=packed.device,
    )
    step = PackedStep(cache, slot, position, width, groups=packed.groups, dtype=packed.dtype, device=packed.device)
    keep = tokens[2, : len(last)]
    if packed.stack is not None:
        return stack_forward(packed.stack, tokens[0], tokens[1], keep, packed_attention, packed=step)
    dummy_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=packed.device)  # 4-D: taken as is, never read
    out = packed.model(
        input_ids=tokens[0].unsqueeze(0),
        attention_mask=dummy_mask,
        position_ids=tokens[1].unsqueeze(0),
        use_cache=False,
        logits_to_keep=keep,
        packed=step,
    )
    return logits_of(out)[0]
