"""The benchmark model: a tiny Llama sized for the machine (quick mode: smaller, for the smoke test only), its
one-line description, and a snapshot that restores its weights between timed variants."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchlib import Env

# Large enough that a step is mostly matrix work, small enough that every script fits its time slot on
# 2 CPU cores. Quick mode is for the smoke test only.
MODEL_FULL = dict(
    vocab_size=2048,
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=384,
    max_position_embeddings=512,
)
MODEL_QUICK = dict(
    vocab_size=128,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=256,
)


def bench_model_sizes(env: Env) -> dict:
    return dict(MODEL_QUICK if env.quick else MODEL_FULL)


def bench_model(env: Env, *, seed: int = 0):
    from splitproof.hf_models import tiny_causal_lm

    sizes = bench_model_sizes(env)
    model = tiny_causal_lm("llama", dtype=env.dtype, seed=seed, **sizes)
    return model.to(env.device).train()


def describe_model(model) -> str:
    c = model.config
    params = sum(p.numel() for p in model.parameters())
    dtype = next(model.parameters()).dtype
    return (
        f"tiny Llama: vocab {c.vocab_size}, hidden {c.hidden_size}, {c.num_hidden_layers} layers, "
        f"{c.num_attention_heads} heads / {c.num_key_value_heads} KV heads, MLP {c.intermediate_size}, "
        f"{params / 1e6:.2f} M parameters, {str(dtype).replace('torch.', '')}"
    )


class WeightSnapshot:
    """Restore the model's weights (and drop grads) so that every timed variant sees the same model."""

    def __init__(self, model):
        self.model = model
        self.saved = [p.detach().clone() for p in model.parameters()]

    def restore(self) -> None:
        with torch.no_grad():
            for p, s in zip(self.model.parameters(), self.saved):
                p.copy_(s)
                p.grad = None
