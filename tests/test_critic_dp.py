"""The critic's update under data parallelism: real gloo processes on CPU, DDP and FSDP2 with two ranks,
each equal to the same update on one process (float64 tiny Llama, 1e-10 relative to
the update, metrics to 1e-10). Bad input fails on every rank with the same named error."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from splitproof.engine import CriticUpdateConfig, update_critic, wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.loss_config import AGG_MODES

from .critic_helpers import critic_rollout, make_models, run_critic
from .engine_helpers import (
    BUDGET,
    NO_CLIP,
    REL,
    assert_metrics_close,
    flat,
    full_state,
    make_optimizer,
    rel_diff,
    run_wrapped_cases,
)

pytestmark = pytest.mark.dist

WRAPPERS = ("ddp", "fsdp2")


def build_cases(policy, critic):
    """name -> (batch, CriticUpdateConfig, optimizer kind)."""
    batch = critic_rollout(policy, critic)  # 8 sequences -> shards of 4
    odd = critic_rollout(policy, critic, 7, seed=5)  # 7 sequences -> shards of 4 and 3
    cases = {}
    for agg_mode in AGG_MODES:
        cases[f"micro2/{agg_mode}"] = (
            batch,
            CriticUpdateConfig(
                ppo_mini_batch_size=8,
                ppo_micro_batch_size_per_gpu=2,
                grad_clip=NO_CLIP,
                cliprange_value=0.2,
                loss_agg_mode=agg_mode,
            ),
            "sgd",
        )
    cases["budget/packed"] = (
        batch,
        CriticUpdateConfig(
            ppo_mini_batch_size=8,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=BUDGET,
            use_remove_padding=True,
            grad_clip=NO_CLIP,
            loss_agg_mode="seq-mean-token-mean",
        ),
        "sgd",
    )
    cases["uneven"] = (
        odd,
        CriticUpdateConfig(ppo_mini_batch_size=7, ppo_micro_batch_size_per_gpu=3, grad_clip=NO_CLIP),
        "sgd",
    )
    cases["epochs"] = (
        batch,
        CriticUpdateConfig(
            ppo_mini_batch_size=2,
            rollout_n=2,
            ppo_epochs=2,
            shuffle=True,
            data_loader_seed=11,
            ppo_micro_batch_size_per_gpu=1,
            grad_clip=0.5,
        ),
        "momentum",
    )
    return cases


def _dp_worker(wrapper, critic, cases, bad):
    out = {
        name: (state, [r.metrics for r in results])
        for name, (state, results) in run_wrapped_cases(update_critic, wrapper, critic, cases).items()
    }
    wrapped = wrap_model(copy.deepcopy(critic), wrapper)
    before = flat(full_state(wrapped))
    try:
        update_critic(wrapped, make_optimizer(wrapped), bad, CriticUpdateConfig(ppo_mini_batch_size=8))
        out["bad"] = "no error"
    except Exception as exc:  # every rank must raise the same named error, nothing moved
        out["bad"] = f"{type(exc).__name__}: {exc}"
    out["bad moved"] = not torch.equal(flat(full_state(wrapped)), before)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def setup():
    policy, critic = make_models()
    cases = build_cases(policy, critic)
    single = {}
    for name, (batch, cfg, optimizer) in cases.items():
        params, results = run_critic(critic, batch, cfg, optimizer=optimizer, lr=0.02)
        single[name] = (params, [r.metrics for r in results])
    batch = cases["micro2/token-mean"][0]
    bad = replace(
        batch,
        returns=batch.returns.masked_fill(batch.response_mask.bool() & (batch.seq_ids[:, None] == 4), float("nan")),
    )
    return critic, cases, single, bad


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_data_parallel_matches_one_process(setup, wrapper):
    critic, cases, single, bad = setup
    ranks = run_data_parallel(_dp_worker, 2, wrapper, critic, cases, bad, timeout=240)
    theta0 = flat(full_state(critic))
    failures = []
    for name in cases:
        ref_params, ref_metrics = single[name]
        for rank, out in enumerate(ranks):
            params, metrics = out[name]
            diff = rel_diff(ref_params, params, theta0)
            if diff > REL:
                failures.append(f"{name} rank {rank}: parameters differ by {diff:.3e}")
            assert len(metrics) == len(ref_metrics), name
            for step, (a, b) in enumerate(zip(ref_metrics, metrics)):
                try:
                    assert_metrics_close(a, b, label=f"{name} rank {rank} step {step}")
                except AssertionError as e:
                    failures.append(str(e))
        assert torch.equal(ranks[0][name][0], ranks[1][name][0]), f"{name}: ranks disagree"
    assert not failures, "\n".join(failures[:20])
    assert ranks[0]["bad"] == ranks[1]["bad"]
    assert ranks[0]["bad"].startswith("BatchError: returns (sequence 4): non-finite"), ranks[0]["bad"]
    assert not ranks[0]["bad moved"] and not ranks[1]["bad moved"]
