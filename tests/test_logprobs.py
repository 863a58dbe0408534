"""Response log-probs: independent of microbatch company, equal to a naive full-logits computation."""

import pytest
import torch
from torch import nn

from splitproof.batch import BatchError, RolloutBatch
from splitproof.engine.logprobs import compute_log_probs, response_log_probs
from splitproof.hf_models import tiny_causal_lm

ARCHS = ["llama", "qwen2"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_causal_lm(request.param, dtype=torch.float64)


def make_batch(B=6, P=7, T=9, seed=0, vocab=256):
    """Left-padded prompts, right-padded responses of varied lengths; pad ids are junk on purpose."""
    g = torch.Generator().manual_seed(seed)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    tlen = torch.randint(1, T + 1, (B,), generator=g)
    tlen[0] = T - 2  # no row uses the last two response columns: trimming has work to do
    tlen = tlen.clamp(max=T - 2)
    plen = plen.clamp(max=P - 1)  # and no row uses the first prompt column
    plen[0] = P - 1
    patt = torch.arange(P)[None] >= (P - plen)[:, None]
    ratt = torch.arange(T)[None] < tlen[:, None]
    prompts = torch.where(patt, torch.randint(0, vocab, (B, P), generator=g), 10_000)
    responses = torch.where(ratt, torch.randint(0, vocab, (B, T), generator=g), -1)
    zeros = torch.zeros(B, T, dtype=torch.float64)
    return RolloutBatch(prompts, responses, torch.cat([patt, ratt], 1).long(), ratt.long(), zeros, zeros)


def naive(model, batch, temperature=1.0):
    """Full logits over the untrimmed batch, log_softmax, pick the positions before each response token."""
    ids = torch.where(batch.attention_mask.bool(), batch.input_ids, 0)
    mask = batch.attention_mask.long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits / temperature
    P, T = batch.prompt_width, batch.response_width
    logp_all = torch.log_softmax(logits[:, P - 1 : P + T - 1], dim=-1)
    tokens = ids[:, P:]
    logp = logp_all.gather(-1, tokens[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    valid = batch.response_mask.bool()
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def test_matches_naive_full_logits(model):
    batch = make_batch()
    logp, ent = response_log_probs(model, batch, with_entropy=True)
    ref_logp, ref_ent = naive(model, batch)
    assert logp.shape == (6, 9) and logp.dtype == torch.float64
    assert (logp - ref_logp).abs().max() <= 1e-12
    assert (ent - ref_ent).abs().max() <= 1e-12
    assert torch.all(logp[~batch.response_mask.bool()] == 0)
    assert torch.all(logp[batch.response_mask.bool()] < 0)


def test_row_does_not_depend_on_its_company(model):
    batch = make_batch(B=8, seed=3)
    together, _ = response_log_probs(model, batch)
    alone = torch.cat([response_log_probs(model, batch.select([i]))[0] for i in range(len(batch))])
    assert (together - alone).abs().max() <= 1e-12
    pairs = torch.cat([response_log_probs(model, batch.select([i, (i + 3) % 8]))[0][:1] for i in range(8)])
    assert (together - pairs).abs().max() <= 1e-12


@pytest.mark.parametrize("temperature", [0.7, 2.0])
def test_temperature(model, temperature):
    batch = make_batch(seed=1)
    logp, ent = response_log_probs(model, batch, temperature=temperature, with_entropy=True)
    ref_logp, ref_ent = naive(model, batch, temperature)
    assert (logp - ref_logp).abs().max() <= 1e-12
    assert (ent - ref_ent).abs().max() <= 1e-12
    plain, _ = response_log_probs(model, batch)
    assert (logp - plain).abs().max() > 1e-3


def test_gradient_flows(model):
    batch = make_batch(seed=2)
    model.zero_grad()
    logp, ent = response_log_probs(model, batch, with_entropy=True)
    (logp.sum() + ent.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0
    model.zero_grad()


class NoLogitsToKeep(nn.Module):
    """A module with the causal-LM call signature but no ``logits_to_keep``; returns a plain tensor."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.widths = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.widths.append(input_ids.shape[1])
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


def test_fallback_without_logits_to_keep(model):
    batch = make_batch(seed=4)
    wrapped = NoLogitsToKeep(model)
    a, _ = response_log_probs(wrapped, batch)
    b, _ = response_log_probs(model, batch)
    assert (a - b).abs().max() <= 1e-12
    assert wrapped.widths == [(7 - 1) + (9 - 2)]  # trimmed to the microbatch's real width


def test_compute_log_probs_restores_order(model):
    batch = make_batch(B=7, seed=5)
    ref, ref_ent = response_log_probs(model, batch, with_entropy=True)
    for kwargs in (dict(micro_batch_size=1), dict(micro_batch_size=3), dict(max_token_len=30)):
        logp, ent = compute_log_probs(model, batch, with_entropy=True, **kwargs)
        assert not logp.requires_grad
        assert (logp - ref).abs().max() <= 1e-12
        assert (ent - ref_ent).abs().max() <= 1e-12
    logp, ent = compute_log_probs(model, batch, micro_batch_size=7)
    assert ent is None


def test_compute_log_probs_errors(model):
    batch = make_batch()
    with pytest.raises(BatchError, match="micro_batch_size"):
        compute_log_probs(model, batch)
    with pytest.raises(BatchError, match="micro_batch_size"):
        compute_log_probs(model, batch, micro_batch_size=2, max_token_len=100)
    with pytest.raises(BatchError, match="ppo_max_token_len_per_gpu"):
        compute_log_probs(model, batch, max_token_len=3)


def test_empty_microbatch(model):
    batch = make_batch()
    logp, ent = response_log_probs(model, batch.select([]), with_entropy=True)
    assert logp.shape == (0, 9) and ent.shape == (0, 9)


def test_low_precision_model_gives_float32():
    model = tiny_causal_lm("llama", dtype=torch.bfloat16)
    batch = make_batch()
    logp, ent = response_log_probs(model, batch, with_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert torch.isfinite(logp).all()


# ---- models (the inputs of everything above) ----


def test_tiny_models_deterministic_and_rng_untouched():
    from splitproof.hf_models import vocab_size_of

    state = torch.get_rng_state()
    a, b = tiny_causal_lm("qwen3", seed=1), tiny_causal_lm("qwen3", seed=1)
    assert torch.equal(state, torch.get_rng_state())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.lm_head.weight, tiny_causal_lm("qwen3", seed=2).lm_head.weight)
    assert a.lm_head.weight.data_ptr() != a.model.embed_tokens.weight.data_ptr()
    assert vocab_size_of(a) == 256 and a.config.use_cache is False
    with pytest.raises(ValueError, match="arch"):
        tiny_causal_lm("gpt9")


def test_load_causal_lm_roundtrip(tmp_path):
    from splitproof.hf_models import load_causal_lm

    model = tiny_causal_lm("llama", dtype=torch.float64)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_causal_lm(tmp_path / "ckpt", dtype=torch.float64)
    batch = make_batch()
    assert torch.equal(response_log_probs(model, batch)[0], response_log_probs(loaded, batch)[0])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_causal_lm(tmp_path / "nowhere")
