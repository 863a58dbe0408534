"""The critic: the value loss, value predictions, and the critic's update through the engine's own step,
against an independent plain float64 reference and across splits (float64 tiny Llama)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from splitproof.diagnose.per_microbatch import per_microbatch
from splitproof.engine import CriticUpdateConfig, compute_values, response_values
from splitproof.engine.norm_gradients import float64_norm_gradients
from splitproof.loss_config import AGG_MODES, ValueLossConfig
from splitproof.losses.value import value_loss
from splitproof.oracle import oracle_value_objective
from splitproof.stats import MinibatchStats
from splitproof.value_objective import explained_variance, value_objective, value_share

from .critic_helpers import critic_rollout, make_models, run_critic
from .engine_helpers import BUDGET, NO_CLIP, REL, assert_metrics_close, flat, full_state, permutation, rel_diff

FLOOR = 1e-12  # float64 objective vs reference: measured below 3e-16 relative


@pytest.fixture(scope="module")
def models():
    return make_models()


@pytest.fixture(scope="module")
def batch(models):
    policy, critic = models
    return critic_rollout(policy, critic)


def test_value_loss_formula():
    """ℓ = ½·max((v − R)², (clamp(v, V_old ± c) − R)²): clipped and larger, inside the band, clipped but smaller."""
    v = torch.tensor([1.0, 0.2, 1.0], dtype=torch.float64)
    old = torch.zeros(3, dtype=torch.float64)
    ret = torch.tensor([2.0, 2.0, 0.4], dtype=torch.float64)
    terms = value_loss(v, old, ret, 0.5)
    assert torch.allclose(
        terms.loss, torch.tensor([0.5 * 1.5**2, 0.5 * 1.8**2, 0.5 * 0.6**2], dtype=torch.float64), rtol=0, atol=1e-15
    )
    assert terms.clipfrac.tolist() == [True, False, False]


def _random_inputs(seed: int, rows: int = 6, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, width + 1, (rows,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)
    mask = torch.arange(width)[None] < lengths[:, None]
    mask[1, ::3] = False  # a multi-turn hole
    old = torch.randn(rows, width, generator=g, dtype=torch.float64)
    vpreds = old + 0.8 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    returns = old + 2.0 * torch.randn(rows, width, generator=g, dtype=torch.float64)
    for t in (old, returns):
        t[~mask] = float("nan")
    return vpreds, old, returns, mask


def _groups(rows: int, seed: int = 0) -> torch.Tensor:
    """Random prompt-group ids (group-mean-token-mean); sizes differ, ids are not in row order."""
    return torch.randint(0, 3, (rows,), generator=torch.Generator().manual_seed(100 + seed)) * 7 - 4


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_objective_matches_reference(agg_mode, seed):
    vpreds, old, returns, mask = _random_inputs(seed)
    index = _groups(len(mask), seed)
    config = ValueLossConfig(cliprange_value=0.4, loss_agg_mode=agg_mode, loss_scale_factor=5.0 if seed == 1 else None)
    v1 = vpreds.clone().requires_grad_(True)
    v2 = vpreds.clone().requires_grad_(True)
    loss, metrics = value_objective(v1, old, returns, mask, config, index=index)
    ref, ref_metrics = oracle_value_objective(
        v2,
        old,
        returns,
        mask,
        cliprange_value=0.4,
        loss_agg_mode=agg_mode,
        loss_scale_factor=config.loss_scale_factor,
        index=index,
    )
    loss.backward()
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) <= FLOOR * abs(float(ref.detach()))
    assert (v1.grad - v2.grad).abs().max() <= FLOOR * v2.grad.abs().max()
    assert torch.isfinite(v1.grad).all() and (v1.grad[~mask] == 0).all()
    assert_metrics_close(metrics, ref_metrics, rel=FLOOR)
    assert 0 < metrics["critic/vf_clipfrac"] < 1


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_shares_of_any_partition_add_up(agg_mode):
    vpreds, old, returns, mask = _random_inputs(5, rows=9)
    index = _groups(9)
    config = ValueLossConfig(loss_agg_mode=agg_mode)
    whole, metrics = value_objective(vpreds, old, returns, mask, config, index=index)
    stats = MinibatchStats.of(mask, index=index)
    total, sums = 0.0, {}
    for rows in ([4, 0], [7], [2, 8, 1], [3, 5, 6]):
        share, shares = value_share(
            vpreds[rows], old[rows], returns[rows], mask[rows], config, stats, index=index[rows]
        )
        total += float(share)
        for k, x in shares.items():
            sums[k] = sums.get(k, 0.0) + float(x)
    assert abs(total - float(whole)) <= FLOOR * abs(float(whole))
    assert_metrics_close(sums, metrics, rel=FLOOR)


def test_explained_variance():
    vpreds, old, returns, mask = _random_inputs(2)
    v, r = old[mask], returns[mask]
    expected = 1 - float(((r - v) - (r - v).mean()).pow(2).sum() / (len(r) - 1)) / (float(r.var()) + 1e-5)
    assert abs(explained_variance(old, returns, mask) - expected) <= 1e-12


def _one_sequence_values(critic, batch, row):
    """The value head's outputs before each response token, from a plain forward of the unpadded sequence."""
    P = batch.prompt_width
    att = batch.attention_mask[row].bool()
    ids = batch.input_ids[row][att][None]
    n_prompt = int(att[:P].sum())
    n_resp = int(att[P:].sum())
    with torch.no_grad():
        out = critic(input_ids=ids).logits[0, :, 0]
    return out[n_prompt - 1 : n_prompt - 1 + n_resp]


def test_values_convention_and_splits(models, batch):
    """The value at response position t is the head's output at the token before response token t; no
    microbatching, token budget or packing changes any value."""
    _, critic = models
    values = compute_values(critic, batch, micro_batch_size=len(batch))
    for row in range(len(batch)):
        n = int(batch.attention_mask[row, batch.prompt_width :].sum())
        assert (values[row, :n] - _one_sequence_values(critic, batch, row)).abs().max() <= 1e-12
        assert (values[row, n:] == 0).all()
    for kwargs in (
        dict(micro_batch_size=1),
        dict(micro_batch_size=3),
        dict(max_token_len=BUDGET),
        dict(max_token_len=BUDGET, packed=True),
        dict(max_token_len=80, packed=True),
    ):
        assert (compute_values(critic, batch, **kwargs) - values).abs().max() <= 1e-12, kwargs
    order = permutation(len(batch))
    assert (compute_values(critic, batch.select(order), micro_batch_size=3) - values[order]).abs().max() <= 1e-12


def test_values_are_differentiable(models, batch):
    _, critic = models
    critic = copy.deepcopy(critic)
    v = response_values(critic, batch.select([0, 2, 3]), packed=True)
    v.sum().backward()
    assert critic.score.weight.grad is not None and critic.score.weight.grad.abs().sum() > 0


def _reference_step(critic, batch, config: CriticUpdateConfig, lr: float):
    """An independent SGD step: per-sequence plain forwards, the float64 reference objective, backward."""
    critic = copy.deepcopy(critic)
    with float64_norm_gradients(critic):  # the float64 gradient, as the engine's
        rows = []
        for row in range(len(batch)):
            P = batch.prompt_width
            att = batch.attention_mask[row].bool()
            n_prompt, n_resp = int(att[:P].sum()), int(att[P:].sum())
            out = critic(input_ids=batch.input_ids[row][att][None]).logits[0, :, 0]
            v = torch.zeros(batch.response_width, dtype=torch.float64)
            v = torch.cat([out[n_prompt - 1 : n_prompt - 1 + n_resp], v[n_resp:]])
            rows.append(v)
        vpreds = torch.stack(rows)
        loss, metrics = oracle_value_objective(
            vpreds,
            batch.values,
            batch.returns,
            batch.response_mask,
            cliprange_value=config.cliprange_value,
            loss_agg_mode=config.loss_agg_mode,
            index=batch.index,
        )
        loss.backward()
    with torch.no_grad():
        for p in critic.parameters():
            p -= lr * p.grad
    return flat(full_state(critic)), metrics


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_update_matches_reference(models, batch, agg_mode):
    """One critic step through the engine (three microbatches, cutting the prompt groups of two) = an
    independent float64 SGD step."""
    _, critic = models
    batch = replace(batch, index=torch.arange(len(batch)) // 2)
    config = CriticUpdateConfig(
        ppo_mini_batch_size=len(batch),
        ppo_micro_batch_size_per_gpu=3,
        grad_clip=NO_CLIP,
        cliprange_value=0.2,
        loss_agg_mode=agg_mode,
    )
    params, steps = run_critic(critic, batch, config, lr=0.05)
    ref_params, ref_metrics = _reference_step(critic, batch, config, 0.05)
    theta0 = flat(full_state(critic))
    assert rel_diff(params, ref_params, theta0, ref_params) <= REL
    metrics = {k: v for k, v in steps[0].metrics.items() if k in ref_metrics}
    assert_metrics_close(metrics, ref_metrics, label=agg_mode)
    assert 0 < ref_metrics["critic/vf_clipfrac"] < 1  # the clip is exercised


def test_update_metrics_and_steps(models, batch):
    _, critic = models
    config = CriticUpdateConfig(
        ppo_mini_batch_size=2, rollout_n=2, ppo_epochs=2, shuffle=True, ppo_micro_batch_size_per_gpu=1, grad_clip=0.5
    )
    _, steps = run_critic(critic, batch, config, optimizer="adamw")
    assert len(steps) == 4  # 8 sequences / minibatches of 2 x 2 = 2 steps per epoch
    for step in steps:
        assert set(step.metrics) == {
            "critic/vf_loss",
            "critic/vf_clipfrac",
            "critic/vpred_mean",
            "critic/grad_norm",
            "critic/step_skipped",
        }
        assert step.metrics["critic/step_skipped"] == 0.0 and not step.skipped


@pytest.fixture(scope="module")
def exact_critic():
    return make_models(exact_norms=True)[1]  # several AdamW steps: see make_models


@pytest.mark.parametrize("split", ["micro1", "micro3", "budget", "packed"])
def test_update_is_split_invariant(exact_critic, batch, split):
    """Several minibatches and epochs (shuffled), AdamW, clipping on: any split gives the same update."""
    critic = exact_critic
    common = dict(
        ppo_mini_batch_size=4,
        ppo_epochs=2,
        shuffle=True,
        data_loader_seed=5,
        grad_clip=0.3,
        loss_agg_mode="seq-mean-token-mean",
    )
    base_params, base_steps = run_critic(critic, batch, CriticUpdateConfig(**common), optimizer="adamw")
    if split == "micro1":
        config = CriticUpdateConfig(**common, ppo_micro_batch_size_per_gpu=1)
    elif split == "micro3":
        config = CriticUpdateConfig(**common, ppo_micro_batch_size_per_gpu=3)
    elif split == "budget":
        config = CriticUpdateConfig(**common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET)
    else:
        config = CriticUpdateConfig(
            **common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET, use_remove_padding=True
        )
    params, steps = run_critic(critic, batch, config, optimizer="adamw")
    theta0 = flat(full_state(critic))
    assert rel_diff(params, base_params, theta0) <= REL
    for a, b in zip(steps, base_steps):
        assert_metrics_close(a.metrics, b.metrics, label=split)


def test_per_microbatch_scope_is_verl_before_its_pr_6957(models, batch):
    """Per-microbatch statistics (the diagnosis's legacy column) = Σ over microbatches of the value loss
    normalised by each microbatch's own tokens: the independent reference applied microbatch by microbatch."""
    _, critic = models
    config = CriticUpdateConfig(
        ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=3, grad_clip=NO_CLIP, cliprange_value=0.2
    )
    params, steps = run_critic(critic, batch, config, make_objective=per_microbatch(value=True))
    model = copy.deepcopy(critic)
    total = 0.0
    with float64_norm_gradients(model):
        for rows in ([0, 1, 2], [3, 4, 5], [6, 7]):
            sub = batch.select(rows)
            loss, _ = oracle_value_objective(
                response_values(model, sub), sub.values, sub.returns, sub.response_mask, cliprange_value=0.2
            )
            loss.backward()
            total += float(loss.detach())
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.02 * p.grad
    theta0 = flat(full_state(critic))
    assert rel_diff(params, flat(full_state(model)), theta0) <= REL
    assert abs(steps[0].metrics["critic/vf_loss"] - total) <= FLOOR * total
    one, _ = run_critic(critic, batch, config)
    assert rel_diff(params, one, theta0) > 0.1  # and it is not the minibatch's objective
