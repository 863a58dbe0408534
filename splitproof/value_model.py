"""Value models (critics): the policy's architecture with a scalar head, as verl builds them.

A value model is a Hugging Face ``AutoModelForTokenClassification`` with ``num_labels=1``: the causal
LM's body (``model.model``) and a linear head ``score`` (hidden → 1) in place of the LM head, with its
classifier dropout 0. Built from a causal LM (a local checkpoint or a module in memory), the body is
copied and the head is new: weights ~ N(0, ``initializer_range``²) drawn from a generator seeded by
``seed`` alone (never the global RNG, never the process or DP layout), bias 0. A value model saved with
``save_pretrained`` loads back as itself, head included. Nothing here downloads anything.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch
from torch import nn

from .hf_models import local_checkpoint

HEAD = "score"
DEFAULT_INIT_STD = 0.02


def is_value_config(config) -> bool:
    """A token-classification config with one label: a saved value model."""
    architectures = getattr(config, "architectures", None) or []
    return getattr(config, "num_labels", None) == 1 and any(a.endswith("ForTokenClassification") for a in architectures)


def _value_config(config):
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    config.use_cache = False
    config.architectures = None
    return config


def init_value_head(model: nn.Module, seed: int) -> nn.Module:
    """Draw the head ``score`` from ``seed`` alone: weight ~ N(0, initializer_range²), bias 0 (in place)."""
    head = getattr(model, HEAD)
    std = float(getattr(model.config, "initializer_range", DEFAULT_INIT_STD))
    g = torch.Generator().manual_seed(int(seed))
    weight = torch.randn(head.weight.shape, generator=g, dtype=torch.float64) * std
    with torch.no_grad():
        head.weight.copy_(weight.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()
    return model


def value_model_from_config(config, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A randomly initialised value model of ``config``'s architecture (body from ``seed``, head from ``seed``)."""
    from transformers import AutoModelForTokenClassification

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(_value_config(config))
    return init_value_head(model.to(dtype), seed)


def _from_causal_lm(policy: nn.Module, dtype: torch.dtype | None, seed: int) -> nn.Module:
    from transformers import AutoModelForTokenClassification

    config = getattr(policy, "config", None)
    prefix = getattr(policy, "base_model_prefix", "model")
    body = getattr(policy, prefix, None)
    if config is None or body is None:
        raise ValueError(
            "path_or_model: a module given in memory must be a Hugging Face causal LM "
            f"(with .config and .{prefix}), got {type(policy).__name__}"
        )
    if is_value_config(config) or hasattr(policy, HEAD):
        raise ValueError("path_or_model: already a value model (it has a score head); use it as it is")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForTokenClassification.from_config(_value_config(config))
    model = model.to(dtype or next(policy.parameters()).dtype)
    getattr(model, model.base_model_prefix).load_state_dict(body.state_dict())
    return init_value_head(model, seed)


@contextmanager
def _quiet_load_report():
    """Hugging Face reports the LM head as unexpected and the value head as missing when a value model is
    built from a causal LM checkpoint; both are expected (any other missing weight is an error, below)."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def value_model_from_pretrained(
    path_or_model,
    *,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> nn.Module:
    """A value model from a causal LM (a local checkpoint path, or a module in memory) or from a saved
    value model (loaded as it is).

    From a causal LM the body is copied and the head drawn from ``seed`` (the same head on every rank and
    for every layout); the policy module itself is left untouched. ``dtype`` defaults to the checkpoint's
    (or the module's). Only local files are read.
    """
    if isinstance(path_or_model, nn.Module):
        return _from_causal_lm(path_or_model, dtype, seed).to(device)
    from transformers import AutoConfig, AutoModelForTokenClassification

    path, kwargs = local_checkpoint(path_or_model, dtype=dtype, trust_remote_code=trust_remote_code)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    saved = is_value_config(config)
    if not saved:
        kwargs["config"] = _value_config(config)
    with torch.random.fork_rng(devices=[]), _quiet_load_report():  # a missing head is drawn from the global RNG
        model, info = AutoModelForTokenClassification.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(info.get("missing_keys", ()))
    body = [key for key in missing if not key.startswith(f"{HEAD}.")]
    if body:
        raise ValueError(
            f"{path}: the checkpoint lacks {len(body)} of the model's weights ({', '.join(body[:3])}"
            f"{', ...' if len(body) > 3 else ''}): not this architecture's causal LM or value model"
        )
    if missing:  # the head of a causal LM checkpoint: drawn from the seed (the LM head is not used)
        init_value_head(model, seed)
    model.config.use_cache = False
    return model.to(device)
