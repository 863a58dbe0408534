"""The synthetic rollout: a valid batch, deterministic, noisy old log-probs, GRPO advantages."""

import torch

from splitproof.diagnose.synthetic import group_advantages, synthetic_rollout
from splitproof.engine.logprobs import compute_log_probs
from splitproof.hf_models import tiny_causal_lm


def test_synthetic_rollout_is_valid_and_deterministic():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    rng = torch.get_rng_state()
    batch = synthetic_rollout(model, 8, 12, 16, seed=3, with_is_weights=True)
    assert torch.equal(rng, torch.get_rng_state())
    batch.validate(vocab_size=256)
    assert batch.prompts.shape == (8, 12) and batch.responses.shape == (8, 16)
    plen = batch.attention_mask[:, :12].sum(1)
    rlen = batch.response_mask.sum(1)
    assert plen.min() >= 6 and plen.max() <= 12 and rlen.min() >= 1 and rlen.max() <= 16
    assert torch.equal(batch.seq_ids, torch.arange(8))
    assert batch.index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]  # the groups the advantages were normalised in
    for t in (batch.old_log_probs, batch.advantages, batch.ref_log_probs, batch.rollout_is_weights):
        assert t.dtype == torch.float64 and t.shape == (8, 16)
        assert torch.all(t[~batch.response_mask.bool()] == 0)

    valid = batch.response_mask.bool()
    current, _ = compute_log_probs(model, batch, micro_batch_size=8)
    noise = (batch.old_log_probs - current)[valid]
    assert 0.05 < float(noise.std()) < 0.2  # ratios differ from 1
    assert torch.all(batch.rollout_is_weights[valid] > 0)

    again = synthetic_rollout(model, 8, 12, 16, seed=3, with_is_weights=True)
    assert all(
        torch.equal(getattr(batch, f), getattr(again, f))
        for f in ("prompts", "responses", "attention_mask", "old_log_probs", "advantages", "ref_log_probs")
    )
    other = synthetic_rollout(model, 8, 12, 16, seed=4)
    assert not torch.equal(batch.responses, other.responses)
    assert other.rollout_is_weights is None


def test_full_length_and_fixed_lengths():
    model = tiny_causal_lm("qwen2")
    batch = synthetic_rollout(model, 8, 10, 16, full_length=True, with_ref=False)
    assert batch.ref_log_probs is None and batch.old_log_probs.dtype == torch.float32
    assert int(batch.response_mask.sum()) == 128
    assert batch.attention_mask[:, :10].sum(1).min() >= 5
    fixed = synthetic_rollout(model, 4, 10, 16, vary_lengths=False)
    assert bool(fixed.attention_mask.all())


def test_group_advantages():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    a = group_advantages(r, 4)
    assert torch.allclose(a[:4], (r[:4] - 0.25) / (r[:4].std() + 1e-6))
    assert torch.all(a[4:] == 0)
    assert torch.all(group_advantages(torch.tensor([1.0]), 4) == 0)
