"""Issue 2 acceptance: any partition of a minibatch into parts reproduces the single-pass objective.

Float64; the parts' shares, gradients and merged metrics must match `objective` to 1e-12 relative.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof import MinibatchStats, minibatch_share, objective
from splitproof.policy_objective import merge_metric_shares, policy_inputs
from splitproof.selection import combine_terms, cov_terms, mark, merge_proposals, propose

from .factories import ALL_MODES, config_for, random_minibatch

REL = 1e-12

warnings.filterwarnings("ignore", message="loss_mode .* aggregates its policy term")


def close(a: float, b: float, scale: float = 1.0) -> bool:
    return abs(a - b) <= REL * max(abs(a), abs(b), scale)


@st.composite
def partitions(draw, batch: int):
    order = draw(st.permutations(range(batch)))
    cuts = sorted(draw(st.sets(st.integers(1, batch - 1), max_size=batch - 1))) if batch > 1 else []
    bounds = [0, *cuts, batch]
    return [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]


def split_selection(mb, config, parts, step):
    """The selection each part gets when the parts propose and merge, as DP ranks do."""
    mask = mb.response_mask
    sums = combine_terms([cov_terms(mb.advantages_bt[rows], mb.log_prob[rows], mask[rows]) for rows in parts])
    proposals, k = [], None
    for rows in parts:
        x = policy_inputs(mb.log_prob[rows].detach(), mb.old_log_prob[rows], mb.advantages_bt[rows], mask[rows])
        k, proposal = propose(x, config, mb.seq_ids[rows], sums, step)
        proposals.append(proposal)
    chosen = merge_proposals(proposals, k)
    return [mark(chosen, mb.seq_ids[rows], mask[rows].shape) for rows in parts]


def run_parts(mb, config, parts, step=0):
    log_prob = mb.log_prob.clone().requires_grad_(True)
    entropy = None if mb.entropy is None else mb.entropy.clone().requires_grad_(True)
    stats = MinibatchStats.of(mb.response_mask, index=mb.index)
    selections = split_selection(mb, config, parts, step) if config.is_cov else [None] * len(parts)
    total, metrics = 0.0, {}
    for rows, selection in zip(parts, selections):
        share, shares = minibatch_share(
            log_prob[rows],
            mb.old_log_prob[rows],
            mb.advantages_bt[rows],
            mb.response_mask[rows],
            config,
            stats,
            ref_log_prob=None if mb.ref_log_prob is None else mb.ref_log_prob[rows],
            rollout_is_weights=None if mb.rollout_is_weights is None else mb.rollout_is_weights[rows],
            entropy=None if entropy is None else entropy[rows],
            selection=selection,
            index=mb.index[rows],
        )
        total = total + share
        merge_metric_shares(metrics, shares)
    inputs = [log_prob] + ([entropy] if entropy is not None else [])
    grads = torch.autograd.grad(total, inputs, allow_unused=True)
    return float(total.detach()), {k: float(v) for k, v in metrics.items()}, grads


def run_whole(mb, config, step=0):
    log_prob = mb.log_prob.clone().requires_grad_(True)
    entropy = None if mb.entropy is None else mb.entropy.clone().requires_grad_(True)
    loss, metrics = objective(
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
    return float(loss.detach()), metrics, torch.autograd.grad(loss, inputs, allow_unused=True)


def assert_same_update(whole, parts):
    (loss_w, metrics_w, grads_w), (loss_p, metrics_p, grads_p) = whole, parts
    assert close(loss_w, loss_p), (loss_w, loss_p)
    assert metrics_w.keys() == metrics_p.keys()
    for name in metrics_w:
        assert close(metrics_w[name], metrics_p[name]), (name, metrics_w[name], metrics_p[name])
    for gw, gp in zip(grads_w, grads_p):
        gw = torch.zeros(()) if gw is None else gw
        gp = torch.zeros(()) if gp is None else gp
        assert torch.isfinite(gw).all() and torch.isfinite(gp).all()
        scale = max(float(gw.abs().max()), 1e-300)
        assert float((gw - gp).abs().max()) <= REL * scale


def prepared(seed, batch, width, **kw):
    mb = random_minibatch(seed, batch, width, **kw)
    shape = mb.response_mask.shape
    mb.advantages_bt = mb.advantages if mb.advantages.dim() == 2 else mb.advantages[:, None].expand(shape)
    return mb


@pytest.mark.parametrize("loss_mode,agg_mode", ALL_MODES)
@settings(max_examples=12)
@given(
    data=st.data(),
    seed=st.integers(0, 2**31 - 1),
    batch=st.integers(1, 7),
    width=st.integers(1, 9),
    use_kl=st.booleans(),
    weights=st.booleans(),
    entropy=st.booleans(),
)
def test_parts_sum_to_objective(loss_mode, agg_mode, data, seed, batch, width, use_kl, weights, entropy):
    mb = prepared(seed, batch, width, with_weights=weights, with_entropy=entropy, quantized=seed % 3 == 0)
    config = config_for(
        loss_mode,
        agg_mode,
        use_kl_loss=use_kl,
        entropy_coeff=0.01 if entropy else 0.0,
        kl_cov_ratio=data.draw(st.sampled_from([2e-4, 0.1, 0.4])),
        clip_cov_ratio=data.draw(st.sampled_from([2e-4, 0.1, 0.4])),
        loss_scale_factor=data.draw(st.sampled_from([None, 7.0])),
    )
    parts = data.draw(partitions(batch))
    assert_same_update(run_whole(mb, config, step=3), run_parts(mb, config, parts, step=3))


def test_padding_nan_never_reaches_loss_or_gradient():
    mb = prepared(7, 6, 8)
    config = config_for("vanilla", "token-mean", use_kl_loss=True, entropy_coeff=0.1)
    loss, metrics, grads = run_whole(mb, config)
    assert all(v == v for v in metrics.values())
    for g in grads:
        assert torch.isfinite(g).all()
        assert (g[~mb.response_mask] == 0).all()


def test_gmpo_seed_uneven_parts_are_weighted_means():
    """Seed gmpo-microbatch-bug: contribution = local_mean × local_count / minibatch_count."""
    mb = prepared(11, 8, 16, with_weights=False, with_entropy=False, nan_padding=False)
    mb.response_mask[:] = True
    mb.response_mask[5] = False  # an empty sequence counts nowhere
    config = config_for("geo_mean", "token-mean")
    stats = MinibatchStats.of(mb.response_mask)
    assert stats.num_sequences == 7
    whole, _ = objective(mb.log_prob, mb.old_log_prob, mb.advantages, mb.response_mask, config)
    total = 0.0
    for rows in ([0, 1, 2], [3, 4, 5], [6], [7]):
        part_mask = mb.response_mask[rows]
        share, _ = minibatch_share(
            mb.log_prob[rows], mb.old_log_prob[rows], mb.advantages_bt[rows], part_mask, config, stats
        )
        local_count = int(part_mask.any(-1).sum())
        local_stats = MinibatchStats.of(part_mask)
        local_mean, _ = (
            minibatch_share(
                mb.log_prob[rows], mb.old_log_prob[rows], mb.advantages_bt[rows], part_mask, config, local_stats
            )
            if local_count
            else (torch.zeros(()), None)
        )
        assert close(float(share), float(local_mean) * local_count / stats.num_sequences)
        total += float(share)
    assert close(total, float(whole))


@pytest.mark.parametrize("cuts", [[8192], [1024] * 8, [100, 3000, 92, 5000], [128] * 64])
def test_klcov_seed_one_token_however_cut(cuts):
    """Seed klcov-microbatch-bug: 8,192 valid tokens at ratio 2e-4 select exactly one token."""
    g = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(64, 128, generator=g, dtype=torch.float64) * 5
    mb_adv = torch.randn(64, generator=g, dtype=torch.float64)[:, None].expand(64, 128)
    mask = torch.ones(64, 128, dtype=torch.bool)
    seq_ids = torch.arange(64)
    config = config_for("kl_cov", "token-mean", kl_cov_ratio=2e-4)
    flat_rows = torch.arange(64).repeat_interleave(128)
    # cut the flattened token stream into parts of whole sequences (sequences are never split)
    parts, start = [], 0
    for size in cuts:
        rows = sorted(set(flat_rows[start : start + size].tolist()) - {r for p in parts for r in p})
        if rows:
            parts.append(rows)
        start += size
    sums = combine_terms([cov_terms(mb_adv[rows], log_prob[rows], mask[rows]) for rows in parts])
    assert sums.num_tokens == 8192
    proposals, k = [], None
    for rows in parts:
        x = policy_inputs(log_prob[rows], log_prob[rows], mb_adv[rows], mask[rows])
        k, proposal = propose(x, config, seq_ids[rows], sums)
        proposals.append(proposal)
    assert k == 1
    chosen = merge_proposals(proposals, k)
    selected = sum(int(mark(chosen, seq_ids[rows], mask[rows].shape).sum()) for rows in parts)
    assert selected == 1
    _, metrics = objective(log_prob, log_prob, mb_adv, mask, config)
    assert metrics["cov_selected"] == 1.0


@pytest.mark.parametrize("loss_mode,agg_mode", ALL_MODES)
def test_one_sequence_parts_in_reverse_order(loss_mode, agg_mode):
    mb = prepared(1234, 6, 7, quantized=True)
    config = config_for(loss_mode, agg_mode, use_kl_loss=True, entropy_coeff=0.05, kl_cov_ratio=0.2, clip_cov_ratio=0.2)
    parts = [[i] for i in reversed(range(6))]
    assert_same_update(run_whole(mb, config, step=1), run_parts(mb, config, parts, step=1))
