"""The policy and its tokenizer: the built-in character model, or a local Hugging Face checkpoint.

Nothing is downloaded: ``actor_rollout_ref.model.path`` is a local directory (or the built-in model).
Remote code runs only with ``trust_remote_code: true``.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ...hf_models import load_causal_lm, unwrap
from ...loss_config import ConfigError
from ..config.schema import BUILTIN_MODEL

MODEL_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


def autocast_dtype(precision) -> torch.dtype | None:
    """The dtype ``engine.precision.compute_in`` computes a model of ``precision`` in; None: its own."""
    return MODEL_DTYPES[precision.compute] if precision.mixed else None


def model_directory(path: str, key: str = "actor_rollout_ref.model.path") -> str:
    """The local directory of a model path (the built-in model's ships in the package); ``key`` names the
    config key in the error."""
    if path == BUILTIN_MODEL:
        from ...builtin import charlm_directory

        return charlm_directory()
    expanded = os.path.expanduser(path)
    if not os.path.isdir(expanded):
        raise ConfigError(key, f"{path!r} is not a local directory (models are never downloaded)")
    return expanded


def load_tokenizer(model_cfg):
    """``AutoTokenizer`` from ``tokenizer_path`` or the model's directory; ``custom_chat_template`` applied."""
    from transformers import AutoTokenizer

    path = model_cfg.tokenizer_path or model_directory(model_cfg.path)
    if model_cfg.tokenizer_path and not os.path.isdir(os.path.expanduser(path)):
        raise ConfigError("actor_rollout_ref.model.tokenizer_path", f"{path!r} is not a local directory")
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.expanduser(path), local_files_only=True, trust_remote_code=model_cfg.trust_remote_code
    )
    if model_cfg.custom_chat_template:
        tokenizer.chat_template = model_cfg.custom_chat_template
    if tokenizer.eos_token_id is None:
        raise ConfigError("actor_rollout_ref.model.path", f"the tokenizer at {path!r} has no eos token")
    return tokenizer


def load_policy(
    model_cfg, *, dtype: torch.dtype, vocab_size: int | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """The causal LM in ``dtype`` on ``device``, dropout as its config says, gradient checkpointing if asked."""
    model = load_causal_lm(
        model_directory(model_cfg.path), dtype=dtype, device=device, trust_remote_code=model_cfg.trust_remote_code
    )
    return _prepared(model, model_cfg, vocab_size, "actor_rollout_ref.model.path")


def load_value_model(
    model_cfg, *, dtype: torch.dtype, seed: int, vocab_size: int | None = None, device: torch.device | str = "cpu"
) -> nn.Module:
    """The critic: ``critic.model.path``'s architecture with a scalar head (``num_labels=1``, seeded by
    ``seed``) in ``dtype`` on ``device``, gradient checkpointing if asked."""
    from ...value_model import value_model_from_pretrained

    key = "critic.model.path"
    model = value_model_from_pretrained(
        model_directory(model_cfg.path, key),
        dtype=dtype,
        seed=seed,
        device=device,
        trust_remote_code=model_cfg.trust_remote_code,
    )
    return _prepared(model, model_cfg, vocab_size, key)


def _prepared(model: nn.Module, model_cfg, vocab_size: int | None, key: str) -> nn.Module:
    embeddings = model.get_input_embeddings().weight.shape[0]
    if vocab_size is not None and vocab_size > embeddings:
        raise ConfigError(key, f"the tokenizer has {vocab_size} tokens but the model only {embeddings} embeddings")
    if model_cfg.enable_gradient_checkpointing:  # transformers >= 5 names it activation checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    return model


def frozen_copy(model: nn.Module) -> nn.Module:
    """A no-grad, eval-mode copy of a (possibly DDP-wrapped) model: the reference, an FSDP2 inference copy."""
    import copy

    clone = copy.deepcopy(unwrap(model)).eval()
    for p in clone.parameters():
        p.requires_grad_(False)
    return clone


def refresh_copy(model: nn.Module, copy: nn.Module | None, *, trainable_only: bool = False) -> None:
    """Load a wrapped model's full weights into its plain inference copy (FSDP2: every rank takes part).
    ``trainable_only`` (LoRA) gathers and copies the trainable parameters alone: the copy's frozen base
    was copied from the model before sharding and neither is ever written, so it is already equal."""
    if copy is None:
        return
    if trainable_only:
        targets = dict(copy.named_parameters())
        with torch.no_grad():
            for name, p in model.named_parameters():  # the same order on every rank: one gather each
                if p.requires_grad:
                    targets[name].copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    copy.load_state_dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))


def generation_eos_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a response: the tokenizer's eos and the model's generation config's."""
    ids = []
    for source in (tokenizer.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if source is None:
            continue
        ids.extend(source if isinstance(source, (list, tuple)) else [source])
    return sorted({int(i) for i in ids})
