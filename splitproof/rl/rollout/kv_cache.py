"""The decode loop's KV cache: room reserved up front instead of growth by concatenation.

transformers' ``DynamicLayer`` grows each layer's keys and values by ``torch.cat`` at every decode step,
which copies the whole cache (O(length) per token and layer). :func:`reserve` replaces every plain
``DynamicLayer`` of a cache by a :class:`ReservedLayer` holding room for ``extra`` more columns: a step
writes its new column in place and attention reads a view of the filled columns — the same values at the
same positions, so the same bits (``tests/test_kv_cache.py``). Other layer types (sliding windows,
quantised caches) and legacy tuple caches are returned as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # transformers >= 4.56: caches made of layers
    from transformers.cache_utils import Cache, DynamicLayer
except ImportError:  # pragma: no cover - older transformers: tuple caches only
    Cache = DynamicLayer = None


class ReservedLayer(DynamicLayer if DynamicLayer is not None else object):
    """A full-attention cache layer of ``[batch, heads, capacity, head_dim]`` buffers; ``keys``/``values``
    are views of the first ``length`` columns. Grows (by doubling the room) only past its capacity."""

    def __init__(self, key_buffer: Tensor, value_buffer: Tensor, length: int):
        super().__init__()
        self.device = key_buffer.device
        self.length = length
        self._keys, self._values = key_buffer, value_buffer
        self.is_initialized = True
        self._view()

    def _view(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        n = key_states.shape[-2]
        if self.length + n > self._keys.shape[-2]:
            room = max(n, self._keys.shape[-2])
            self._keys, self._values = _with_room(self.keys, room), _with_room(self.values, room)
        self._keys[:, :, self.length : self.length + n] = key_states
        self._values[:, :, self.length : self.length + n] = value_states
        self.length += n
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep (and reorder) the batch rows ``beam_idx``, with the room."""
        index = beam_idx.to(self.device)
        self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)
        self._view()


def _with_room(t: Tensor, extra: int, rows: Tensor | None = None) -> Tensor:
    """``t`` (or its batch rows ``rows``) followed by ``extra`` unwritten columns along dim -2."""
    b, h, n, d = t.shape
    out = t.new_empty(b if rows is None else rows.numel(), h, n + extra, d)
    out[:, :, :n] = t if rows is None else t.index_select(0, rows)
    return out


def reserve(cache, extra: int, rows: Tensor | None = None):
    """The cache restricted to the batch rows ``rows`` (all when None, in that order, repeats allowed),
    each plain full-attention layer with room for ``extra`` more columns (a :class:`ReservedLayer`)."""
    layers = getattr(cache, "layers", None) if Cache is not None and isinstance(cache, Cache) else None
    if layers is None:  # a legacy tuple cache
        if rows is None:
            return cache
        return tuple(tuple(t.index_select(0, rows) for t in layer) for layer in cache)
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and layer.is_initialized and layer.keys.dim() == 4:
            keys, values = _with_room(layer.keys, extra, rows), _with_room(layer.values, extra, rows)
            layers[i] = ReservedLayer(keys, values, layer.keys.shape[-2])
        elif rows is not None:
            layer.reorder_cache(rows)
    return cache


def select_rows(cache, index: Tensor):
    """The cache restricted to (and reordered by) the batch rows ``index``."""
    if hasattr(cache, "reorder_cache"):
        cache.reorder_cache(index)
        return cache
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)  # legacy tuples


def cache_layers(cache) -> list | None:
    """The layers of a layered cache whose keys and values are ``[batch, heads, length, head_dim]``
    tensors (plain or reserved full-attention layers), or None."""
    layers = getattr(cache, "layers", None) if Cache is not None and isinstance(cache, Cache) else None
    if not layers or any(type(layer) not in (DynamicLayer, ReservedLayer) for layer in layers):
        return None
    return layers


def cache_from_layers(layers: list):
    """A ``DynamicCache`` made of the given layers."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = list(layers), None
    return cache
