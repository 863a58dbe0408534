"""Causal LMs for splitproof: tiny random Hugging Face models built from a config, and local checkpoints.

Nothing here downloads anything.
"""

from __future__ import annotations

import os

import torch
from torch import nn

ARCHS = ("llama", "qwen2", "qwen3")


def tiny_causal_lm(
    arch: str = "llama",
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    tie_word_embeddings: bool = False,
) -> nn.Module:
    """A randomly initialised HF causal LM (Llama / Qwen2 / Qwen3), deterministic given ``seed``.

    Dropout is 0, ``use_cache`` off, embeddings untied unless ``tie_word_embeddings`` (the output layer is
    then the input embedding). The global RNG is left untouched.
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    }
    if arch not in classes:
        raise ValueError(f"arch: unknown architecture {arch!r}, expected one of {ARCHS}")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads: hidden_size {hidden_size} / num_heads {num_heads} / num_kv_heads {num_kv_heads} "
            "must divide evenly"
        )
    config_cls, model_cls = classes[arch]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,  # Qwen3 would default to 128
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        attention_dropout=0.0,
        use_cache=False,
        tie_word_embeddings=tie_word_embeddings,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.config.use_cache = False
    return model


def local_checkpoint(
    path: str | os.PathLike, *, dtype: torch.dtype | None = None, trust_remote_code: bool = False
) -> tuple[str, dict]:
    """(path, ``from_pretrained`` keyword arguments) for a local checkpoint: local files only, no hub access."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist (only local checkpoints are loaded)")
    kwargs = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return path, kwargs


def load_causal_lm(
    path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path)`` from local files only (no hub access)."""
    from transformers import AutoModelForCausalLM

    path, kwargs = local_checkpoint(path, dtype=dtype, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    model.config.use_cache = False
    return model.to(device)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (``.module``); FSDP2 keeps the class, so it is returned as is."""
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def base_model_of(model: nn.Module) -> nn.Module:
    """The Hugging Face model inside DDP and PEFT (LoRA) wrappers; FSDP2 keeps the class."""
    model = unwrap(model)
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def vocab_size_of(model: nn.Module) -> int:
    """The model's vocabulary size: ``config.vocab_size``, else the output embedding's row count."""
    model = unwrap(model)
    config = getattr(model, "config", None)
    size = getattr(config, "vocab_size", None)
    if size is not None:
        return int(size)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is None or not hasattr(out, "weight"):
        raise ValueError("cannot determine the vocabulary size: no config.vocab_size and no output embedding")
    return int(out.weight.shape[0])


def max_positions_of(model: nn.Module) -> int | None:
    """The model's position limit (``max_position_embeddings``, GPT-2's ``n_positions``), if its config says."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None:
            continue
        for name in ("max_position_embeddings", "n_positions"):
            value = getattr(config, name, None)
            if isinstance(value, int) and value > 0:
                return value
        return None
    return None
