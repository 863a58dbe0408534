"""group-mean-token-mean: the token mean within each prompt group, then the mean over the minibatch's groups.

Objective level: hand-computed values, when it coincides with seq-mean-token-mean / token-mean, group
statistics merged by addition, the group ids in the batch contract. Engine level (float64 tiny Llama): the
update equals the independent reference's whatever the split — groups cut across microbatches, token
budgets, packing, orders, minibatches — and bad or missing group ids fail before anything moves.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof import BatchError, MinibatchStats, RolloutBatch, objective
from splitproof.diagnose.per_microbatch import per_microbatch
from splitproof.engine import UpdateConfig, response_log_probs, update_policy
from splitproof.engine.microbatch import minibatch_schedule
from splitproof.engine.plan import plan_update
from splitproof.loss_config import AGG_MODES, LossConfig
from splitproof.oracle import oracle_objective

from .engine_helpers import (
    BUDGET,
    NO_CLIP,
    REL,
    assert_metrics_close,
    flat,
    grouped_rollout,
    loss_config,
    make_model,
    make_optimizer,
    rel_diff,
    run_update,
)
from .factories import config_for, random_minibatch

GROUP = "group-mean-token-mean"
D = torch.float64


def leaf(values) -> torch.Tensor:
    return torch.tensor(values, dtype=D).requires_grad_()


# ---- the objective ------------------------------------------------------------------------------------


def test_hand_computed_value_and_gradient():
    """gpg with A = −1 makes ℓ = log π: J is the mean over groups of each group's token mean."""
    values = [[1.0, 2.0, 0.0], [3.0, 0.0, 0.0], [4.0, 5.0, 6.0], [7.0, 0.0, 0.0]]
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    index = torch.tensor([7, 9, 7, 4])  # group 4 holds only an empty sequence: it counts nowhere
    adv = -torch.ones(4, dtype=D)
    config = LossConfig(loss_mode="gpg", loss_agg_mode=GROUP)
    # group 7: tokens 1, 2, 4, 5, 6 (n = 5, mean 18/5); group 9: token 3 (mean 3); G_groups = 2
    expected = (18 / 5 + 3) / 2
    grad_expected = torch.tensor([[0.1, 0.1, 0.0], [0.5, 0.0, 0.0], [0.1, 0.1, 0.1], [0.0, 0.0, 0.0]], dtype=D)
    for fn in (objective, oracle_objective):
        lp = leaf(values)
        loss, metrics = fn(lp, torch.zeros(4, 3, dtype=D), adv, mask, config, index=index)
        loss.backward()
        assert loss.item() == pytest.approx(expected, rel=1e-15), fn.__name__
        assert metrics["pg_loss"] == pytest.approx(expected, rel=1e-15)
        assert torch.allclose(lp.grad, grad_expected, rtol=1e-15, atol=0), fn.__name__
    seq_mean, _ = objective(
        leaf(values),
        torch.zeros(4, 3, dtype=D),
        adv,
        mask,
        config.replace(loss_agg_mode="seq-mean-token-mean"),
        index=index,
    )
    assert seq_mean.item() == pytest.approx((1.5 + 3 + 5) / 3)  # per sequence: a different objective


def _objective_value(mb, agg_mode, index):
    config = config_for("vanilla", agg_mode, use_kl_loss=True, entropy_coeff=0.03)
    loss, _ = objective(
        mb.log_prob,
        mb.old_log_prob,
        mb.advantages,
        mb.response_mask,
        config,
        ref_log_prob=mb.ref_log_prob,
        rollout_is_weights=mb.rollout_is_weights,
        entropy=mb.entropy,
        index=index,
    )
    return float(loss)


def _equal_length_groups(seed: int, lengths: list[int], per_group: int):
    """Groups of ``per_group`` sequences; the sequences of group k all have ``lengths[k]`` valid tokens."""
    rows = [length for length in lengths for _ in range(per_group)]
    mb = random_minibatch(seed, len(rows), max(lengths), nan_padding=False)
    mb.response_mask = torch.arange(max(lengths))[None, :] < torch.tensor(rows)[:, None]
    index = torch.arange(len(lengths)).repeat_interleave(per_group) * 3 + 11
    return mb, index


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**31 - 1),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    per_group=st.integers(1, 3),
)
def test_coincides_with_seq_mean_when_groups_are_alike(seed, lengths, per_group):
    """Weights 1/(n_g G_groups) and 1/(n_i G) agree exactly when every group has the same number of non-empty
    sequences and the sequences within a group have equal lengths (lengths may differ between groups)."""
    mb, index = _equal_length_groups(seed, lengths, per_group)
    group, seq = _objective_value(mb, GROUP, index), _objective_value(mb, "seq-mean-token-mean", None)
    assert abs(group - seq) <= 1e-13 * max(1.0, abs(seq))
    if len(set(lengths)) == 1:  # every group also holds the same number of tokens: the token mean too
        token = _objective_value(mb, "token-mean", None)
        assert abs(group - token) <= 1e-13 * max(1.0, abs(token))


def test_differs_when_groups_differ():
    mb, index = _equal_length_groups(3, [2, 5], 2)
    uneven_sizes = index.clone()
    uneven_sizes[1] = index[2]  # groups of one and three sequences
    uneven_lengths = mb.response_mask.clone()
    uneven_lengths[0, 1] = False  # one group's sequences of lengths 1 and 2
    seq = _objective_value(mb, "seq-mean-token-mean", None)
    assert abs(_objective_value(mb, GROUP, uneven_sizes) - seq) > 1e-3
    mb.response_mask = uneven_lengths
    seq = _objective_value(mb, "seq-mean-token-mean", None)
    assert abs(_objective_value(mb, GROUP, index) - seq) > 1e-3


def test_singleton_groups_are_seq_mean_token_mean():
    mb = random_minibatch(5, 6, 7)
    unique = torch.arange(6) + 100
    assert _objective_value(mb, GROUP, unique) == pytest.approx(
        _objective_value(mb, "seq-mean-token-mean", None), rel=1e-13
    )


def test_index_is_ignored_by_the_other_modes():
    mb = random_minibatch(8, 6, 5)
    for mode in AGG_MODES:
        if mode != GROUP:
            assert _objective_value(mb, mode, mb.index) == _objective_value(mb, mode, None), mode


def test_missing_or_bad_index_is_a_named_error():
    mb = random_minibatch(2, 4, 5)
    config = config_for("vanilla", GROUP)
    args = (mb.log_prob, mb.old_log_prob, mb.advantages, mb.response_mask, config)
    with pytest.raises(BatchError) as info:
        objective(*args)
    assert info.value.field == "index" and "group-mean-token-mean" in str(info.value)
    with pytest.raises(ValueError, match="^index"):
        oracle_objective(*args)
    bad_float = mb.index.double()
    bad_float[2] = float("nan")
    for bad, sequence in (
        (mb.index[:3], None),
        (mb.index.bool(), None),
        (mb.index.double(), None),
        (bad_float, int(mb.seq_ids[2])),
    ):
        with pytest.raises(BatchError) as info:
            objective(*args, index=bad, seq_ids=mb.seq_ids)
        assert info.value.field == "index" and info.value.sequence == sequence, str(info.value)


# ---- statistics: merged by addition, group by group -----------------------------------------------------


@st.composite
def grouped_parts(draw):
    batch = draw(st.integers(1, 8))
    width = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, width), min_size=batch, max_size=batch))
    index = draw(st.lists(st.integers(-3, 3), min_size=batch, max_size=batch))
    order = draw(st.permutations(range(batch)))
    cuts = sorted(draw(st.sets(st.integers(1, batch - 1), max_size=batch - 1))) if batch > 1 else []
    bounds = [0, *cuts, batch]
    mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return mask, torch.tensor(index), [list(order[a:b]) for a, b in zip(bounds, bounds[1:])]


@given(grouped_parts())
def test_group_counts_merge_by_addition(case):
    mask, index, parts = case
    whole = MinibatchStats.of(mask, index=index)
    merged = sum(
        (MinibatchStats.of(mask[rows], mask.shape[1], index[rows]) for rows in parts[1:]),
        MinibatchStats.of(mask[parts[0]], mask.shape[1], index[parts[0]]),
    )
    assert merged == whole
    keys = sorted(set(index.tolist()))  # as ranks reduce them: one dense vector over the minibatch's groups
    summed = sum(MinibatchStats.of(mask[rows], mask.shape[1], index[rows]).as_tensor(keys) for rows in parts)
    assert MinibatchStats.from_tensor(summed, mask.shape[1], keys) == whole
    lengths = mask.sum(1).tolist()
    for g, n in whole.group_tokens:
        assert n == sum(length for length, i in zip(lengths, index.tolist()) if i == g) > 0
    assert whole.num_groups == len({i for length, i in zip(lengths, index.tolist()) if length})


# ---- the batch contract ---------------------------------------------------------------------------------


def _lists(n=3):
    return dict(
        prompt_ids=[[1, 2]] * n,
        response_ids=[[3, 4, 5]] * n,
        old_log_probs=[[-1.0, -1.0, -1.0]] * n,
        advantages=[1.0] * n,
    )


def test_group_ids_travel_with_the_rows():
    batch = RolloutBatch.from_sequences(**_lists(), index=[4, -2, 4])
    assert batch.index.tolist() == [4, -2, 4] and batch.index.dtype == torch.long
    assert batch.select([2, 1]).index.tolist() == [4, -2]
    assert batch.to("cpu").index.tolist() == [4, -2, 4]
    assert RolloutBatch.from_sequences(**_lists()).index is None
    assert RolloutBatch.from_sequences(**_lists(), index=torch.tensor([1, 1, 2])).index.tolist() == [1, 1, 2]


@pytest.mark.parametrize(
    "index,where,message",
    [
        ([1, 2], "index", "has 2 sequences"),
        ([1, 2.5, 3], "index[1]", "must be an integer"),
        ([1, float("nan"), 3], "index[1]", "non-finite"),
        ([1, True, 3], "index[1]", "must be an integer"),
        ([1, 2**64, 3], "index[1]", "64 bits"),
        ("abc", "index", "must be a list"),
    ],
)
def test_from_sequences_names_the_bad_group_id(index, where, message):
    with pytest.raises(BatchError) as info:
        RolloutBatch.from_sequences(**_lists(), index=index)
    assert info.value.field == where and message in str(info.value)


# ---- the engine against the reference -------------------------------------------------------------------


def reference_update(model, batch: RolloutBatch, loss: LossConfig, minibatch: int, lr: float = 0.02):
    """SGD steps from the plain float64 reference: each minibatch's J from one forward of its rows."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model, "sgd", lr)
    batch = batch.validate()
    all_metrics = []
    for step, rows in enumerate(minibatch_schedule(len(batch), minibatch, epochs=1, shuffle=False, seed=0)):
        part = batch.select(rows)
        log_prob, entropy = response_log_probs(model, part, with_entropy=loss.entropy_coeff != 0)
        optimizer.zero_grad()
        total, metrics = oracle_objective(
            log_prob,
            part.old_log_probs,
            part.advantages,
            part.response_mask,
            loss,
            ref_log_prob=part.ref_log_probs if loss.use_kl_loss else None,
            rollout_is_weights=part.rollout_is_weights,
            entropy=entropy,
            seq_ids=part.seq_ids,
            index=part.index,
            step=step,
        )
        total.backward()
        optimizer.step()
        all_metrics.append(metrics)
    return flat(model.state_dict()), all_metrics


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", torch.float64, exact_norms=True)  # float64 throughout: `deferred` is exact too
    return model, grouped_rollout(model), flat(model.state_dict())


def test_the_groups_really_are_uneven_and_cut(setup):
    _, batch, _ = setup
    lengths = batch.response_mask.sum(1)
    sizes = {g: int(lengths[batch.index == g].sum()) for g in set(batch.index.tolist())}
    assert sizes[99] == 0 and len({n for n in sizes.values() if n}) > 2
    cfg = UpdateConfig(loss=loss_config("vanilla", GROUP), ppo_mini_batch_size=12, ppo_micro_batch_size_per_gpu=5)
    (plan,) = plan_update(batch.validate(), cfg, 1, 0)
    groups_per_mb = [set(batch.index[rows].tolist()) for rows in plan.microbatches]
    assert groups_per_mb[0] & groups_per_mb[1] and groups_per_mb[1] & groups_per_mb[2]


SPLITS = {
    "one": dict(),
    "micro1": dict(ppo_micro_batch_size_per_gpu=1),
    "micro5": dict(ppo_micro_batch_size_per_gpu=5),
    "budget": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET),
    "packed": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET, use_remove_padding=True),
}


@pytest.mark.parametrize(
    "loss_mode,strategy",
    [("vanilla", "auto"), ("geo_mean", "auto"), ("gspo", "auto"), ("kl_cov", "deferred"), ("clip_cov", "prepass")],
)
def test_engine_update_equals_the_reference(setup, loss_mode, strategy):
    """Every split and a shuffled order give the reference's SGD step, parameters and metrics; with two
    minibatches of six, a group straddles them and each minibatch counts its own part of it."""
    model, batch, theta0 = setup
    loss = loss_config(loss_mode, GROUP)
    shuffled = batch.select([5, 11, 0, 3, 8, 1, 10, 2, 7, 4, 9, 6])
    for minibatch in (12, 6):
        expected, expected_metrics = reference_update(model, batch, loss, minibatch)
        for name, split in SPLITS.items():
            for label, b in (("", batch), ("shuffled ", shuffled if minibatch == 12 else batch)):
                cfg = UpdateConfig(
                    loss=loss, ppo_mini_batch_size=minibatch, grad_clip=NO_CLIP, cov_strategy=strategy, **split
                )
                params, results = run_update(model, b, cfg)
                diff = rel_diff(expected, params, theta0)
                assert diff <= REL, f"{loss_mode} {label}{name} minibatch {minibatch}: {diff:.3e}"
                for step, (result, metrics) in enumerate(zip(results, expected_metrics)):
                    engine = {k: v for k, v in result.metrics.items() if k in metrics}
                    assert_metrics_close(metrics, engine, label=f"{loss_mode} {label}{name} step {step}")


def test_per_microbatch_group_statistics_move_the_update(setup):
    """Negative control: the same comparison sees group counts taken per microbatch (O(1) off)."""
    model, batch, theta0 = setup
    loss = loss_config("vanilla", GROUP)
    expected, _ = reference_update(model, batch, loss, 12)
    local, _ = run_update(
        model,
        batch,
        UpdateConfig(loss=loss, ppo_mini_batch_size=12, grad_clip=NO_CLIP, ppo_micro_batch_size_per_gpu=5),
        make_objective=per_microbatch(statistics_scope="microbatch"),
    )
    assert rel_diff(expected, local, theta0) > 0.05
    token_mean, _ = reference_update(model, batch, loss.replace(loss_agg_mode="seq-mean-token-mean"), 12)
    assert rel_diff(expected, token_mean, theta0) > 0.05  # the groups matter on this batch


@settings(max_examples=12)
@given(
    labels=st.lists(st.integers(0, 4), min_size=12, max_size=12),
    order=st.permutations(range(12)),
    split=st.one_of(
        st.tuples(st.just("micro"), st.integers(1, 12)), st.tuples(st.just("budget"), st.integers(30, 160))
    ),
    packed=st.booleans(),
    loss_mode=st.sampled_from(["vanilla", "cispo", "geo_mean", "kl_cov"]),
)
def test_random_groups_any_layout_give_the_reference_update(setup, labels, order, split, packed, loss_mode):
    model, batch, theta0 = setup
    batch = copy.copy(batch)
    batch.index = torch.tensor(labels)
    loss = loss_config(loss_mode, GROUP)
    expected, expected_metrics = reference_update(model, batch, loss, 12)
    kind, size = split
    common = dict(loss=loss, ppo_mini_batch_size=12, grad_clip=NO_CLIP, use_remove_padding=packed)
    if kind == "micro":
        cfg = UpdateConfig(**common, ppo_micro_batch_size_per_gpu=size)
    else:
        longest = int(batch.token_lengths().max())
        cfg = UpdateConfig(**common, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=max(size, longest + 1))
    params, (result,) = run_update(model, batch.select(list(order)), cfg)
    assert rel_diff(expected, params, theta0) <= REL
    (metrics,) = expected_metrics
    assert_metrics_close(metrics, {k: v for k, v in result.metrics.items() if k in metrics}, label=str(split))


def test_missing_group_ids_fail_before_anything_moves(setup):
    """An optimizer with state: neither the weights nor that state change when the group ids are missing."""
    model, batch, _ = setup
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model, "adamw")
    cfg = UpdateConfig(loss=loss_config("vanilla", "token-mean"), ppo_mini_batch_size=12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        update_policy(model, optimizer, batch, cfg)  # a normal step first: AdamW holds moments
    weights, state = flat(model.state_dict()), copy.deepcopy(optimizer.state_dict())
    grads = [p.grad.clone() for p in model.parameters()]  # the engine leaves a step's gradients in place
    no_groups = copy.copy(batch)
    no_groups.index = None
    with pytest.raises(BatchError) as info:
        update_policy(
            model, optimizer, no_groups, UpdateConfig(loss=loss_config("vanilla", GROUP), ppo_mini_batch_size=6)
        )
    assert info.value.field == "index" and str(info.value).startswith("index: loss_agg_mode 'group-mean-token-mean'")
    assert torch.equal(flat(model.state_dict()), weights)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    after = optimizer.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for key, values in state["state"].items():
        for name, value in values.items():
            assert torch.equal(torch.as_tensor(after["state"][key][name]), torch.as_tensor(value)), (key, name)


def test_the_lean_diagonal_still_covers_every_loss_and_every_aggregation():
    """The lean run keeps one aggregation mode per loss mode of each sweep: with the sixth mode added, every
    loss mode and every aggregation mode (group-mean-token-mean included) must still be on the diagonal."""
    from splitproof.loss_config import LOSS_MODES

    from .conftest import on_the_diagonal

    lean = [(loss, agg) for loss in LOSS_MODES for agg in AGG_MODES if on_the_diagonal(loss, agg)]
    assert {loss for loss, _ in lean} == set(LOSS_MODES) and len(lean) == len(LOSS_MODES)
    assert {agg for _, agg in lean} == set(AGG_MODES)
