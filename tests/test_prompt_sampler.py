import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from splitproof.rl.data.prompts import PromptSampler, epoch_seed, prompt_order


def batches(sampler, k):
    return [sampler.next_batch() for _ in range(k)]


def test_each_epoch_is_a_permutation_with_the_incomplete_batch_dropped():
    sampler = PromptSampler(num_rows=10, batch_size=4, seed=7)
    assert sampler.batches_per_epoch == 2
    epoch0 = batches(sampler, 2)
    assert sampler.epoch == 0
    epoch1 = batches(sampler, 2)
    assert sampler.epoch == 1
    order0, order1 = prompt_order(10, 7, 0), prompt_order(10, 7, 1)
    assert sorted(order0) == list(range(10)) and order0 != order1
    assert sum(epoch0, []) == order0[:8]  # the last 2 uids of the epoch never form a batch
    assert sum(epoch1, []) == order1[:8]


def test_same_seed_same_batches_other_seed_other_batches():
    a = batches(PromptSampler(50, 8, seed=3), 12)
    assert a == batches(PromptSampler(50, 8, seed=3), 12)
    assert a != batches(PromptSampler(50, 8, seed=4), 12)


def test_order_depends_on_seed_and_epoch_only():
    # a sampler resumed at epoch 2 from nothing but the state gets the batches a running sampler gets
    running = PromptSampler(9, 3, seed=11)
    batches(running, 6)
    fresh = PromptSampler(9, 3, seed=11)
    fresh.load_state_dict({"epoch": 2, "cursor": 0})
    assert batches(fresh, 3) == batches(running, 3)
    assert epoch_seed(11, 2) == epoch_seed(11, 2) != epoch_seed(11, 3)
    assert 0 <= epoch_seed(2**62, 10**9) < 2**63


def test_no_shuffle_keeps_file_order_every_epoch():
    sampler = PromptSampler(7, 3, seed=0, shuffle=False)
    assert batches(sampler, 4) == [[0, 1, 2], [3, 4, 5], [0, 1, 2], [3, 4, 5]]


@given(
    num_rows=st.integers(1, 40),
    batch_size=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    before=st.integers(0, 15),
    after=st.integers(1, 10),
)
def test_resume_mid_run_continues_exactly(num_rows, batch_size, seed, shuffle, before, after):
    assume(batch_size <= num_rows)
    original = PromptSampler(num_rows, batch_size, seed, shuffle)
    batches(original, before)
    state = original.state_dict()
    resumed = PromptSampler(num_rows, batch_size, seed, shuffle)
    resumed.load_state_dict(dict(state))
    assert batches(resumed, after) == batches(original, after)


def test_bad_arguments_and_mismatched_state():
    with pytest.raises(ValueError, match="fewer than one batch of 8"):
        PromptSampler(5, 8, seed=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        PromptSampler(5, 0, seed=0)
    sampler = PromptSampler(20, 4, seed=1)
    state = PromptSampler(20, 4, seed=2).state_dict()
    with pytest.raises(ValueError, match="saved seed=2 differs from this run's 1"):
        sampler.load_state_dict(state)
    with pytest.raises(ValueError, match="invalid saved position"):
        sampler.load_state_dict({"epoch": 0, "cursor": 3})
