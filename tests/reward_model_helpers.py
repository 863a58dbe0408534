"""A tiny reward model (a sequence classifier over the built-in character tokenizer) saved as a Hugging
Face directory, and samples to score."""

from __future__ import annotations

import random

import torch

from .rl_helpers import save_tiny_char_model


def save_tiny_reward_model(folder, *, dtype=torch.float64, seed: int = 3) -> str:
    """A one-label sequence classifier with a random tiny Llama body and the built-in tokenizer."""
    from transformers import AutoModelForCausalLM

    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.rl.rewards.reward_model import classifier_from_causal_lm

    body = folder / "body"
    save_tiny_char_model(body, dtype=dtype, seed=seed)
    policy = AutoModelForCausalLM.from_pretrained(body, dtype=dtype)
    model = classifier_from_causal_lm(policy, seed=seed, dtype=dtype)
    out = folder / "rm"
    model.save_pretrained(out)
    char_tokenizer().save_pretrained(out)
    return str(out)


def random_samples(dataset, count: int, *, seed: int = 0, eos: int = 1) -> list:
    """``count`` samples of the dataset's prompts with random responses (some ending on EOS)."""
    from splitproof.rl.rollout.hf import Sample

    rng = random.Random(seed)
    samples = []
    for k in range(count):
        uid = k % len(dataset)
        response = [rng.randrange(3, 60) for _ in range(rng.randrange(1, 9))]
        finished = rng.random() < 0.5
        samples.append(
            Sample(uid, k // len(dataset), list(dataset[uid].prompt_ids), response + [eos] * finished, [], finished)
        )
    return samples
