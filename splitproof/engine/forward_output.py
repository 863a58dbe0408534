"""What a Hugging Face forward takes and gives: whether it names ``logits_to_keep``, its cache keyword, its
logits and its KV cache."""

from __future__ import annotations

import inspect

from torch import Tensor, nn

from splitproof.hf_models import base_model_of

_accepts_logits_to_keep: dict[type, bool] = {}


def takes_logits_to_keep(model: nn.Module) -> bool:
    """Whether the Hugging Face module (inside DDP/PEFT wrappers)'s forward names a ``logits_to_keep``
    parameter (cached per class)."""
    cls = type(base_model_of(model))
    if cls not in _accepts_logits_to_keep:
        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _accepts_logits_to_keep[cls] = "logits_to_keep" in params
    return _accepts_logits_to_keep[cls]


def logits_of(out) -> Tensor:
    """The logits of a forward's output: a tensor, an output with ``.logits``, or a tuple's first item."""
    if isinstance(out, Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0]


def cache_keyword(model: nn.Module) -> str:
    """``cache`` (transformers >= 5.2x) or ``past_key_values`` (earlier, and remote-code models); asked of
    the Hugging Face model inside a LoRA wrapper, whose forward passes keywords through."""
    params = inspect.signature(type(base_model_of(model)).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(out):
    """The KV cache of a forward's output (``cache`` or ``past_key_values``); None when it returned none."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)
