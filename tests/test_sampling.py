"""Counter-based randomness and the sampling rule (splitproof.rl.rollout.sampling) as pure functions."""

from __future__ import annotations

import math

import pytest
import torch

from splitproof.rl.rollout.sampling import (
    inverse_cdf,
    mix64,
    sample_tokens,
    stream_keys,
    stream_uniforms,
    token_uniforms,
    top_k_mask,
    top_p_mask,
)

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


# A plain-integer oracle of the documented construction (mod 2^64 arithmetic on Python ints).
def mix64_int(x: int) -> int:
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def key_int(seed, stream, step, uid, j) -> int:
    h = 0
    for f in (seed, stream, step, uid, j):
        h = mix64_int(mix64_int(h + GAMMA) ^ f)
    return h


def uniform_int(key: int, t: int) -> float:
    x = mix64_int(key + (t + 1) * GAMMA)
    return ((x >> 12) + 0.5) * 2.0**-52


def signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


FIELDS = [
    (0, 0, 0, 0, 0),
    (42, 0, 3, 7, 1),
    (42, 1, 3, 7, 1),
    (2**63 - 1, 1, 2**40, 2**62, 5),
    (123456789, 0, 0, 99999, 15),
    (7, 0, 1, 0, 0),
]


def test_tensor_hash_matches_the_integer_oracle():
    xs = [0, 1, -1, 2**62, -(2**63), 2**63 - 1, 0x0123456789ABCDEF, -0x0123456789ABCDEF]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    assert got == [signed(mix64_int(x & M64)) for x in xs]
    for seed, stream, step, uid, j in FIELDS:
        key = stream_keys(seed, stream, step, torch.tensor([uid]), torch.tensor([j]))
        assert key.tolist() == [signed(key_int(seed, stream, step, uid, j))]
        for t in (0, 1, 17, 4095):
            assert token_uniforms(key, t).item() == uniform_int(key_int(seed, stream, step, uid, j), t)


def test_keys_are_per_row_functions_of_the_fields():
    uids = torch.tensor([5, 3, 9, 3, 0])
    js = torch.tensor([0, 1, 2, 0, 7])
    together = stream_keys(42, 0, 3, uids, js)
    alone = torch.cat([stream_keys(42, 0, 3, uids[i : i + 1], js[i : i + 1]) for i in range(5)])
    assert torch.equal(together, alone)
    # reversing the rows reverses the keys
    assert torch.equal(stream_keys(42, 0, 3, uids.flip(0), js.flip(0)), together.flip(0))


def test_different_fields_give_different_streams():
    grid = [
        (seed, stream, step, uid, j)
        for seed in (0, 1, 42)
        for stream in (0, 1)
        for step in (0, 1, 2)
        for uid in range(6)
        for j in range(4)
    ]
    keys = torch.cat([stream_keys(s, st, sp, torch.tensor([u]), torch.tensor([j])) for s, st, sp, u, j in grid])
    assert keys.unique().numel() == len(grid)
    # the first 8 uniforms of every stream: no two streams share a value (the streams are not shifted copies)
    first = torch.stack([token_uniforms(keys, t) for t in range(8)], dim=1)
    assert first.unique().numel() == first.numel()
    # neighbouring uids and steps are uncorrelated
    u_a = torch.stack(
        [token_uniforms(stream_keys(42, 0, 0, torch.arange(2000), torch.zeros(2000, dtype=torch.long)), 0)]
    )
    u_b = torch.stack(
        [token_uniforms(stream_keys(42, 0, 0, torch.arange(1, 2001), torch.zeros(2000, dtype=torch.long)), 0)]
    )
    u_c = torch.stack(
        [token_uniforms(stream_keys(42, 0, 1, torch.arange(2000), torch.zeros(2000, dtype=torch.long)), 0)]
    )
    for other in (u_b, u_c):
        corr = torch.corrcoef(torch.cat([u_a, other]))[0, 1].item()
        assert abs(corr) < 0.1  # ~N(0, 1/sqrt(2000)) = 0.022 for independent uniforms


def test_uniforms_are_well_spread():
    keys = stream_keys(42, 0, 0, torch.arange(500), torch.zeros(500, dtype=torch.long))
    u = torch.cat([token_uniforms(keys, t) for t in range(40)])  # 20000 draws
    assert u.dtype == torch.float64 and bool(((u > 0) & (u < 1)).all())
    assert u.unique().numel() == u.numel()
    bins = 50
    counts = torch.bincount((u * bins).long(), minlength=bins).double()
    expected = u.numel() / bins
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 100  # chi-square, 49 degrees of freedom: P(> 100) ≈ 2e-5
    assert abs(u.mean().item() - 0.5) < 0.01 and abs(u.var().item() - 1 / 12) < 0.005
    # serial pairs (u_t, u_t+1) fill the unit square evenly too
    pairs = torch.stack([token_uniforms(keys, 0), token_uniforms(keys, 1)], 1)
    cells = torch.bincount((pairs[:, 0] * 5).long() * 5 + (pairs[:, 1] * 5).long(), minlength=25).double()
    assert ((cells - 20) ** 2 / 20).sum().item() < 60  # 24 degrees of freedom


def test_stream_uniforms_are_the_token_uniforms():
    keys = stream_keys(3, 1, 2, torch.arange(5), torch.arange(5))
    table = stream_uniforms(keys, 9)
    assert table.shape == (5, 9)
    for t in range(9):
        assert torch.equal(table[:, t], token_uniforms(keys, t))


def test_uniform_bounds_are_open():
    assert token_uniforms(torch.tensor([0]), 0).item() > 0
    from splitproof.rl.rollout.sampling import uniform_from_bits

    top = uniform_from_bits(torch.tensor([-1], dtype=torch.int64)).item()  # all 64 bits set
    low = uniform_from_bits(torch.tensor([0], dtype=torch.int64)).item()
    assert top < 1.0 and top == 1 - 2.0**-53 and low == 2.0**-53


# ---------------------------------------------------------------------------------------- the rule


def _uniforms(n: int, seed: int = 7) -> torch.Tensor:
    return token_uniforms(stream_keys(seed, 0, 0, torch.arange(n), torch.zeros(n, dtype=torch.long)), 0)


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert bool((counts[expected == 0] == 0).all())
    keep = expected > 0
    return (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()


LOGITS = torch.tensor([1.0, 3.0, -0.5, 2.0, 2.0, 0.0, -3.0, 2.5], dtype=torch.float64)


def test_inverse_cdf_frequencies_match_the_probabilities():
    n = 20000
    u = _uniforms(n)
    for temperature in (1.0, 0.6, 1.7):
        tokens, _ = sample_tokens(LOGITS.expand(n, -1), u, temperature=temperature)
        probs = torch.softmax(LOGITS / temperature, -1)
        assert _chi2(tokens, probs) < 30  # 7 degrees of freedom: P(> 30) ≈ 1e-4


def test_top_k_frequencies_and_support():
    n = 20000
    u = _uniforms(n, seed=8)
    tokens, _ = sample_tokens(LOGITS.expand(n, -1), u, top_k=3)
    kept = torch.tensor([1, 3, 7])  # logits 3.0, 2.5 and the first 2.0 (id 3 before id 4)
    probs = torch.zeros(8, dtype=torch.float64)
    probs[kept] = torch.softmax(LOGITS[kept], -1)
    assert set(tokens.unique().tolist()) == set(kept.tolist())
    assert _chi2(tokens, probs) < 25  # 2 degrees of freedom


def test_top_p_never_leaves_the_nucleus_and_matches_renormalised_probabilities():
    n = 20000
    u = _uniforms(n, seed=9)
    probs = torch.softmax(LOGITS, -1)
    ordered = probs.sort(descending=True, stable=True)
    for p in (0.3, 0.5, 0.8, 0.95):
        mass_before = torch.cumsum(ordered.values, 0) - ordered.values
        nucleus = ordered.indices[mass_before < p]
        tokens, _ = sample_tokens(LOGITS.expand(n, -1), u, top_p=p)
        assert set(tokens.unique().tolist()) <= set(nucleus.tolist())
        expected = torch.zeros_like(probs)
        expected[nucleus] = probs[nucleus] / probs[nucleus].sum()
        assert _chi2(tokens, expected) < 30
    # top-k first, then top-p on the renormalised top-k distribution
    tokens, _ = sample_tokens(LOGITS.expand(n, -1), u, top_k=4, top_p=0.6)
    top4 = torch.tensor([1, 7, 3, 4])
    renorm = torch.softmax(LOGITS[top4], -1)  # 0.41, 0.25, 0.17, 0.17 (ordered)
    assert renorm[:2].sum() >= 0.6 > renorm[0]  # ids 1 and 7 make the nucleus
    assert set(tokens.unique().tolist()) == {1, 7}  # mass before id 3 is 0.66 >= 0.6


def test_top_p_after_top_k_equals_top_p_over_the_whole_filtered_vocabulary():
    from splitproof.rl.rollout.sampling import scaled_log_probs, truncated_weights

    g = torch.Generator().manual_seed(5)
    z = (torch.randn(40, 500, generator=g) * 2).round()  # many ties
    z[3] = 0.0  # a row of ties only
    _, lp = scaled_log_probs(z, 1.0)
    for k, p in ((1, 0.5), (7, 0.3), (50, 0.9), (499, 0.99)):
        fast = truncated_weights(z, lp, k, p)
        step = truncated_weights(z, lp, k, 1.0)
        slow = torch.where(top_p_mask(step, p), step, torch.zeros_like(step))
        assert torch.equal(fast, slow)
        assert bool(((fast > 0).sum(-1) <= k).all())


def test_greedy_and_its_equivalents():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    logits[5, [10, 20]] = logits[5].max() + 1  # a tie: the lowest id wins
    u = _uniforms(64)
    greedy, lp = sample_tokens(logits, u, greedy=True)
    assert torch.equal(greedy, logits.argmax(-1)) and greedy[5].item() == 10
    assert torch.equal(sample_tokens(logits, u, temperature=0.0)[0], greedy)
    top1, _ = sample_tokens(logits, u, top_k=1)
    assert torch.equal(top1, greedy)
    tiny_p, _ = sample_tokens(logits, u, top_p=1e-9)
    assert torch.equal(tiny_p, greedy)
    assert torch.equal(lp, torch.log_softmax(logits, -1).gather(-1, greedy[:, None]).squeeze(-1))


def test_top_k_mask_keeps_exactly_k_with_ties_to_the_lower_id():
    z = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0], [5.0, 1.0, 5.0, 1.0, 5.0]])
    assert top_k_mask(z, 2).tolist() == [[False, True, True, False, False], [True, False, True, False, False]]
    assert top_k_mask(z, 4).sum(-1).tolist() == [4, 4]


def test_top_p_mask_ties_and_the_top_token():
    w = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.0, 0.0, 1.0, 0.0]])
    assert top_p_mask(w, 0.5).tolist() == [[True, True, False, False], [False, False, True, False]]
    assert top_p_mask(w, 0.51).tolist()[0] == [True, True, True, False]
    assert top_p_mask(w * 3.0, 0.5).tolist()[0] == [True, True, False, False]  # any positive scale


def test_inverse_cdf_edges():
    w = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4, dtype=torch.float32)
    u = torch.tensor([2.0**-53, 0.5 - 1e-12, 0.5, 1 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 3, 3]  # zero-weight ids are never picked
    # u · total rounding up to total: the last token of positive weight
    assert inverse_cdf(w[:1], torch.tensor([1.0], dtype=torch.float64)).tolist() == [3]


def test_two_level_inverse_cdf_is_the_one_level_search():
    g = torch.Generator().manual_seed(4)
    for vocab in (128, 300, 1000):  # a multiple of the block, and two that need padding
        w = torch.rand(16, vocab, generator=g, dtype=torch.float64) ** 4
        w[:, ::7] = 0  # zero-weight ids
        w[3, : vocab // 2 + 10] = 0  # whole empty blocks
        for seed in range(40):
            u = _uniforms(16, seed=100 + seed)
            cdf = torch.cumsum(w, -1)
            naive = (cdf <= (u * cdf[:, -1]).unsqueeze(-1)).sum(-1)  # smallest i with cdf_i > u * total
            assert torch.equal(inverse_cdf(w, u), naive)
    # float32 weights, vocabulary not a multiple of the block: frequencies still match
    n, vocab = 20000, 1000
    logits = torch.randn(vocab, generator=g) * 2
    logits[500:] -= 6  # a long tail
    tokens, _ = sample_tokens(logits.expand(n, -1), _uniforms(n, seed=3))
    probs = torch.softmax(logits.double(), -1)
    coarse = torch.zeros(20, dtype=torch.float64).index_add_(0, torch.arange(vocab) // 50, probs)
    assert _chi2(tokens // 50, coarse) < 60  # 19 degrees of freedom, ids pooled by 50


def test_log_probs_are_of_the_temperature_scaled_distribution_before_filtering():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    u = _uniforms(16)
    tokens, lp = sample_tokens(logits, u, temperature=0.7, top_k=5, top_p=0.9)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[:, None]).squeeze(-1)
    assert torch.equal(lp, expected) and lp.dtype == torch.float64
    _, lp32 = sample_tokens(logits.to(torch.bfloat16), u)
    assert lp32.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_row_depends_only_on_its_own_logits_and_uniform(dtype):
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(33, 1000, generator=g) * 3).to(dtype)
    u = _uniforms(33)
    for kwargs in ({}, {"top_k": 20}, {"top_p": 0.7}, {"top_k": 50, "top_p": 0.9, "temperature": 0.8}):
        together = sample_tokens(logits, u, **kwargs)
        alone = [sample_tokens(logits[i : i + 1], u[i : i + 1], **kwargs) for i in range(33)]
        assert torch.equal(together[0], torch.cat([a[0] for a in alone]))
        assert torch.equal(together[1], torch.cat([a[1] for a in alone]))
        perm = torch.randperm(33, generator=g)
        shuffled = sample_tokens(logits[perm], u[perm], **kwargs)
        assert torch.equal(shuffled[0], together[0][perm]) and torch.equal(shuffled[1], together[1][perm])


def test_token_index_must_be_non_negative():
    with pytest.raises(ValueError, match="t must be >= 0"):
        token_uniforms(torch.tensor([1]), -1)
    assert math.isfinite(token_uniforms(torch.tensor([1]), 10**6).item())
