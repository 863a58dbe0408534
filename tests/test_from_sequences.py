"""RolloutBatch.from_sequences: plain per-sequence lists in, the engine's padded layout out, bad rows named."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from splitproof import BatchError, LossConfig, RolloutBatch
from splitproof.batch import TokenBatch
from splitproof.diagnose.synthetic import synthetic_rollout
from splitproof.engine import UpdateConfig, compute_log_probs, update_policy
from splitproof.hf_models import tiny_causal_lm
from splitproof.sequences import pad_per_token


def _unpadded(batch: RolloutBatch, field: str, row: int) -> list:
    """Row ``row`` of a per-token field, response tokens only."""
    n = int(batch.attention_mask[row, batch.prompt_width :].sum())
    return getattr(batch, field)[row, :n].tolist()


def test_layout_prompts_left_responses_right():
    batch = RolloutBatch.from_sequences(
        prompt_ids=[[5, 6, 7], [8]],
        response_ids=[[1, 2, 3, 4], [9]],
        old_log_probs=[[-1.0, -2.0, -3.0, -0.5], [-0.25]],
        advantages=[0.5, -0.5],
        response_mask=[[1, 1, 0, 1], [1]],
        ref_log_probs=[[-1.0, -1.5, -2.0, -0.5], [-0.5]],
        pad_token_id=3,
        dtype=torch.float64,
    )
    assert batch.prompts.tolist() == [[5, 6, 7], [3, 3, 8]]
    assert batch.responses.tolist() == [[1, 2, 3, 4], [9, 3, 3, 3]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 0, 1], [1, 0, 0, 0]]
    assert batch.old_log_probs.tolist() == [[-1.0, -2.0, -3.0, -0.5], [-0.25, 0.0, 0.0, 0.0]]
    assert batch.advantages.tolist() == [0.5, -0.5]  # one per sequence stays [B]
    assert batch.ref_log_probs.dtype == torch.float64 and batch.rollout_is_weights is None
    assert batch.seq_ids.tolist() == [0, 1]


def test_per_token_advantages_and_row_types():
    batch = RolloutBatch.from_sequences(
        prompt_ids=(np.array([4, 5]), torch.tensor([6])),
        response_ids=[[1, 2], []],
        old_log_probs=[np.array([-1.0, -2.0]), []],
        advantages=[[1.0, 2.0], 0.5],
        seq_ids=[10, 7],
    )
    assert batch.advantages.tolist() == [[1.0, 2.0], [0.0, 0.0]]  # per token; the empty response holds padding
    assert batch.seq_ids.tolist() == [10, 7] and batch.advantages.dtype == torch.float32


def test_critic_fields():
    batch = RolloutBatch.from_sequences(
        prompt_ids=[[4], [5, 6]],
        response_ids=[[1, 2], [3]],
        old_log_probs=[[-1.0, -1.0], [-1.0]],
        advantages=[1.0, -1.0],
        values=[[0.25, 0.5], [1.5]],
        returns=[[1.0, 2.0], [-1.0]],
    )
    assert batch.values.tolist() == [[0.25, 0.5], [1.5, 0.0]]
    assert batch.returns.tolist() == [[1.0, 2.0], [-1.0, 0.0]]
    assert batch.select([1]).values.tolist() == [[1.5, 0.0]]


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=6), st.integers(0, 2**16))
def test_every_row_comes_back_unpadded(lengths, seed):
    if not any(n for _, n in lengths):
        lengths[0] = (lengths[0][0], 1)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 50, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(0, 50, (n,), generator=g).tolist() for _, n in lengths]
    old = [(-torch.rand(n, generator=g, dtype=torch.float64)).tolist() for _, n in lengths]
    adv = [torch.randn(n, generator=g, dtype=torch.float64).tolist() for _, n in lengths]
    batch = RolloutBatch.from_sequences(prompts, responses, old, adv, dtype=torch.float64)
    assert batch.prompt_width == max(p for p, _ in lengths) and batch.response_width == max(n for _, n in lengths)
    for i, (p, n) in enumerate(lengths):
        assert batch.prompts[i, batch.prompt_width - p :].tolist() == prompts[i]
        assert int(batch.attention_mask[i].sum()) == p + n
        assert _unpadded(batch, "responses", i) == responses[i]
        assert _unpadded(batch, "old_log_probs", i) == old[i] and _unpadded(batch, "advantages", i) == adv[i]


def test_same_update_as_the_batch_it_was_read_from():
    """The synthetic batch, taken apart into lists and rebuilt: the same log-probs and the same update."""
    torch.manual_seed(0)
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=0)
    source = synthetic_rollout(model, 6, 5, 7, seed=2, with_is_weights=True)
    rows = range(len(source))
    prompt_lens = source.prompt_lengths().tolist()
    rebuilt = RolloutBatch.from_sequences(
        prompt_ids=[source.prompts[i, source.prompt_width - prompt_lens[i] :].tolist() for i in rows],
        response_ids=[_unpadded(source, "responses", i) for i in rows],
        old_log_probs=[_unpadded(source, "old_log_probs", i) for i in rows],
        advantages=[_unpadded(source, "advantages", i) for i in rows],
        ref_log_probs=[_unpadded(source, "ref_log_probs", i) for i in rows],
        rollout_is_weights=[_unpadded(source, "rollout_is_weights", i) for i in rows],
        dtype=torch.float64,
    )
    assert torch.equal(
        compute_log_probs(model, rebuilt, micro_batch_size=2)[0],
        compute_log_probs(model, source, micro_batch_size=2)[0],
    )
    config = UpdateConfig(
        loss=LossConfig(loss_mode="vanilla", use_kl_loss=True), ppo_mini_batch_size=6, ppo_micro_batch_size_per_gpu=4
    )
    results = []
    for batch in (source, rebuilt):
        copy_ = copy.deepcopy(model)
        steps = update_policy(copy_, torch.optim.SGD(copy_.parameters(), lr=0.1), batch, config)
        results.append((steps[0].metrics, [p.detach() for p in copy_.parameters()]))
    assert results[0][0] == results[1][0]
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))


GOOD = dict(
    prompt_ids=[[5, 6], [7]],
    response_ids=[[1, 2, 3], [4, 2]],
    old_log_probs=[[-1.0, -1.0, -1.0], [-1.0, -1.0]],
    advantages=[1.0, -1.0],
)


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(prompt_ids=[[5, 6], []]), "prompt_ids[1]: empty"),
        (dict(prompt_ids=[]), "prompt_ids: no sequences"),
        (dict(response_ids=[[1, 2, 3]]), "response_ids: has 1 sequences, prompt_ids has 2"),
        (dict(response_ids=[[1, 2, 3], [4.5, 2.0]]), "response_ids[1]: token ids must be integers"),
        (dict(prompt_ids=[[5, -6], [7]]), "prompt_ids[0]: negative token id -6"),
        (dict(old_log_probs=[[-1.0, -1.0, -1.0], [-1.0]]), "old_log_probs[1]: 1 values for 2 response tokens"),
        (dict(old_log_probs=[[-1.0, -1.0, -1.0], [[-1.0], [-1.0]]]), "old_log_probs[1]: must be a flat list"),
        (dict(advantages=[1.0, [1.0, 2.0, 3.0]]), "advantages[1]: 3 values for 2 response tokens"),
        (dict(advantages=[1.0, "high"]), "advantages[1]: must be a number"),
        (dict(advantages=[1.0, float("nan")]), "advantages (sequence 1): non-finite"),
        (dict(response_mask=[[1, 1, 1], [1, 2]]), "response_mask[1]: must contain only 0 and 1"),
        (dict(ref_log_probs=[[-1.0, -1.0], [-1.0, -1.0]]), "ref_log_probs[0]: 2 values for 3 response tokens"),
        (dict(rollout_is_weights=[[1.0, 1.0, 1.0], [1.0, -1.0]]), "rollout_is_weights (sequence 1): must be >= 0"),
        (dict(values=[[0.5, 0.5], [0.5, 0.5]]), "values[0]: 2 values for 3 response tokens"),
        (dict(returns=[[0.5, 0.5, 0.5], [0.5, float("inf")]]), "returns (sequence 1): non-finite"),
        (dict(seq_ids=[3, 3]), "seq_ids: canonical sequence ids must be unique"),
        (dict(seq_ids=[3]), "seq_ids: must hold one id per sequence (2)"),
        (dict(response_ids=[[], []], old_log_probs=[[], []]), "empty minibatch"),
        (dict(pad_token_id=-1), "pad_token_id: must be an integer >= 0"),
        (dict(dtype=torch.int64), "dtype: must be a floating-point torch dtype"),
    ],
)
def test_bad_input_names_the_field_and_the_row(changes, message):
    with pytest.raises(BatchError) as err:
        RolloutBatch.from_sequences(**{**GOOD, **changes})
    assert message in str(err.value)


def test_a_fixed_response_width_pads_every_row_to_it_and_names_a_longer_row():
    """``response_width`` (the RL step's ``data.max_response_length``) widens the responses; the token
    layout alone (``TokenBatch.from_sequences``) is the same padding."""
    from splitproof.batch import TokenBatch

    wide = RolloutBatch.from_sequences(**GOOD, response_width=5)
    tight = RolloutBatch.from_sequences(**GOOD)
    assert wide.response_width == 5 and tight.response_width == 3
    assert torch.equal(wide.responses[:, :3], tight.responses) and not wide.response_mask[:, 3:].any()
    assert torch.equal(wide.old_log_probs[:, :3], tight.old_log_probs) and not wide.old_log_probs[:, 3:].any()
    tokens = TokenBatch.from_sequences(GOOD["prompt_ids"], GOOD["response_ids"], response_width=5)
    for name in ("prompts", "responses", "attention_mask", "response_mask"):
        assert torch.equal(getattr(tokens, name), getattr(wide, name)), name
    with pytest.raises(BatchError, match=r"response_ids\[0\]: 3 tokens > response_width 2"):
        RolloutBatch.from_sequences(**GOOD, response_width=2)


@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=8),
    st.sampled_from([None, 5, 7]),
    st.integers(0, 2**16),
)
def test_plain_lists_take_one_pass_to_the_same_layout(lengths, width, seed):
    """Lists of Python ints / floats (the run's own samples) are laid out in one pass
    (``splitproof.flat_rows``): the same tensors as the row-by-row path that tensor rows take."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 99, (p,), generator=g) for p, _ in lengths]
    responses = [torch.randint(0, 99, (n,), generator=g) for _, n in lengths]
    values = [-torch.rand(n, generator=g, dtype=torch.float64) for _, n in lengths]
    plain = TokenBatch.from_sequences(
        [p.tolist() for p in prompts], [r.tolist() for r in responses], response_width=width
    )
    rows = TokenBatch.from_sequences(prompts, responses, response_width=width)
    for field in ("prompts", "responses", "attention_mask", "response_mask"):
        a, b = getattr(plain, field), getattr(rows, field)
        assert a.dtype == b.dtype and torch.equal(a, b), field
    n, t = [r.numel() for r in responses], rows.response_width
    for dtype in (torch.float32, torch.float64):
        fast = pad_per_token("log_probs", [v.tolist() for v in values], n, t, dtype)
        assert torch.equal(fast, pad_per_token("log_probs", values, n, t, dtype))


def test_plain_lists_with_a_bad_row_are_still_named():
    """A bool, a negative id or a float among plain ints leaves the one-pass layout: the row is named."""
    for prompt_ids, message in (([[5], [True]], r"prompt_ids\[1\]"), ([[5], [-2]], r"prompt_ids\[1\]: negative")):
        with pytest.raises(BatchError, match=message):
            TokenBatch.from_sequences(prompt_ids, [[1], [2]])
    with pytest.raises(BatchError, match=r"response_ids\[0\]: token ids must be integers"):
        TokenBatch.from_sequences([[5], [6]], [[1.0], [2]])
    with pytest.raises(BatchError, match=r"log_probs\[1\]: 1 values for 2"):
        pad_per_token("log_probs", [[-1.0], [-1.0]], [1, 2], 2, torch.float32)
