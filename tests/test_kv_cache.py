"""The decode loop's cache (``rl/rollout/kv_cache.py``) and the shared prefill of repeated prompts: the
same tokens and log-probs, to the bit, as transformers' own cache grown by concatenation with every
request prefilled on its own row; the reserved room grows when a step runs past it."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from splitproof.hf_models import tiny_causal_lm
from splitproof.rl.rollout import hf, kv_cache
from splitproof.rl.rollout.hf import HFRollout, SamplingParams, requests_for
from splitproof.rl.rollout.prefill import TurnCache, canonical_prompt_width

PROMPTS = [(11, [5, 9, 2]), (12, [7] * 17), (13, [1, 2, 3, 4, 5, 6, 7, 8, 9]), (14, [5, 9, 2])]  # 11 and 14 alike
EOS = tuple(range(3, 256, 29))


def concatenating_prefill(model, prompts, kept, rows, extra, *, pad_multiple, pad_id, device):
    """Every row prefilled on its own (no sharing) into transformers' growing cache: the old loop."""
    padded = prompts + [prompts[0]] * (rows - len(prompts))
    width = max(canonical_prompt_width(len(p), pad_multiple) for p in padded)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in padded], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in padded], device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0), use_cache=True)
    return out.logits[:, -1], out.past_key_values, mask


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reserved_cache_and_shared_prefill_change_no_bit(dtype, monkeypatch):
    model = tiny_causal_lm("llama", dtype=dtype, seed=4)
    params = SamplingParams(n=3, max_response_length=20, seed=2)
    requests = requests_for(PROMPTS, params.n)

    def run():
        rollout = HFRollout(model, eos_token_ids=EOS, pad_token_id=0, max_num_seqs=7)
        return [(s.response_ids, s.log_probs, s.finished) for s in rollout.generate(requests, params, step=1)]

    shipped = run()
    with monkeypatch.context() as m:
        m.setattr(hf, "prefill", concatenating_prefill)
        plain = run()
    assert shipped == plain
    assert any(f for _, _, f in shipped) and not all(f for _, _, f in shipped)  # compaction ran


def test_reserved_layer_grows_past_its_room_and_selects_rows():
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 4, generator=g)
    cache = DynamicCache()
    cache.update(keys, values, 0)
    rows = torch.tensor([2, 0, 0])
    cache = kv_cache.reserve(cache, 1, rows)
    layer = cache.layers[0]
    assert isinstance(layer, kv_cache.ReservedLayer)
    plain = DynamicLayer()
    plain.update(keys[rows], values[rows])
    for n in (1, 3, 1):  # the second update runs past the room of one column
        k, v = torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)
        got, want = layer.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert cache.get_seq_length() == 10
    kv_cache.select_rows(cache, torch.tensor([1, 2]))
    plain.reorder_cache(torch.tensor([1, 2]))
    assert torch.equal(layer.keys, plain.keys) and torch.equal(layer.values, plain.values)


def test_a_legacy_tuple_cache_is_selected_as_tuples():
    t = torch.arange(24.0).view(2, 1, 3, 4)
    got = kv_cache.reserve(((t, t + 1),), 4, torch.tensor([1, 1]))
    assert torch.equal(got[0][0], t[[1, 1]]) and torch.equal(got[0][1], (t + 1)[[1, 1]])
    assert kv_cache.reserve(((t, t),), 4) == ((t, t),)


def two_turns(model, requests, params, max_num_seqs, order):
    """Turn 1, then turn 2 continuing each sample with [7, 8, 9] appended, in the given order."""
    rollout = HFRollout(model, eos_token_ids=EOS, pad_token_id=0, max_num_seqs=max_num_seqs)
    turns = rollout.new_turn_cache()
    ordered = [requests[i] for i in order]
    first = rollout.generate(ordered, params, step=1, turn_cache=turns)
    assert len(turns.rows) == len(requests)  # every row kept its cache
    second_requests = [(s.uid, s.sample_index, s.prompt_ids + s.response_ids + [7, 8, 9]) for s in first]
    positions = [len(s.response_ids) + 3 for s in first]
    second = rollout.generate(second_requests, params, step=1, positions=positions, turn_cache=turns)
    return {
        (s.uid, s.sample_index): (f.response_ids, f.log_probs, s.response_ids, s.log_probs)
        for f, s in zip(first, second)
    }


@pytest.mark.invariance
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_continued_turn_is_layout_independent(dtype, monkeypatch):
    model = tiny_causal_lm("qwen2", dtype=dtype, seed=5)
    params = SamplingParams(n=3, max_response_length=14, seed=3)
    requests = requests_for(PROMPTS, params.n)
    taken = []
    take = TurnCache.take
    monkeypatch.setattr(TurnCache, "take", lambda self, key, ids: taken.append(take(self, key, ids)) or taken[-1])
    base = two_turns(model, requests, params, 256, range(len(requests)))
    assert sum(t is not None for t in taken) == len(requests)  # the second turn continued every cache
    reverse = list(reversed(range(len(requests))))
    for max_num_seqs, order in ((1, reverse), (5, reverse), (4, range(len(requests)))):
        assert two_turns(model, requests, params, max_num_seqs, order) == base
