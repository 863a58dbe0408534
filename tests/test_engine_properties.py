"""Property test of the whole engine (hypothesis): random loss and aggregation modes, random orders,
microbatch sizes, token budgets, packing and clipping thresholds give the one-microbatch update (float64,
1e-10)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.engine import UpdateConfig
from splitproof.loss_config import AGG_MODES, LOSS_MODES

from .engine_helpers import (
    assert_metrics_close,
    flat,
    full_state,
    loss_config,
    make_model,
    make_rollout,
    rel_diff,
    run_update,
)


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", seed=5)
    return model, make_rollout(model, seed=9), flat(full_state(model))


@settings(max_examples=30)
@given(
    loss_mode=st.sampled_from(LOSS_MODES),
    agg_mode=st.sampled_from(AGG_MODES),
    order=st.permutations(range(8)),
    split=st.one_of(st.tuples(st.just("micro"), st.integers(1, 8)), st.tuples(st.just("budget"), st.integers(20, 200))),
    grad_clip=st.sampled_from([0.05, 1e9]),
    strategy=st.sampled_from(["prepass", "deferred"]),
    remove_padding=st.booleans(),
)
def test_any_split_gives_the_one_microbatch_update(
    setup, loss_mode, agg_mode, order, split, grad_clip, strategy, remove_padding
):
    model, batch, theta0 = setup
    loss = loss_config(loss_mode, agg_mode)
    common = dict(loss=loss, ppo_mini_batch_size=len(batch), grad_clip=grad_clip, cov_strategy=strategy)
    base_params, base_steps = run_update(model, batch, UpdateConfig(**common))
    kind, size = split
    common["use_remove_padding"] = remove_padding
    if kind == "micro":
        config = UpdateConfig(**common, ppo_micro_batch_size_per_gpu=size)
    else:
        longest = int(batch.token_lengths().max())
        config = UpdateConfig(**common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=max(size, longest + 1))
    params, steps = run_update(model, batch.select(list(order)), config)
    assert rel_diff(params, base_params, theta0) <= 1e-10
    assert_metrics_close(steps[0].metrics, base_steps[0].metrics, label=f"{loss_mode}/{agg_mode}/{split}")
