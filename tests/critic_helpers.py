"""Shared helpers for the critic tests: a tiny float64 value model, rollouts with values and returns, one update."""

from __future__ import annotations

import copy
import warnings

import torch

from splitproof.batch import RolloutBatch
from splitproof.engine import CriticUpdateConfig, compute_values, update_critic
from splitproof.value_model import value_model_from_pretrained

from .engine_helpers import flat, full_state, make_model, make_optimizer, make_rollout, with_exact_norms


def make_models(
    arch: str = "llama", dtype=torch.float64, seed: int = 0, head_seed: int = 7, *, exact_norms: bool = False
):
    """(the tiny policy of ``seed``, a value model: its body with a head drawn from ``head_seed``).

    ``exact_norms``: the critic's RMSNorms compute in float64 (``engine_helpers.with_exact_norms``). Needed
    where several AdamW steps are compared: Hugging Face's RMSNorm rounds to float32 inside a float64 model,
    so the 1e-15 re-association differences of a first step can move an activation by one float32 ulp in
    the next (measured: 1.5e-8 = 2⁻²⁶ in a gradient entry), which Adam then carries into the weights.
    """
    policy = make_model(arch, dtype, seed)
    critic = value_model_from_pretrained(policy, seed=head_seed)
    return policy, (with_exact_norms(critic) if exact_norms else critic)


def with_values(
    batch: RolloutBatch, critic, *, seed: int = 3, noise: float = 0.3, nan_padding: bool = True
) -> RolloutBatch:
    """``batch`` with the critic's own predictions (plus noise, so that some tokens clip) as ``values`` and
    random ``returns``; NaN on padding, which must never reach the loss or its gradient."""
    g = torch.Generator().manual_seed(seed)
    v = compute_values(critic, batch, micro_batch_size=len(batch))
    batch = copy.copy(batch)
    batch.values = v + noise * torch.randn(v.shape, generator=g, dtype=v.dtype)
    batch.returns = v + torch.randn(v.shape, generator=g, dtype=v.dtype)
    if nan_padding:
        pad = ~batch.response_mask.bool()
        batch.values = batch.values.masked_fill(pad, float("nan"))
        batch.returns = batch.returns.masked_fill(pad, float("nan"))
    return batch


def critic_rollout(policy, critic, num_sequences: int = 8, *, seed: int = 1, **kwargs) -> RolloutBatch:
    """``make_rollout`` of the policy (a multi-turn hole, one empty sequence, varied lengths) with the
    critic's values and returns."""
    return with_values(make_rollout(policy, num_sequences, seed=seed, **kwargs), critic, seed=seed + 2)


def run_critic(
    critic,
    batch: RolloutBatch,
    config: CriticUpdateConfig,
    *,
    optimizer: str = "sgd",
    lr: float = 0.02,
    make_objective=None,
):
    """One critic update on a copy: (flattened parameters after, list[StepResult])."""
    critic = copy.deepcopy(critic)
    opt = make_optimizer(critic, optimizer, lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = update_critic(critic, opt, batch, config, make_objective=make_objective)
    return flat(full_state(critic)), results
