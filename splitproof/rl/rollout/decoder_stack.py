"""A packed forward through a Llama-family decoder stack, layer by layer, without transformers' per-call glue.

A packed forward (``rl/rollout/packed.py``) through ``model(...)`` spends more time in transformers' code
around the layers than in the layers' products on a small model: keyword plumbing, decorators, output
recording, the attention-interface lookup, configuration reads. :func:`stack_of` finds the parts of a model
whose decoder layers are the plain pre-norm blocks of Llama, Mistral and Qwen2 (the classes listed in
:data:`LAYERS`); :func:`stack_forward` then runs the same modules and the same functions of the model's own
transformers module in the same order (embedding, rotary tables, per layer: RMSNorm, q/k/v projections,
``apply_rotary_pos_emb``, the packed attention, output projection and residual, RMSNorm, gated MLP and
residual; the final norm), so it computes the same numbers with fewer Python calls
(``tests/test_packed.py`` checks the logits bit for bit against ``model(...)``). The final norm and the
LM head run on the sampled rows only (the norm is per row). Linear layers are called as modules, so
``engine.row_invariant``'s products and LoRA adapters apply as they do in ``model(...)``. Any other model
(Qwen3's per-head norms, Gemma's scaled embeddings, FSDP-sharded layers, a module with a forward hook the
stack would skip, ...) keeps ``model(...)``.
"""

from __future__ import annotations

import sys
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


@dataclass(frozen=True)
class Stack:
    """The parts a packed forward runs: the embedding, rotary module, layers, final norm, LM head, and the
    transformers module's ``apply_rotary_pos_emb``."""

    embed: nn.Module
    rotary: nn.Module
    layers: tuple[nn.Module, ...]
    norm: nn.Module
    head: nn.Module
    apply_rotary: object


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
    if any(m._forward_hooks or m._forward_pre_hooks for m in skipped):  # e.g. FSDP's gathers: model(...) runs them
        return None
    apply_rotary = getattr(sys.modules[type(layers[0].self_attn).__module__], "apply_rotary_pos_emb", None)
    if apply_rotary is None:
        return None
    return Stack(parts[0], parts[1], tuple(layers), parts[2], head, apply_rotary)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    """transformers' Llama-family RMSNorm, op for op: w · (x / sqrt(mean(x²) + eps)), in float32."""
    dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    x = x * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def stack_forward(stack: Stack, ids: Tensor, position: Tensor, keep: Tensor, attention, **attention_kwargs) -> Tensor:
    """The logits ``[K, V]`` at the tokens ``keep`` of the packed row ``ids`` ``[N]`` at ``position`` ``[N]``;
    ``attention(module, q, k, v, None, scaling=..., **attention_kwargs)`` is the attention-interface function."""
    n = ids.shape[0]
    hidden = stack.embed(ids)[None]
    cos, sin = stack.rotary(hidden, position_ids=position[None])
    for layer in stack.layers:
        attn, mlp = layer.self_attn, layer.mlp
        x = _rms_norm(layer.input_layernorm, hidden)
        shape = (1, n, -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q, k = stack.apply_rotary(q, k, cos, sin)
        out, _ = attention(attn, q, k, v, None, scaling=attn.scaling, **attention_kwargs)
        hidden = hidden + attn.o_proj(out.reshape(1, n, -1).contiguous())
        x = _rms_norm(layer.post_attention_layernorm, hidden)
        hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
    return stack.head(_rms_norm(stack.norm, hidden[0, keep]))
