"""Shared helpers for the LoRA tests: a float64 tiny Llama with an adapter, its update, its adapter state."""

from __future__ import annotations

import copy
import warnings

import torch

from splitproof.engine import UpdateConfig, update_policy
from splitproof.lora import LoraSettings, adapter_state, apply_lora, base_digest, trainable_parameters

from .engine_helpers import BUDGET, NO_CLIP, flat, loss_config, make_model, make_rollout

SETTINGS = LoraSettings(lora_rank=4, lora_alpha=8, exclude_modules=("down_proj",))


def lora_model(seed: int = 0, settings: LoraSettings = SETTINGS):
    return apply_lora(make_model("llama", torch.float64, seed=seed), settings, seed=seed)


def lora_update(model, batch, config: UpdateConfig, *, lr: float = 0.02):
    """AdamW over the adapter alone; returns (flat adapter state after, base digest after, optimizer)."""
    opt = torch.optim.AdamW(trainable_parameters(model), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        update_policy(model, opt, batch, config)
    return flat(adapter_state(model)), base_digest(model), opt


def split_configs(num_sequences: int) -> dict[str, UpdateConfig]:
    """Three optimizer steps (minibatches of a third), each split differently; KL loss and entropy on."""
    base = dict(
        loss=loss_config("vanilla", "seq-mean-token-mean"), ppo_mini_batch_size=num_sequences // 3, grad_clip=NO_CLIP
    )
    return {
        "whole": UpdateConfig(**base),
        "micro1": UpdateConfig(**base, ppo_micro_batch_size_per_gpu=1),
        "micro3": UpdateConfig(**base, ppo_micro_batch_size_per_gpu=3),
        "budget": UpdateConfig(**base, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET),
        "packed": UpdateConfig(**base, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET, use_remove_padding=True),
    }


def rollout(model, num_sequences: int = 12):
    return make_rollout(model, num_sequences, seed=3)


def copy_of(model):
    return copy.deepcopy(model)
