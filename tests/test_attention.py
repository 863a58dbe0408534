"""Attention implementations: sdpa and eager get masks they apply; others are refused before anything runs.

Eager attention adds its mask to the scores and runs its softmax in float32 (even in a float64 model), so
eager results agree with sdpa's and with themselves across microbatches to float32 rounding of the
attention weights: measured 2e-8 (float64 model) and 1e-6 (float32 model) on log-probs of size ~5.
"""

from __future__ import annotations

import pytest
import torch

from splitproof.engine import UpdateConfig, compute_log_probs, update_policy
from splitproof.engine.logprobs import response_log_probs
from splitproof.hf_models import tiny_causal_lm
from splitproof.loss_config import ConfigError

from .engine_helpers import flat, loss_config, make_optimizer, make_rollout, rel_diff, run_update
from .test_packing import LAYOUTS, layout_batch

EAGER_TOL = {torch.float64: 1e-6, torch.float32: 1e-5}  # 50x and 10x the measured float32-softmax floor


def models(dtype):
    return (
        tiny_causal_lm("llama", dtype=dtype, seed=1, attn_implementation="eager"),
        tiny_causal_lm("llama", dtype=dtype, seed=1, attn_implementation="sdpa"),
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_eager_padded_and_packed_log_probs(dtype):
    """Left-padded rows share microbatches (float64 eager used to give NaN at padding, reaching real rows),
    and packed rows get an additive mask (a boolean one is added as 0/1: no causal or sequence masking)."""
    eager, sdpa = models(dtype)
    batch = make_rollout(sdpa, 8, 8, 12, seed=2, holes=False)
    with torch.no_grad():
        padded, _ = response_log_probs(eager, batch)
        packed, _ = response_log_probs(eager, batch, packed=True)
        reference, _ = response_log_probs(sdpa, batch)
        alone, _ = compute_log_probs(eager, batch, micro_batch_size=1)
    tol = EAGER_TOL[dtype]
    assert torch.isfinite(padded).all() and torch.isfinite(packed).all()
    assert float((padded - reference).abs().max()) <= tol
    assert float((packed - reference).abs().max()) <= tol
    assert float((alone - padded).abs().max()) <= tol


def test_eager_handles_every_accepted_layout():
    eager, sdpa = models(torch.float64)
    batch = layout_batch(sdpa, LAYOUTS)
    with torch.no_grad():
        reference, _ = response_log_probs(sdpa, batch)
        for packed in (False, True):
            logp, _ = response_log_probs(eager, batch, packed=packed)
            assert float((logp - reference).abs().max()) <= EAGER_TOL[torch.float64], packed


def test_eager_update_matches_sdpa_update():
    eager, sdpa = models(torch.float64)
    batch = make_rollout(sdpa, 8, 8, 12, seed=3)
    theta0 = flat(sdpa.state_dict())
    base = dict(loss=loss_config("vanilla", "seq-mean-token-mean"), ppo_mini_batch_size=8, grad_clip=1e9)
    reference, _ = run_update(sdpa, batch, UpdateConfig(**base))
    for extra in (
        dict(ppo_micro_batch_size_per_gpu=3),
        dict(use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40),
    ):
        params, (result,) = run_update(eager, batch, UpdateConfig(**base, **extra))
        assert torch.isfinite(params).all() and not result.skipped
        assert rel_diff(params, reference, theta0) <= 1e-5, extra


@pytest.mark.parametrize("implementation", ["flash_attention_2", "flex_attention", "paged|sdpa"])
def test_other_attention_implementations_are_refused_before_anything_runs(implementation):
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=1)
    batch = make_rollout(model, 4, 4, 6, seed=1, holes=False)
    model.config._attn_implementation = implementation
    before = flat(model.state_dict())
    optimizer = make_optimizer(model, "adamw")
    with pytest.raises(ConfigError, match="attn_implementation") as info:
        update_policy(
            model, optimizer, batch, UpdateConfig(loss=loss_config("vanilla", "token-mean"), ppo_mini_batch_size=4)
        )
    assert info.value.field == "attn_implementation"
    assert implementation in str(info.value) and "attn_implementation='sdpa'" in str(info.value)
    assert torch.equal(flat(model.state_dict()), before) and not optimizer.state
    with pytest.raises(ConfigError, match="attn_implementation"):
        compute_log_probs(model, batch, micro_batch_size=4)
