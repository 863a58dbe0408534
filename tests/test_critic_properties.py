"""Property test of the critic's update (hypothesis): random aggregation modes, orders, microbatch sizes,
token budgets, packing, clipping and minibatch/epoch layouts give the same update as one microbatch
(float64, 1e-10 relative to the update; measured up to 5e-13 after four AdamW steps with clipping: Adam
normalises each entry, so an entry whose gradient is near its eps carries re-association differences)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.engine import CriticUpdateConfig
from splitproof.loss_config import AGG_MODES

from .critic_helpers import critic_rollout, make_models, run_critic
from .engine_helpers import REL, assert_metrics_close, flat, full_state, rel_diff


@pytest.fixture(scope="module")
def setup():
    policy, critic = make_models(seed=5, head_seed=2, exact_norms=True)  # several AdamW steps: see make_models
    return critic, critic_rollout(policy, critic, seed=9), flat(full_state(critic))


@settings(max_examples=30)
@given(
    agg_mode=st.sampled_from(AGG_MODES),
    order=st.permutations(range(8)),
    split=st.one_of(st.tuples(st.just("micro"), st.integers(1, 8)), st.tuples(st.just("budget"), st.integers(20, 200))),
    grad_clip=st.sampled_from([0.05, 1e9]),
    remove_padding=st.booleans(),
    cliprange_value=st.sampled_from([0.05, 0.5]),
    steps=st.sampled_from([(8, 1, False), (4, 2, True), (2, 1, True)]),
)
def test_any_split_gives_the_one_microbatch_update(
    setup, agg_mode, order, split, grad_clip, remove_padding, cliprange_value, steps
):
    critic, batch, theta0 = setup
    mini, epochs, shuffle = steps
    if mini < len(batch):
        order = list(range(len(batch)))  # several minibatches: rows, not keys, choose them (as in verl)
    common = dict(
        ppo_mini_batch_size=mini,
        ppo_epochs=epochs,
        shuffle=shuffle,
        data_loader_seed=3,
        grad_clip=grad_clip,
        cliprange_value=cliprange_value,
        loss_agg_mode=agg_mode,
    )
    base_params, base_steps = run_critic(critic, batch, CriticUpdateConfig(**common), optimizer="adamw")
    kind, size = split
    common["use_remove_padding"] = remove_padding
    if kind == "micro":
        config = CriticUpdateConfig(**common, ppo_micro_batch_size_per_gpu=size)
    else:
        longest = int(batch.token_lengths().max())
        config = CriticUpdateConfig(**common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=max(size, longest + 1))
    params, steps_run = run_critic(critic, batch.select(list(order)), config, optimizer="adamw")
    assert rel_diff(params, base_params, theta0) <= REL
    assert len(steps_run) == len(base_steps)
    for a, b in zip(steps_run, base_steps):
        assert_metrics_close(a.metrics, b.metrics, label=f"{agg_mode}/{split}")
