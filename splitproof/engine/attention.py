"""The attention mask the engine gives the model, in the form the model's attention implementation applies.

Both layouts (padded rows and packed rows) get an explicit ``[n, 1, L, L]`` mask: query q attends key k
iff k ≤ q, both belong to the same sequence, and k is a real token (attention_mask 1). A query with no
such key — padding before a row's first token, or filler in a packed row — attends to itself alone, so
no softmax row is empty. Padding inside a sequence (a hole in its attention) is a query like any other:
it sees the real tokens before it, as in the Hugging Face padded forward.

Forms: ``sdpa`` takes a boolean mask (True = attend). ``eager`` adds the mask to the scores, so it gets
0 / the dtype's most negative value (a boolean mask would be added as 0/1 and mask nothing); it runs its
softmax in float32, where that value is −inf, and an empty row there would be NaN that reaches real
tokens through the values. Other implementations (flash attention, flex attention, paged, ...) do not
take such a mask and are refused before anything runs. A module without a Hugging Face config gets the
boolean form.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from splitproof.loss_config import ConfigError

SUPPORTED_ATTENTION = ("sdpa", "eager")
CACHED_WIDTH = 512  # masks this wide or narrower reuse their triangle (at most 64 × 2 × 256 KB kept)


def attention_implementation(model: nn.Module) -> str | None:
    """``config._attn_implementation`` of the first module with a Hugging Face config (wrappers included)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation or "eager"  # unset: Hugging Face's default path
    return None


def check_attention(model: nn.Module) -> None:
    """Refuse an attention implementation that cannot apply the engine's masks (ConfigError)."""
    implementation = attention_implementation(model)
    if implementation is not None and implementation not in SUPPORTED_ATTENTION:
        raise ConfigError(
            "attn_implementation",
            f"{implementation!r} is not supported: the engine passes explicit "
            "4-D attention masks (causal, per sequence, block-diagonal for packed rows), which it does "
            "not apply; load the model with attn_implementation='sdpa' (or 'eager'), e.g. "
            "from_pretrained(path, attn_implementation='sdpa') or model.set_attn_implementation('sdpa')",
        )


def attention_mask(segment: Tensor | None, real: Tensor, model: nn.Module, dtype: torch.dtype) -> Tensor:
    """The ``[n, 1, L, L]`` mask of rows whose positions belong to sequences ``segment`` ([n, L]; -1 for
    filler; None: one sequence per row) and hold a real token where ``real`` ([n, L] bool), in the form
    ``model`` applies."""
    width = real.shape[1]
    causal, eye = (_cached_causal_and_eye if width <= CACHED_WIDTH else _causal_and_eye)(width, real.device)
    allowed = real[:, None, :] & causal
    if segment is not None:
        allowed.logical_and_(segment[:, :, None] == segment[:, None, :])
    allowed.logical_or_(eye & ~allowed.any(dim=-1, keepdim=True))  # a query with no key attends to itself
    if attention_implementation(model) == "eager":
        additive = torch.zeros(allowed.shape, dtype=dtype, device=real.device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]
    return allowed[:, None]


def _causal_and_eye(width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The [L, L] lower triangle and diagonal (read only: every mask is a new tensor)."""
    ones = torch.ones(width, width, dtype=torch.bool, device=device)
    return ones.tril(), torch.eye(width, dtype=torch.bool, device=device)


_cached_causal_and_eye = functools.lru_cache(maxsize=64)(_causal_and_eye)
