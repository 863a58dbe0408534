"""verl's ``use_prefix_grouper`` (``splitproof.engine.shared_prefix``): each distinct prompt computed once.

The promise with it on: the no-grad log-probs are bitwise independent of the micro-batching, the token
budget and the row order (float64); the update equals itself across splits, orders and DP ranks to the
engine's float64 tolerance (1e-10 relative to the update size; ``tests/test_engine.py`` measures
re-association at <= 5e-14). Against ``use_prefix_grouper=false`` it computes the same function with
other roundings: measured here in float64 the no-grad log-probs and entropies came out bitwise equal
and the updates within 1e-14 relative of each other, so the comparison holds them to the same 1e-10.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from splitproof.batch import RolloutBatch
from splitproof.engine import UpdateConfig
from splitproof.engine.logprobs import compute_log_probs
from splitproof.engine.microbatch import minibatch_schedule
from splitproof.engine.shared_prefix import grouped_microbatches, prompt_groups

from .engine_helpers import (
    NO_CLIP,
    REL,
    assert_metrics_close,
    flat,
    loss_config,
    make_model,
    make_rollout,
    permutation,
    rel_diff,
    run_update,
    split_runs,
)

ARCHS = ("llama", "qwen2")
GROUPS = [0, 0, 1, 0, 1, 2, 2, 0, 1, 3, 2, 1]  # 12 rows: groups of 4, 4, 3 and 1, rows scattered


def shared_prompt_rollout(model, seed: int = 1) -> RolloutBatch:
    """12 sequences of 4 prompts (``GROUPS``), with a multi-turn response (tool tokens: attention without
    response_mask), an empty response, and a hole in one response's attention; old and reference
    log-probs are the model's own plus noise (ratios near 1)."""
    batch = make_rollout(model, 12, seed=seed)
    P = batch.prompt_width
    firsts = [GROUPS.index(g) for g in GROUPS]
    attention = batch.attention_mask.clone()
    attention[:, :P] = batch.attention_mask[firsts, :P]
    responses = batch.responses.clone()
    lengths = attention[:, P:].sum(1)
    holed = int((lengths >= 5).nonzero()[-1, 0])
    attention[holed, P + 2] = 0  # padding inside a response: a query that no later token sees
    responses[holed, 2] = 0
    response_mask = batch.response_mask.clone().bool() & attention[:, P:].bool()
    batch = replace(
        batch,
        prompts=batch.prompts[firsts].clone(),
        responses=responses,
        attention_mask=attention,
        response_mask=response_mask,
        index=torch.tensor(GROUPS),
    )
    logp, _ = compute_log_probs(model, batch, micro_batch_size=len(batch))
    g = torch.Generator().manual_seed(seed)
    valid = batch.response_mask.bool()
    noise = 0.1 * torch.randn(logp.shape, generator=g, dtype=torch.float64).to(logp.dtype)
    old = torch.where(valid, logp + noise, torch.zeros_like(logp))
    ref = torch.where(valid, logp - noise, torch.zeros_like(logp))
    return replace(batch, old_log_probs=old, ref_log_probs=ref).validate()


@pytest.fixture(scope="module", params=ARCHS)
def setup(request):
    model = make_model(request.param, torch.float64)
    return request.param, model, shared_prompt_rollout(model)


def test_rows_of_one_prompt_share_a_group(setup):
    _, _, batch = setup
    groups, firsts = prompt_groups(batch)
    assert groups == GROUPS and firsts == [0, 2, 5, 9]
    # the same prompt tokens left-padded differently (another microbatch's width) are the same prompt
    wider = replace(
        batch,
        prompts=torch.cat([torch.zeros(len(batch), 3, dtype=batch.prompts.dtype), batch.prompts], dim=1),
        attention_mask=torch.cat([torch.zeros(len(batch), 3, dtype=torch.bool), batch.attention_mask], dim=1),
    )
    assert prompt_groups(wider) == (groups, firsts)
    other = batch.prompts.clone()
    other[4, -1] += 1  # one token differs: another prompt
    changed, _ = prompt_groups(replace(batch, prompts=other))
    assert changed[4] not in changed[:4] + changed[5:]


def test_grouped_microbatches_keep_groups_together(setup):
    _, _, batch = setup
    fixed = grouped_microbatches(batch, 4, None, "log_prob_micro_batch_size_per_gpu")
    assert fixed == [[0, 1, 3, 7], [2, 4, 8, 11], [5, 6, 10, 9]]
    budget = grouped_microbatches(batch, None, 60, "log_prob_micro_batch_size_per_gpu")
    assert len(budget) >= 3 and sorted(sum(budget, [])) == list(range(12))


@pytest.mark.invariance
def test_no_grad_log_probs_are_layout_invariant(setup):
    """Old/reference log-probs and entropy with prefix grouping: the same bits for every micro-batch size,
    token budget and row order — and the same bits as without it (measured; float64)."""
    arch, model, batch = setup
    kw = dict(with_entropy=True, temperature=0.8, prefix_grouper=True)
    logp, entropy = compute_log_probs(model, batch, micro_batch_size=len(batch), **kw)
    order = permutation(len(batch))
    back = torch.argsort(torch.tensor(order))
    for name, split, rows in (
        ("micro1", dict(micro_batch_size=1), None),
        ("micro5", dict(micro_batch_size=5), None),
        ("budget40", dict(max_token_len=40), None),
        ("budget200", dict(max_token_len=200), None),
        ("shuffled+micro3", dict(micro_batch_size=3), order),
    ):
        part = batch if rows is None else batch.select(rows)
        lp, h = compute_log_probs(model, part, **split, **kw)
        if rows is not None:
            lp, h = lp[back], h[back]
        assert torch.equal(lp, logp) and torch.equal(h, entropy), f"{arch} {name}"
    plain, plain_entropy = compute_log_probs(model, batch, micro_batch_size=5, with_entropy=True, temperature=0.8)
    assert torch.equal(plain, logp) and torch.equal(plain_entropy, entropy), arch


@pytest.mark.parametrize("loss_mode,agg_mode", [("vanilla", "token-mean"), ("kl_cov", "seq-mean-token-mean")])
def test_update_is_split_invariant_with_prefix_grouper(setup, loss_mode, agg_mode):
    """Weights and every metric after one step with prefix grouping: equal across micro-batch sizes, token
    budgets and row orders (1e-10 relative), and equal to the update without it."""
    arch, model, batch = setup
    loss = loss_config(loss_mode, agg_mode)
    theta0 = flat(model.state_dict())
    base = dict(loss=loss, ppo_mini_batch_size=len(batch), grad_clip=NO_CLIP)
    one, (reference,) = run_update(model, batch, UpdateConfig(**base, use_prefix_grouper=True))
    plain, (plain_result,) = run_update(model, batch, UpdateConfig(**base))
    assert rel_diff(plain, one, theta0) <= REL, f"{arch}: with and without prefix grouping"
    assert_metrics_close(plain_result.metrics, reference.metrics, label=f"{arch} plain")
    for name, b, cfg in split_runs(batch, loss, use_prefix_grouper=True):
        params, (result,) = run_update(model, b, cfg)
        diff = rel_diff(one, params, theta0)
        assert diff <= REL, f"{arch} {loss_mode}/{agg_mode} {name}: parameters differ by {diff:.3e}"
        assert_metrics_close(reference.metrics, result.metrics, label=f"{arch} {name}")


def test_shuffled_minibatches_and_epochs_with_prefix_grouper(setup):
    """3 minibatches × 2 epochs, shuffled, momentum, clipping on: micro 1 == one microbatch == plain."""
    _, model, batch = setup
    base = dict(
        loss=loss_config("geo_mean", "seq-mean-token-sum"),
        ppo_mini_batch_size=4,
        ppo_epochs=2,
        shuffle=True,
        data_loader_seed=3,
        grad_clip=1.0,
        temperature=0.9,
    )
    assert len(minibatch_schedule(12, 4, epochs=2, shuffle=True, seed=3)) == 6
    theta0 = flat(model.state_dict())
    whole, whole_results = run_update(model, batch, UpdateConfig(**base, use_prefix_grouper=True), optimizer="momentum")
    for kw in (dict(ppo_micro_batch_size_per_gpu=1, use_prefix_grouper=True), {}):
        other, results = run_update(model, batch, UpdateConfig(**base, **kw), optimizer="momentum")
        assert rel_diff(whole, other, theta0) <= REL
        for step, (a, b) in enumerate(zip(whole_results, results)):
            assert_metrics_close(a.metrics, b.metrics, label=f"{kw} step {step}")


def test_the_grouped_forward_is_really_taken(setup, monkeypatch):
    """Negative control: with the prompt pass's logits perturbed, the grouped log-probs move (and the
    plain ones do not), so the comparisons above compare two different computations."""
    import splitproof.engine.shared_prefix as shared_prefix

    _, model, batch = setup
    real = shared_prefix.logits_of
    calls = []

    def shifted(out):
        calls.append(1)
        return real(out) * 1.001

    monkeypatch.setattr(shared_prefix, "logits_of", shifted)
    plain, _ = compute_log_probs(model, batch, micro_batch_size=4)
    grouped, _ = compute_log_probs(model, batch, micro_batch_size=4, prefix_grouper=True)
    assert calls and not torch.equal(plain, grouped)


def test_lora_update_with_prefix_grouper():
    """A LoRA adapter's update (AdamW): with prefix grouping in 3-row microbatches equal to the plain
    one-microbatch update (1e-10 relative to the adapter's update; measured 1.6e-12)."""
    import copy

    from splitproof.lora import adapter_state

    from .lora_helpers import lora_model, lora_update

    model = lora_model()
    batch = shared_prompt_rollout(model)
    base = dict(loss=loss_config("vanilla", "token-mean"), ppo_mini_batch_size=len(batch), grad_clip=NO_CLIP)
    plain, _, _ = lora_update(copy.deepcopy(model), batch, UpdateConfig(**base))
    grouped, _, _ = lora_update(
        copy.deepcopy(model), batch, UpdateConfig(**base, use_prefix_grouper=True, ppo_micro_batch_size_per_gpu=3)
    )
    assert rel_diff(plain, grouped, flat(adapter_state(model))) <= REL
