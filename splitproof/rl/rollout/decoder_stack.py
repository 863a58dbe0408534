"""A packed forward through a Llama-family decoder stack, layer by layer, without transformers' per-call glue.

A packed forward (``rl/rollout/packed.py``) through ``model(...)`` spends more time in transformers' code
around the layers than in the layers' products on a small model: keyword plumbing, decorators, output
recording, the attention-interface lookup, configuration reads. :func:`stack_of` finds the parts of a model
whose decoder layers are the plain pre-norm blocks of Llama, Mistral and Qwen2 (the classes listed in
:data:`LAYERS`); :func:`stack_forward` then runs the same modules in the same order, and transformers'
functions op for op (embedding, rotary tables, per layer: RMSNorm, q/k/v projections, the rotary
embedding, the packed attention, output projection and residual, RMSNorm, gated MLP and residual; the
final norm), so it computes the same numbers with fewer Python calls (``tests/test_packed.py`` checks the
logits bit for bit against ``model(...)``). Where the numbers are the same by IEEE arithmetic it takes fewer
operations:

- the rotary module's cos and sin are a function of the position alone for the static rope types (not
  ``dynamic`` or ``longrope``, which rescale with the sequence length), each element computed on its own,
  so :class:`RotaryTable` computes them once for positions 0, 1, ... and a forward gathers its rows (its
  length a multiple of 64 positions, so that every element takes ATen's vector path, as the forward's own
  padded rows do);
- ``rotate_half(q) · sin``, with ``rotate_half(q) = cat(-q₂, q₁)``, is ``roll(q, d/2) · cat(-sin₁, sin₂)``:
  negation is exact and a product's rounding does not depend on the signs;
- a cast to the dtype a tensor already has is skipped.

The final norm and the LM head run on the sampled rows only (the norm is per row). Every module it runs
is called through its ``forward`` (no module of the stack has a hook), so ``engine.row_invariant``'s
products and LoRA adapters apply as they do in ``model(...)``.
Any other model (Qwen3's per-head norms, Gemma's scaled embeddings, FSDP-sharded layers, a module with a
forward hook the stack would skip, ...) keeps ``model(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from splitproof.hf_models import base_model_of

LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
PARTS = {
    "self_attn": {"LlamaAttention", "MistralAttention", "Qwen2Attention"},
    "mlp": {"LlamaMLP", "MistralMLP", "Qwen2MLP"},
    "input_layernorm": NORMS,
    "post_attention_layernorm": NORMS,
}


TABLE_POSITIONS = 64  # a rotary table's length is a multiple of this


class RotaryTable:
    """cos and ``cat(-sin₁, sin₂)`` of a static rotary module for positions 0 .. n - 1, ``[n, head_dim]``
    each, computed by the module itself (and again, longer, when a forward needs a later position)."""

    def __init__(self, rotary: nn.Module):
        self.rotary, self.cos, self.sin = rotary, None, None

    def rows(self, hidden: Tensor, position: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        """cos and signed sin ``[N, 1, head_dim]`` at ``position`` (all below ``positions``)."""
        if self.cos is None or self.cos.shape[0] < positions or self.cos.dtype != hidden.dtype:
            n = -(-positions // TABLE_POSITIONS) * TABLE_POSITIONS
            every = torch.arange(n, device=hidden.device)[None]
            cos, sin = self.rotary(hidden[None], position_ids=every)
            self.cos, self.sin = cos[0], _signed(sin)[0]
        return self.cos.index_select(0, position)[:, None], self.sin.index_select(0, position)[:, None]


def _signed(sin: Tensor) -> Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _static_rope(rotary: nn.Module) -> bool:
    kind = getattr(rotary, "rope_type", None)
    return isinstance(kind, str) and "dynamic" not in kind and kind != "longrope"


@dataclass(frozen=True)
class Stack:
    """The parts a packed forward runs: the embedding, rotary module (and its table when its rope type is
    static), layers, final norm and LM head."""

    embed: nn.Module
    rotary: nn.Module
    table: RotaryTable | None
    layers: tuple[nn.Module, ...]
    norm: nn.Module
    head: nn.Module


def _is(module, names: set[str]) -> bool:
    cls = type(module)
    return cls.__name__ in names and cls.__module__.startswith("transformers.models.")


def stack_of(model: nn.Module) -> Stack | None:
    """The decoder stack of ``model`` when every layer is one of the plain Llama-family blocks, the model has
    a rotary module, a final norm and an output layer, and no module whose forward the stack replaces has
    a forward hook (FSDP's, a user's: ``model(...)`` runs them); else None."""
    causal = base_model_of(model)
    decoder = causal.get_decoder() if hasattr(causal, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    parts = [getattr(decoder, name, None) for name in ("embed_tokens", "rotary_emb", "norm")]
    head = causal.get_output_embeddings() if hasattr(causal, "get_output_embeddings") else None
    if not layers or any(p is None for p in parts) or head is None or not _is(parts[2], NORMS):
        return None
    skipped = [causal, decoder, parts[2]]  # modules whose forward the stack replaces
    for layer in layers:
        if not _is(layer, LAYERS) or any(not _is(getattr(layer, k, None), v) for k, v in PARTS.items()):
            return None
        if any(hasattr(layer.self_attn, norm) for norm in ("q_norm", "k_norm")):
            return None
        skipped += [layer, *(getattr(layer, k) for k in PARTS)]
    called = [m for layer in layers for m in layer.modules()] + [parts[0], head]  # forward called directly
    if any(m._forward_hooks or m._forward_pre_hooks for m in skipped + called):  # FSDP's gathers, a user's: model(...)
        return None
    rotary = parts[1]
    return Stack(parts[0], rotary, RotaryTable(rotary) if _static_rope(rotary) else None, tuple(layers), parts[2], head)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' Llama-family RMSNorm, op for op: w · (x / sqrt(mean(x²) + eps)), in float32."""
    dtype = x.dtype
    if dtype != torch.float32:
        x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * (x if dtype == torch.float32 else x.to(dtype))


def _rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """transformers' ``x · cos + rotate_half(x) · sin``, with the sign folded into ``signed_sin``."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def stack_forward(stack: Stack, ids: Tensor, position: Tensor, keep: Tensor, attend, positions: int) -> Tensor:
    """The logits ``[K, V]`` at the tokens ``keep`` of the packed tokens ``ids`` ``[N]`` at ``position`` ``[N]``
    (all below ``positions``), hidden states ``[N, hidden]``; ``attend(layer, q, k, v, scale)`` is the attention
    over ``q`` ``[N, heads, d]`` and ``k``, ``v`` ``[N, kv_heads, d]``, ``[N, heads, d]`` back."""
    n = ids.shape[0]
    hidden = stack.embed.forward(ids)
    if stack.table is not None:
        cos, sin = stack.table.rows(hidden, position, positions)
    else:
        cos, sin = stack.rotary(hidden[None], position_ids=position[None])
        cos, sin = cos[0][:, None], _signed(sin)[0][:, None]
    for index, layer in enumerate(stack.layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, hidden)
        shape = (n, -1, attn.head_dim)
        q = _rotate(attn.q_proj.forward(x).view(shape), cos, sin)
        k = _rotate(attn.k_proj.forward(x).view(shape), cos, sin)
        out = attend(index, q, k, attn.v_proj.forward(x).view(shape), attn.scaling)
        hidden = hidden + attn.o_proj.forward(out.view(n, -1))
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        hidden = hidden + mlp.down_proj.forward(mlp.act_fn.forward(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    return stack.head.forward(_rms_norm(stack.norm, hidden.index_select(0, keep)))
