"""`objective` equals the independent plain float64 oracle, in value, gradient and metrics (1e-12)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof import objective
from splitproof.oracle import oracle_objective, oracle_selection
from splitproof.oracle import priority_hash as oracle_hash
from splitproof.selection import priority_hash

from .factories import ALL_MODES, config_for, random_minibatch

REL = 1e-12


def evaluate(fn, mb, config, step):
    log_prob = mb.log_prob.clone().requires_grad_(True)
    entropy = None if mb.entropy is None else mb.entropy.clone().requires_grad_(True)
    loss, metrics = fn(
        log_prob,
        mb.old_log_prob,
        mb.advantages,
        mb.response_mask,
        config,
        ref_log_prob=mb.ref_log_prob,
        rollout_is_weights=mb.rollout_is_weights,
        entropy=entropy,
        seq_ids=mb.seq_ids,
        index=mb.index,
        step=step,
    )
    inputs = [log_prob] + ([entropy] if entropy is not None else [])
    grads = torch.autograd.grad(loss, inputs, allow_unused=True)
    return float(loss.detach()), metrics, grads


@pytest.mark.parametrize("loss_mode,agg_mode", ALL_MODES)
@settings(max_examples=10)
@given(
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 6),
    width=st.integers(1, 8),
    use_kl=st.booleans(),
    weights=st.booleans(),
    entropy=st.booleans(),
    kl_type=st.sampled_from(["k1", "abs", "k2", "low_var_kl", "k3+", "abs+"]),
    ratio=st.sampled_from([2e-4, 0.1, 0.4]),
)
def test_objective_matches_oracle(loss_mode, agg_mode, seed, batch, width, use_kl, weights, entropy, kl_type, ratio):
    mb = random_minibatch(seed, batch, width, with_weights=weights, with_entropy=entropy, quantized=seed % 3 == 0)
    config = config_for(
        loss_mode,
        agg_mode,
        use_kl_loss=use_kl,
        kl_loss_type=kl_type,
        entropy_coeff=0.02 if entropy else 0.0,
        kl_cov_ratio=ratio,
        clip_cov_ratio=ratio,
        clip_ratio_low=0.15,
        clip_ratio_high=0.28,
    )
    loss_a, metrics_a, grads_a = evaluate(objective, mb, config, step=5)
    loss_b, metrics_b, grads_b = evaluate(oracle_objective, mb, config, step=5)
    assert abs(loss_a - loss_b) <= REL * max(1.0, abs(loss_b))
    assert metrics_a.keys() == metrics_b.keys()
    for name in metrics_a:
        assert abs(metrics_a[name] - metrics_b[name]) <= REL * max(1.0, abs(metrics_b[name])), name
    for ga, gb in zip(grads_a, grads_b):
        if ga is None or gb is None:
            assert (ga is None or not ga.any()) and (gb is None or not gb.any())
            continue
        assert float((ga - gb).abs().max()) <= REL * max(1e-300, float(gb.abs().max()))
    if config.is_cov:
        from splitproof.policy_objective import policy_inputs
        from splitproof.selection import select_tokens

        mask = mb.response_mask
        adv = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None].expand(mask.shape)
        x = policy_inputs(mb.log_prob, mb.old_log_prob, adv, mask)
        ours = select_tokens(x, config, mb.seq_ids, step=5)
        theirs = oracle_selection(mb.log_prob, mb.old_log_prob, mb.advantages, mask, config, seq_ids=mb.seq_ids, step=5)
        assert torch.equal(ours, theirs.to(ours.device))


def test_priority_hash_matches_oracle_definition():
    ids = torch.tensor([0, 7, 123456, 2**31 + 5])
    pos = torch.tensor([0, 11, 3, 1])
    for seed, step in [(0, 0), (42, 3), (-1, 2**40 + 1)]:
        ours = priority_hash(seed, step, ids, pos).tolist()
        assert ours == [oracle_hash(seed, step, int(i), int(p)) for i, p in zip(ids, pos)]
