"""Minibatch schedule, DP shards and microbatches: coverage, budgets, determinism."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.batch import BatchError
from splitproof.engine.microbatch import (
    budget_microbatches,
    fixed_microbatches,
    minibatch_schedule,
    pad_microbatches,
    shard_rows,
)

# ---- minibatch_schedule ----


def test_schedule_identity_without_shuffle():
    assert minibatch_schedule(6, 2) == [[0, 1], [2, 3], [4, 5]]
    assert minibatch_schedule(4, 4, epochs=2) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_schedule_shuffle_is_seeded_per_epoch():
    a = minibatch_schedule(16, 4, epochs=3, shuffle=True, seed=7)
    assert a == minibatch_schedule(16, 4, epochs=3, shuffle=True, seed=7)
    assert a != minibatch_schedule(16, 4, epochs=3, shuffle=True, seed=8)
    epochs = [sum(a[i : i + 4], []) for i in range(0, 12, 4)]
    assert all(sorted(e) == list(range(16)) for e in epochs)
    assert epochs[0] != epochs[1]  # a fresh permutation each epoch
    # epoch e of a longer run is the same as epoch e of a shorter one
    assert minibatch_schedule(16, 4, epochs=1, shuffle=True, seed=7) == a[:4]


def test_schedule_leaves_global_rng_alone():
    import torch

    state = torch.get_rng_state()
    minibatch_schedule(32, 8, epochs=2, shuffle=True)
    assert torch.equal(state, torch.get_rng_state())


@pytest.mark.parametrize("n, size", [(10, 3), (8, 0), (8, 9), (0, 1)])
def test_schedule_errors(n, size):
    with pytest.raises(BatchError) as err:
        minibatch_schedule(n, size)
    assert err.value.field == "ppo_mini_batch_size"


def test_schedule_epochs_error():
    with pytest.raises(BatchError, match="ppo_epochs"):
        minibatch_schedule(8, 4, epochs=0)


# ---- shard_rows ----


def test_shard_rows_snake_balanced():
    rows = [10, 11, 12, 13, 14, 15]
    lengths = [1, 2, 3, 4, 5, 6]
    # longest first: 15, 14, 13, 12, 11, 10 -> ranks 0, 1, 1, 0, 0, 1
    assert shard_rows(rows, lengths, 2) == [[11, 12, 15], [10, 13, 14]]  # 21 and 18 tokens
    assert shard_rows(rows, lengths, 1) == [rows]
    assert shard_rows([3], [5], 4) == [[3], [], [], []]
    assert shard_rows([], [], 2) == [[], []]


def test_shard_rows_checks_lengths():
    with pytest.raises(ValueError, match="lengths"):
        shard_rows([0, 1], [3], 2)


# ---- fixed / budget microbatches ----


def test_fixed_microbatches():
    assert fixed_microbatches([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7], [8]]
    assert fixed_microbatches([], 3) == []
    with pytest.raises(BatchError, match="ppo_micro_batch_size_per_gpu"):
        fixed_microbatches([1], 0)


def test_budget_microbatches_example():
    rows = [0, 1, 2, 3, 4]
    lengths = [10, 40, 20, 20, 5]
    # sorted: 1(40), 2(20), 3(20), 0(10), 4(5); budget 60 -> [1], [2, 3, 0] (3 x 20 = 60), [4] (4 x 20 > 60)
    assert budget_microbatches(rows, lengths, 60) == [[1], [0, 2, 3], [4]]
    assert budget_microbatches(rows, lengths, 200) == [[0, 1, 2, 3, 4]]
    assert budget_microbatches([], [], 10) == []


def test_budget_too_long_sequence_names_it():
    with pytest.raises(BatchError) as err:
        budget_microbatches([0, 1, 2], [5, 30, 7], 20, seq_ids=[100, 101, 102])
    assert err.value.field == "ppo_max_token_len_per_gpu"
    assert err.value.sequence == 101
    assert "30 tokens > budget 20" in str(err.value)
    with pytest.raises(BatchError, match="ppo_max_token_len_per_gpu"):
        budget_microbatches([0], [1], 0)


def test_pad_microbatches():
    assert pad_microbatches([[1, 2]], 3) == [[1, 2], [], []]
    assert pad_microbatches([], 1) == [[]]
    with pytest.raises(ValueError):
        pad_microbatches([[1], [2]], 1)


# ---- properties ----


@st.composite
def minibatches(draw):
    n = draw(st.integers(0, 40))
    rows = draw(st.permutations(list(range(n))))
    lengths = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    return list(rows), lengths


@settings(max_examples=150, deadline=None)
@given(minibatches(), st.integers(1, 5), st.integers(64, 300), st.integers(1, 6))
def test_every_row_once_and_budget_respected(mb, dp_size, budget, size):
    rows, lengths = mb
    length_of = dict(zip(rows, lengths))
    shards = shard_rows(rows, lengths, dp_size)
    assert len(shards) == dp_size
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    budget_plan, fixed_plan = [], []
    for shard in shards:
        assert shard == sorted(shard)
        micro = budget_microbatches(shard, [length_of[r] for r in shard], budget)
        for m in micro:
            assert m and m == sorted(m)
            assert len(m) * max(length_of[r] for r in m) <= budget
        budget_plan.append(micro)
        fixed_plan.append(fixed_microbatches(shard, size))
    for plan in (budget_plan, fixed_plan):
        seen = [r for micro in plan for m in micro for r in m]
        assert sorted(seen) == sorted(rows)
        count = max(len(micro) for micro in plan)
        padded = [pad_microbatches(micro, count) for micro in plan]
        assert all(len(p) == count for p in padded)
        assert sorted(r for p in padded for m in p for r in m) == sorted(rows)


@settings(max_examples=100, deadline=None)
@given(minibatches(), st.integers(1, 300))
def test_budget_plan_depends_on_the_set_not_the_order(mb, budget):
    rows, lengths = mb
    reordered = list(zip(rows, lengths))[::-1]
    try:
        a = budget_microbatches(rows, lengths, budget)
    except BatchError:
        with pytest.raises(BatchError):
            budget_microbatches([r for r, _ in reordered], [length for _, length in reordered], budget)
        return
    b = budget_microbatches([r for r, _ in reordered], [length for _, length in reordered], budget)
    assert a == b
    assert a == budget_microbatches(rows, lengths, budget)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 3), st.booleans(), st.integers(0, 2**40))
def test_schedule_never_depends_on_dp_size(k, size, epochs, shuffle, seed):
    n = k * size
    a = minibatch_schedule(n, size, epochs=epochs, shuffle=shuffle, seed=seed)
    assert a == minibatch_schedule(n, size, epochs=epochs, shuffle=shuffle, seed=seed)
    assert len(a) == k * epochs and all(len(m) == size for m in a)
    # the schedule takes no dp_size: sharding any minibatch over D ranks covers exactly it
    for dp_size in (1, 2, 3):
        for m in a:
            shards = shard_rows(m, [r % 7 for r in m], dp_size)
            assert sorted(r for s in shards for r in s) == sorted(m)


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 20), st.integers(1, 40)), min_size=1, max_size=30), st.integers(60, 400))
def test_budget_bounds_the_padded_tokens_computed(pairs, budget):
    """With prompts left-padded and responses right-padded, a microbatch computes rows × (max p + max r)."""
    rows = list(range(len(pairs)))
    prompts = [p for p, _ in pairs]
    lengths = [p + r for p, r in pairs]
    micro = budget_microbatches(rows, lengths, budget, prompt_lengths=prompts)
    assert sorted(r for mb in micro for r in mb) == rows
    for mb in micro:
        width = max(pairs[r][0] for r in mb) + max(pairs[r][1] for r in mb)
        assert len(mb) * width <= budget
