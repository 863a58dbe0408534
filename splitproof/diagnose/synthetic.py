"""A synthetic rollout batch for a model: random tokens, GRPO-style advantages, noisy old log-probs.

Everything random comes from a local generator seeded by ``seed``; the global RNG is never used.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.engine.logprobs import compute_log_probs
from splitproof.hf_models import vocab_size_of


def _param_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    return torch.get_default_dtype(), torch.device("cpu")


def group_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """GRPO: (r - mean) / (std + 1e-6) within consecutive groups (unbiased std; 0 for a group of one)."""
    out = torch.zeros_like(rewards)
    for start in range(0, len(rewards), group_size):
        r = rewards[start : start + group_size]
        std = r.std() if len(r) > 1 else torch.zeros((), dtype=r.dtype)
        out[start : start + group_size] = (r - r.mean()) / (std + 1e-6)
    return out


def synthetic_rollout(
    model: nn.Module,
    num_sequences: int,
    prompt_length: int,
    response_length: int,
    *,
    seed: int = 0,
    group_size: int = 4,
    vary_lengths: bool = True,
    with_ref: bool = True,
    with_is_weights: bool = False,
    full_length: bool = False,
) -> RolloutBatch:
    """A RolloutBatch of ``num_sequences`` random sequences for ``model``.

    Prompts: lengths in [prompt_length // 2, prompt_length], left-padded. Responses: lengths in
    [1, response_length], right-padded (all full with ``full_length``; ``vary_lengths=False`` makes every
    prompt and response full). old_log_probs = the model's log-probs + N(0, 0.1^2) noise, so ratios != 1.
    Advantages: a random 0/1 reward per sequence, group-normalised, per token; ``index`` holds each
    sequence's group (consecutive groups of ``group_size``). Padding holds zeros.
    """
    if num_sequences < 1 or prompt_length < 1 or response_length < 1 or group_size < 1:
        raise ValueError("num_sequences, prompt_length, response_length and group_size must be >= 1")
    g = torch.Generator().manual_seed(seed)
    B, P, T = num_sequences, prompt_length, response_length
    vocab = vocab_size_of(model)
    dtype, device = _param_dtype_device(model)

    if vary_lengths:
        prompt_lens = torch.randint(max(1, P // 2), P + 1, (B,), generator=g)
    else:
        prompt_lens = torch.full((B,), P)
    if vary_lengths and not full_length:
        resp_lens = torch.randint(1, T + 1, (B,), generator=g)
    else:
        resp_lens = torch.full((B,), T)
    prompt_att = torch.arange(P)[None, :] >= (P - prompt_lens)[:, None]  # left padding
    resp_att = torch.arange(T)[None, :] < resp_lens[:, None]  # right padding
    prompts = torch.randint(0, vocab, (B, P), generator=g) * prompt_att
    responses = torch.randint(0, vocab, (B, T), generator=g) * resp_att

    rewards = torch.randint(0, 2, (B,), generator=g).double()
    advantages = group_advantages(rewards, group_size)[:, None].expand(B, T)
    zeros = torch.zeros(B, T, dtype=torch.float64)
    advantages = torch.where(resp_att, advantages, zeros)
    old_noise = 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_noise = 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    is_noise = torch.randn(B, T, generator=g, dtype=torch.float64)

    batch = RolloutBatch(
        prompts=prompts.to(device),
        responses=responses.to(device),
        attention_mask=torch.cat([prompt_att, resp_att], dim=1).long().to(device),
        response_mask=resp_att.long().to(device),
        old_log_probs=torch.zeros(B, T, dtype=dtype, device=device),
        advantages=advantages.to(dtype=dtype, device=device),
        seq_ids=torch.arange(B, device=device),
        index=(torch.arange(B) // group_size).to(device),
    )
    logp, _ = compute_log_probs(model, batch, micro_batch_size=B)
    logp = logp.double().cpu()
    batch.old_log_probs = torch.where(resp_att, logp + old_noise, zeros).to(dtype=dtype, device=device)
    if with_ref:
        ref = batch.old_log_probs.double().cpu() + ref_noise
        batch.ref_log_probs = torch.where(resp_att, ref, zeros).to(dtype=dtype, device=device)
    if with_is_weights:
        w = torch.exp(0.1 * is_noise)
        batch.rollout_is_weights = torch.where(resp_att, w, zeros).to(dtype=dtype, device=device)
    return batch


def with_critic_targets(
    batch: RolloutBatch, critic: nn.Module, *, seed: int = 0, value_noise: float = 0.2, return_noise: float = 1.0
) -> RolloutBatch:
    """``batch`` with the critic's inputs: ``values`` = the critic's own predictions + N(0, value_noise²)
    (so that a cliprange of that order binds on some tokens) and ``returns`` = its predictions +
    N(0, return_noise²). Per-token fields in the batch's dtype; padding holds zeros."""
    from splitproof.engine.values import compute_values

    g = torch.Generator().manual_seed(seed)
    v = compute_values(critic, batch, micro_batch_size=len(batch)).double().cpu()
    shape, valid = v.shape, batch.response_mask.bool().cpu()
    zeros = torch.zeros(shape, dtype=torch.float64)
    values = v + value_noise * torch.randn(shape, generator=g, dtype=torch.float64)
    returns = v + return_noise * torch.randn(shape, generator=g, dtype=torch.float64)
    dtype, device = batch.old_log_probs.dtype, batch.old_log_probs.device
    batch.values = torch.where(valid, values, zeros).to(dtype=dtype, device=device)
    batch.returns = torch.where(valid, returns, zeros).to(dtype=dtype, device=device)
    return batch
