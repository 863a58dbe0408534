"""The hf rollout backend: layout-independent generation, EOS and length semantics, greedy / top-k /
top-p on a real decode, rollout log-probs against the engine's full forward, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from splitproof.engine import compute_log_probs
from splitproof.hf_models import load_causal_lm, tiny_causal_lm
from splitproof.loss_config import ConfigError
from splitproof.rl.rollout.hf import HFRollout, RolloutError, SamplingParams, requests_for, samples_to_batch

PROMPT_LENGTHS = (1, 5, 9, 15, 16, 23)  # 15/16/17 straddle the padding multiple
EOS = tuple(range(3, 256, 13))  # 20 ids: about 8 % of tokens, so some samples stop and some run to the end
_models: dict = {}


def model(arch: str, dtype: torch.dtype = torch.float64):
    if (arch, dtype) not in _models:
        _models[arch, dtype] = tiny_causal_lm(arch, dtype=dtype, seed=3)
    return _models[arch, dtype]


def prompts(seed: int = 0) -> list[tuple[int, list[int]]]:
    g = random.Random(seed)
    return [(100 + 7 * i, [g.randrange(256) for _ in range(n)]) for i, n in enumerate(PROMPT_LENGTHS)]


def generate(m, requests, params, *, max_num_seqs=256, step=0, stream=0, eos=EOS, **kwargs):
    rollout = HFRollout(m, eos_token_ids=eos, pad_token_id=0, max_num_seqs=max_num_seqs, **kwargs)
    return rollout.generate(requests, params, step=step, stream=stream)


def by_key(samples):
    return {(s.uid, s.sample_index): s for s in samples}


def layouts(m, requests, params):
    """The same requests generated under several layouts: chunk sizes, orders, a two-rank split."""
    perm = list(range(len(requests)))
    random.Random(1).shuffle(perm)
    shuffled = [requests[i] for i in perm]
    half = len(requests) // 2
    yield "max_num_seqs=1", generate(m, requests, params, max_num_seqs=1)
    yield "max_num_seqs=3, permuted", generate(m, shuffled, params, max_num_seqs=3)
    yield "all at once, permuted", generate(m, shuffled, params)
    yield (
        "two ranks",
        (generate(m, shuffled[:half], params, max_num_seqs=4) + generate(m, shuffled[half:], params, max_num_seqs=5)),
    )


PARAMS = SamplingParams(n=2, temperature=1.0, max_response_length=12, seed=5)


@pytest.mark.invariance
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_layout_independent_in_float64(arch):
    m = model(arch)
    requests = requests_for(prompts(), PARAMS.n)
    base = generate(m, requests, PARAMS)
    assert [(s.uid, s.sample_index) for s in base] == [(u, j) for u, j, _ in requests]  # request order
    finished = [s.finished for s in base]
    assert any(finished) and not all(finished)  # both kinds of ending are exercised
    for name, samples in layouts(m, requests, PARAMS):
        got = by_key(samples)
        for s in base:
            o = got[s.uid, s.sample_index]
            assert (o.response_ids, o.log_probs, o.finished) == (s.response_ids, s.log_probs, s.finished), name


def test_float32_layout_drift_is_small():
    """Measured on the build machine: identical in float32 too (0 of 12 samples differ). The bound is
    loose on purpose: float32 exactness hangs on the BLAS kernels of the machine."""
    m = model("llama", torch.float32)
    requests = requests_for(prompts(), PARAMS.n)
    base = by_key(generate(m, requests, PARAMS))
    differing = total = 0
    for _, samples in layouts(m, requests, PARAMS):
        for s in samples:
            total += 1
            differing += s.response_ids != base[s.uid, s.sample_index].response_ids
    assert differing <= total // 4


@pytest.mark.invariance
def test_sampling_top_k_top_p_layout_independent():
    m = model("qwen3")
    params = SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, max_response_length=10, seed=11)
    requests = requests_for(prompts(2), params.n)
    base = by_key(generate(m, requests, params))
    for name, samples in layouts(m, requests, params):
        assert by_key(samples) == base, name


def test_rollout_log_probs_match_the_full_forward():
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 5e-6)):
        m = model("llama", dtype)
        for temperature in (1.0, 0.7):
            params = SamplingParams(n=2, temperature=temperature, max_response_length=12)
            samples = generate(m, requests_for(prompts(), 2), params)
            batch = samples_to_batch(samples, dtype=dtype)
            full, _ = compute_log_probs(m, batch, micro_batch_size=5, temperature=temperature)
            diff = (full - batch.old_log_probs).abs()[batch.response_mask].max().item()
            assert diff <= tol, (dtype, temperature, diff)


def test_eos_stops_exactly_where_the_unstopped_generation_first_hits_it():
    m = model("qwen2")
    params = SamplingParams(n=2, max_response_length=12, seed=9)
    requests = requests_for(prompts(), 2)
    free = generate(m, requests, params, eos=())
    assert all(not s.finished and len(s.response_ids) == 12 for s in free)
    # stop tokens: one from the middle of one response, the last token of another
    eos = {free[0].response_ids[4], free[3].response_ids[11]}
    stopped = generate(m, requests, params, eos=sorted(eos))
    hits = 0
    for f, s in zip(free, stopped):
        cut = next((t + 1 for t, tok in enumerate(f.response_ids) if tok in eos), None)
        if cut is None:
            assert s.response_ids == f.response_ids and not s.finished
        else:
            hits += 1
            assert s.finished and s.response_ids == f.response_ids[:cut] and s.response_ids[-1] in eos
        assert s.log_probs == f.log_probs[: len(s.response_ids)]
    assert hits >= 2
    last = stopped[3]
    assert last.finished and len(last.response_ids) <= 12  # EOS on the final allowed token still counts
    batch = samples_to_batch(stopped).validate()
    assert batch.response_mask.sum(-1).tolist() == [len(s.response_ids) for s in stopped]  # EOS included


def test_greedy_is_argmax_of_the_full_forward():
    m = model("llama")
    requests = requests_for(prompts(), 1)
    greedy = generate(m, requests, SamplingParams(do_sample=False, max_response_length=8), eos=())
    assert generate(m, requests, SamplingParams(temperature=0.0, max_response_length=8), eos=()) == greedy
    assert [s.response_ids for s in generate(m, requests, SamplingParams(top_k=1, max_response_length=8), eos=())] == [
        s.response_ids for s in greedy
    ]
    for s in greedy:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = m(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1]
        assert logits.argmax(-1).tolist() == s.response_ids


def test_top_k_and_top_p_tokens_lie_in_their_sets_under_the_full_forward():
    m = model("qwen3")
    for params in (
        SamplingParams(top_k=3, max_response_length=10, seed=1),
        SamplingParams(top_p=0.05, temperature=0.5, max_response_length=10, seed=2),
    ):
        for s in generate(m, requests_for(prompts(3), 1), params, eos=()):
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            z = m(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1] / params.temperature
            probs = torch.softmax(z, -1)
            for t, tok in enumerate(s.response_ids):
                rank = int((z[t] > z[t, tok]).sum())  # tokens strictly more likely
                if params.top_k > 0:
                    assert rank < params.top_k
                else:
                    assert probs[t][z[t] > z[t, tok]].sum().item() < params.top_p


def test_seed_step_stream_key_the_samples():
    m = model("llama")
    requests = requests_for(prompts(), 2)
    base = generate(m, requests, PARAMS, step=3, stream=0)
    assert generate(m, requests, PARAMS, step=3, stream=0) == base  # a fresh backend, the same samples
    for variant in (dict(step=4), dict(stream=1)):
        other = generate(m, requests, PARAMS, **{"step": 3, "stream": 0, **variant})
        assert sum(a.response_ids != b.response_ids for a, b in zip(base, other)) >= len(base) // 2
    reseeded = generate(m, requests, SamplingParams(n=2, max_response_length=12, seed=6), step=3)
    assert sum(a.response_ids != b.response_ids for a, b in zip(base, reseeded)) >= len(base) // 2
    # the two samples of a prompt differ (their own streams)
    assert any(base[2 * i].response_ids != base[2 * i + 1].response_ids for i in range(len(base) // 2))


def test_loaded_checkpoint_generates_the_same(tmp_path):
    m = model("qwen2")
    m.save_pretrained(tmp_path / "ckpt")
    loaded = load_causal_lm(tmp_path / "ckpt", dtype=torch.float64)
    requests = requests_for(prompts(), 2)
    assert generate(loaded, requests, PARAMS) == generate(m, requests, PARAMS)


def test_numpy_ids_and_tuple_prompts_are_accepted():
    import numpy as np

    m = model("llama")
    requests = requests_for(prompts(), 2)
    as_numpy = [(np.int64(u), np.int32(j), tuple(np.array(ids))) for u, j, ids in requests]
    got = generate(m, as_numpy, PARAMS, eos=np.array([3, 16]))
    assert got == generate(m, requests, PARAMS, eos=[3, 16])
    assert all(type(s.uid) is int and type(s.prompt_ids[0]) is int for s in got)


def test_model_mode_restored_and_no_grad():
    m = model("llama")
    m.train()
    generate(m, requests_for(prompts(), 1), SamplingParams(max_response_length=3))
    assert m.training and all(p.grad is None for p in m.parameters())
    m.eval()


def test_bad_requests_are_named():
    m = model("llama")
    params = SamplingParams(n=2, max_response_length=4)
    good = [(0, 0, [1, 2]), (0, 1, [1, 2])]
    cases = [
        (good + [(5, 0, [1, 300])], r"prompt_ids \(requests\[2\], uid 5, sample 0\).*300 outside"),
        (good + [(5, 0, [1, -1, 2])], r"prompt_ids \(requests\[2\], uid 5, sample 0\).*-1 outside"),
        (good + [(5, 0, [1, True])], r"prompt_ids \(requests\[2\], uid 5, sample 0\).*True outside"),
        (good + [(5, 0, [1, 2.0])], r"prompt_ids \(requests\[2\], uid 5, sample 0\).*2.0 outside"),
        (good + [(0, 1, [4])], r"requests \(requests\[2\], uid 0, sample 1\): duplicate"),
        (good + [(3, 0, [])], r"prompt_ids \(requests\[2\], uid 3, sample 0\): empty prompt"),
        (good + [(3, 2, [1])], r"sample index \(requests\[2\], uid 3, sample 2\): must be < n = 2"),
        (good + [(-1, 0, [1])], r"uid \(requests\[2\], uid -1, sample 0\)"),
        ([(0, 0)], r"requests \(requests\[0\]"),
    ]
    for requests, pattern in cases:
        with pytest.raises(RolloutError, match=pattern):
            generate(m, requests, params)
    for field, kwargs in (
        ("temperature", dict(temperature=-0.1)),
        ("top_p", dict(top_p=0.0)),
        ("top_k", dict(top_k=-2)),
        ("max_response_length", dict(max_response_length=0)),
        ("n", dict(n=0)),
        ("seed", dict(seed=-1)),
        ("do_sample", dict(do_sample=1)),
    ):
        with pytest.raises(ConfigError, match=f"^{field}:"):
            generate(m, good[:1], SamplingParams(**kwargs))
    with pytest.raises(ConfigError, match="^step:"):
        generate(m, good, params, step=-1)
    with pytest.raises(ConfigError, match="^max_num_seqs:"):
        HFRollout(m, eos_token_ids=[1], pad_token_id=0, max_num_seqs=0)
    with pytest.raises(ConfigError, match="^eos_token_ids:.*256"):
        HFRollout(m, eos_token_ids=[1, 256], pad_token_id=0)
    assert generate(m, [], params) == []


def test_samples_to_tokens_lays_out_every_row():
    from splitproof.rl.rollout.assemble import samples_to_tokens
    from splitproof.rl.rollout.hf import Sample

    g = random.Random(4)
    samples = []
    for uid in range(40):
        response = [g.randrange(99) for _ in range(g.randint(0, 4))]
        samples.append(
            Sample(
                uid=uid,
                sample_index=0,
                prompt_ids=[g.randrange(99) for _ in range(g.randint(1, 9))],
                response_ids=response,
                log_probs=[g.uniform(-5, 0) for _ in response],
                finished=bool(response),
            )
        )
    for dtype in (torch.float32, torch.float64):
        seqs, rollout_log_probs = samples_to_tokens(samples, response_width=4, pad_token_id=7, dtype=dtype)
        P = max(len(s.prompt_ids) for s in samples)
        assert seqs.prompts.shape == (40, P) and seqs.responses.shape == (40, 4) and rollout_log_probs.dtype == dtype
        for row, s in enumerate(samples):
            p, t = len(s.prompt_ids), len(s.response_ids)
            assert seqs.prompts[row].tolist() == [7] * (P - p) + s.prompt_ids
            assert seqs.responses[row].tolist() == s.response_ids + [7] * (4 - t)
            assert seqs.attention_mask[row].tolist() == [False] * (P - p) + [True] * (p + t) + [False] * (4 - t)
            assert seqs.response_mask[row].tolist() == [True] * t + [False] * (4 - t)
            assert rollout_log_probs[row].tolist() == torch.tensor(s.log_probs + [0.0] * (4 - t), dtype=dtype).tolist()
    with pytest.raises(ValueError, match=r"uid 3, sample_index 0\) has 5 response tokens > max_response_length 4"):
        samples_to_tokens(
            samples[:3] + [Sample(3, 0, [1], [1] * 5, [0.0] * 5, False)], response_width=4, pad_token_id=0
        )
    with pytest.raises(ValueError, match=r"uid 3, sample_index 0\) has 1 log-probs for 2 response tokens"):
        samples_to_tokens([Sample(3, 0, [1], [1, 2], [0.0], True)], response_width=4, pad_token_id=0)


def test_samples_to_batch_takes_a_multi_turn_token_mask():
    """An episode's tool tokens are in the attention mask but not in ``response_mask`` (its ``token_mask``),
    in ``samples_to_batch`` as in the RL step's ``samples_to_tokens``."""
    from splitproof.rl.rollout.assemble import samples_to_tokens
    from splitproof.rl.rollout.episode import Episode

    episodes = [
        Episode(
            uid=0,
            sample_index=0,
            prompt_ids=[3, 4],
            response_ids=[5, 6, 7, 8],
            log_probs=[-1.0] * 4,
            finished=True,
            token_mask=[1, 0, 0, 1],
        ),
        Episode(
            uid=0, sample_index=1, prompt_ids=[3], response_ids=[9], log_probs=[-0.5], finished=True, token_mask=[1]
        ),
    ]
    batch = samples_to_batch(episodes)
    assert batch.response_mask.tolist() == [[True, False, False, True], [True, False, False, False]]
    assert batch.attention_mask[:, batch.prompt_width :].tolist() == [[True] * 4, [True, False, False, False]]
    tokens, _ = samples_to_tokens(episodes, response_width=6, pad_token_id=0)
    assert tokens.response_mask[:, :4].tolist() == batch.response_mask.tolist()
    assert not tokens.response_mask[:, 4:].any()
