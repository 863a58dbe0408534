"""Padding-free microbatches (use_remove_padding): same log-probs, same update, less padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.engine import UpdateConfig
from splitproof.engine.launch import run_data_parallel
from splitproof.engine.logprobs import response_log_probs
from splitproof.engine.microbatch import budget_microbatches
from splitproof.engine.packing import pack_into_rows, packed_cost, row_width

from .engine_helpers import flat, full_state, loss_config, make_model, make_rollout, rel_diff, run_update


@settings(max_examples=80)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40))
def test_pack_into_rows_places_every_sequence_once_within_the_width(lengths):
    """The row width bounds attention cost (≤ 3 × longest); the cost the planner sees is the layout's."""
    width = row_width(lengths)
    assert max(lengths) <= width <= 3 * max(lengths)
    rows = pack_into_rows(lengths, width)
    assert sorted(k for row in rows for k in row) == list(range(len(lengths)))
    assert all(sum(lengths[k] for k in row) <= width for row in rows)
    assert packed_cost(lengths) == len(rows) * width
    for other in {max(lengths), 2 * max(lengths)}:  # the chosen width computes no more than these
        if other < sum(lengths):
            assert len(rows) * width <= len(pack_into_rows(lengths, other)) * other


@settings(max_examples=60)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=40), st.integers(60, 400))
def test_packed_budget_bounds_what_is_computed(lengths, budget):
    rows = list(range(len(lengths)))
    micro = budget_microbatches(rows, lengths, budget, packed=True)
    assert sorted(r for mb in micro for r in mb) == rows
    for mb in micro:
        assert packed_cost([lengths[r] for r in mb]) <= budget


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_log_probs_equal_padded_ones_in_float64(arch):
    model = make_model(arch, seed=2)
    batch = make_rollout(model, 10, 10, 16, seed=3, holes=False)
    with torch.no_grad():
        padded, h_padded = response_log_probs(model, batch, temperature=0.8, with_entropy=True)
        packed, h_packed = response_log_probs(model, batch, temperature=0.8, with_entropy=True, packed=True)
    assert float((padded - packed).abs().max()) <= 1e-12
    assert float((h_padded - h_packed).abs().max()) <= 1e-12
    grads = []
    for flag in (False, True):
        model.zero_grad()
        lp, _ = response_log_probs(model, batch, packed=flag)
        (lp * batch.advantages).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-10 * float(grads[0].abs().max())


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", seed=6)
    batch = make_rollout(model, 8, 8, 12, seed=7)
    return model, batch, flat(full_state(model))


@pytest.mark.parametrize("loss_mode,agg_mode", [("vanilla", "token-mean"), ("geo_mean", "seq-mean-token-sum"),
                                                ("kl_cov", "seq-mean-token-mean"), ("clip_cov", "token-sum")])
def test_packed_update_equals_padded_update(setup, loss_mode, agg_mode):
    model, batch, theta0 = setup
    base = dict(loss=loss_config(loss_mode, agg_mode), ppo_mini_batch_size=8, grad_clip=1e9)
    reference, _ = run_update(model, batch, UpdateConfig(**base))
    for extra in (dict(ppo_micro_batch_size_per_gpu=3), dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40)):
        params, _ = run_update(model, batch, UpdateConfig(**base, use_remove_padding=True, **extra))
        assert rel_diff(params, reference, theta0) <= 1e-10


def _dp_worker(model, batch, wrapper):
    from splitproof.engine import wrap_model

    model = wrap_model(model, wrapper)
    config = UpdateConfig(loss=loss_config("kl_cov", "token-mean"), ppo_mini_batch_size=8, grad_clip=1e9,
                          use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40)
    params, _ = run_update(model, batch, config, copy_model=False)
    return params


@pytest.mark.dist
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_packed_update_under_data_parallel(setup, wrapper):
    model, batch, theta0 = setup
    reference, _ = run_update(model, batch, UpdateConfig(loss=loss_config("kl_cov", "token-mean"),
                                                         ppo_mini_batch_size=8, grad_clip=1e9))
    ranks = run_data_parallel(_dp_worker, 2, model, batch, wrapper, timeout=120)
    assert rel_diff(ranks[0], reference, theta0) <= 1e-10
