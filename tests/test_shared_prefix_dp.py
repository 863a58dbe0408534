"""``use_prefix_grouper`` under data parallelism (gloo processes on CPU, DDP=2 and FSDP2=2): the update of the
shared-prompt rollout equals the one-process update (1e-10 relative, ``tests/test_engine_dp.py``'s bound),
with a prompt group cut across the ranks and its prompt computed on both."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from splitproof.engine import UpdateConfig, update_policy
from splitproof.engine.launch import run_data_parallel
from splitproof.engine.plan import plan_update

from .engine_helpers import (
    BUDGET,
    NO_CLIP,
    REL,
    assert_metrics_close,
    flat,
    loss_config,
    make_model,
    rel_diff,
    run_update,
    run_wrapped_cases,
)
from .test_shared_prefix import shared_prompt_rollout

pytestmark = pytest.mark.dist

WORLD = 2


def _cases(model):
    batch = shared_prompt_rollout(model)
    common = dict(ppo_mini_batch_size=len(batch), grad_clip=NO_CLIP, use_prefix_grouper=True)
    return {
        "micro2": (
            batch,
            UpdateConfig(loss=loss_config("vanilla", "token-mean"), ppo_micro_batch_size_per_gpu=2, **common),
            "sgd",
        ),
        "budget": (
            batch,
            UpdateConfig(
                loss=loss_config("geo_mean", "seq-mean-token-mean"),
                use_dynamic_bsz=True,
                ppo_max_token_len_per_gpu=BUDGET,
                **common,
            ),
            "adamw",
        ),
    }


def _worker(wrapper, model, cases):
    out = {
        name: (state, [r.metrics for r in results])
        for name, (state, results) in run_wrapped_cases(update_policy, wrapper, model, cases).items()
    }
    dist.barrier()
    return out


@pytest.mark.parametrize("wrapper", ("ddp", "fsdp2"))
def test_prefix_grouper_under_data_parallel_matches_one_process(wrapper):
    model = make_model("llama", torch.float64)
    cases = _cases(model)
    batch, cfg, _ = cases["micro2"]
    shards = [plan_update(batch.validate(), cfg, WORLD, r)[0].shard for r in range(WORLD)]
    assert set(batch.index[shards[0]].tolist()) & set(batch.index[shards[1]].tolist())  # a group on both ranks
    ranks = run_data_parallel(_worker, WORLD, wrapper, model, cases, timeout=240)
    theta0 = flat(model.state_dict())
    for name, (b, c, optimizer) in cases.items():
        single, results = run_update(model, b, c, optimizer=optimizer)
        plain, _ = run_update(model, b, replace(c, use_prefix_grouper=False), optimizer=optimizer)
        assert rel_diff(single, plain, theta0) <= REL, name
        for rank, out in enumerate(ranks):
            params, metrics = out[name]
            assert rel_diff(single, params, theta0) <= REL, f"{wrapper} {name} rank {rank}"
            for a, m in zip([r.metrics for r in results], metrics):
                assert_metrics_close(a, m, label=f"{wrapper} {name} rank {rank}")
