"""KL-Cov / Clip-Cov select from the minibatch's contents alone: not from its row order, split or DP size.

The batch is balanced: advantages [x, 0, −x, x] on responses of 8, 11, 10 and 2 tokens, so Σ A = 0 in
exact arithmetic. A rounded mean Ā of ±1e-16 would give the zero-advantage tokens a covariance score of
pure rounding noise (−Ā·(log π − L̄)), and the selection among them would follow the summation order.
Every row order (all 24), on one process and on two DDP ranks, must select the same tokens and make the
same update.
"""

from __future__ import annotations

import copy
import itertools
import warnings

import pytest
import torch

from splitproof.batch import RolloutBatch
from splitproof.diagnose.watched import watched
from splitproof.engine import PolicyObjective, UpdateConfig, compute_log_probs, update_policy, wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.selection import cov_sums, exact_sum

from .engine_helpers import (
    REL,
    assert_metrics_close,
    flat,
    full_state,
    loss_config,
    make_model,
    make_optimizer,
    rel_diff,
)

X = 0.9953591936840092  # not a short binary fraction: sums of ±X round differently in different orders
ADVANTAGES = (X, 0.0, -X, X)
RESPONSE_LENGTHS = (8, 11, 10, 2)  # 8X − 10X + 2X = 0
PROMPT_LENGTHS = (2, 3, 2, 4)
PERMUTATIONS = list(itertools.permutations(range(4)))
LOSSES = {
    # quota 15 of 31 tokens: about 10 tokens score clearly positive, so the zero-advantage ones are reached
    "kl_cov": dict(kl_cov_ratio=0.5),
    # every candidate with c > 0 is selected: the zero-advantage tokens are in or out by the sign of Ā alone
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=0.0, clip_cov_ub=100.0),
}


def balanced_batch(model) -> RolloutBatch:
    g = torch.Generator().manual_seed(3)
    P, T = max(PROMPT_LENGTHS), max(RESPONSE_LENGTHS)
    prompt_att = torch.arange(P)[None, :] >= (P - torch.tensor(PROMPT_LENGTHS))[:, None]
    resp_att = torch.arange(T)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    batch = RolloutBatch(
        prompts=torch.randint(0, 256, (4, P), generator=g) * prompt_att,
        responses=torch.randint(0, 256, (4, T), generator=g) * resp_att,
        attention_mask=torch.cat([prompt_att, resp_att], dim=1).long(),
        response_mask=resp_att.long(),
        old_log_probs=torch.zeros(4, T, dtype=torch.float64),
        advantages=torch.tensor(ADVANTAGES, dtype=torch.float64),
        seq_ids=torch.tensor([10, 11, 12, 13]),
    )
    logp, _ = compute_log_probs(model, batch, micro_batch_size=4)
    batch.old_log_probs = torch.where(
        resp_att, logp + 0.05 * torch.randn(4, T, generator=g, dtype=torch.float64), torch.zeros(())
    )
    return batch


def test_the_batch_is_balanced_and_naive_sums_are_not_exact():
    """The premise: Σ A = 0 exactly, yet float64 sums in some row orders are not 0."""
    T = max(RESPONSE_LENGTHS)
    mask = torch.arange(T)[None, :] < torch.tensor(RESPONSE_LENGTHS)[:, None]
    adv = torch.tensor(ADVANTAGES, dtype=torch.float64)[:, None].expand(4, T)
    naive = {float(adv[list(p)][mask[list(p)]].sum()) for p in PERMUTATIONS}
    assert len(naive) > 1 and naive != {0.0}
    assert exact_sum(adv[mask]) == 0.0
    sums = {cov_sums(adv[list(p)], adv[list(p)], mask[list(p)]).adv_sum for p in PERMUTATIONS}
    assert sums == {0.0}


def _configs():
    """One per loss; the two strategies and two microbatch sizes between them."""
    out = {}
    for (loss_mode, extra), strategy, micro in zip(LOSSES.items(), ("prepass", "deferred"), (1, None)):
        loss = loss_config(loss_mode, "token-mean", use_kl_loss=False, entropy_coeff=0.0, **extra)
        out[(loss_mode, strategy, micro)] = UpdateConfig(
            loss=loss, ppo_mini_batch_size=4, grad_clip=1e9, cov_strategy=strategy, ppo_micro_batch_size_per_gpu=micro
        )
    return out


def _run_all(model, batch, configs, wrapper=None):
    """(name, permutation) -> (parameters, metrics, selected keys) of one update of a copy of ``model``."""
    out = {}
    for name, config in configs.items():
        for perm in PERMUTATIONS:
            copied = copy.deepcopy(model)
            if wrapper:
                copied = wrap_model(copied, wrapper)
            keys: set[tuple[int, int]] = set()

            def record(mask, seq_ids, keys=keys):
                rows, cols = mask.nonzero(as_tuple=True)
                keys.update(zip(seq_ids[rows].tolist(), cols.tolist()))

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (result,) = update_policy(
                    copied,
                    make_optimizer(copied),
                    batch.select(list(perm)),
                    config,
                    make_objective=watched(PolicyObjective, on_selection=record),
                )
            out[(name, perm)] = (flat(full_state(copied)), result.metrics, keys)
    return out


def _gather_keys(results):
    """Merge the per-rank selected keys (each rank records its own shard's)."""
    merged = {}
    for case in results[0]:
        keys = set().union(*(r[case][2] for r in results))
        merged[case] = (results[0][case][0], results[0][case][1], keys)
    return merged


def _dp_worker(model, batch, configs):
    return _run_all(model, batch, configs, wrapper="ddp")


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", torch.float64, seed=4)
    batch = balanced_batch(model)
    configs = _configs()
    return model, batch, configs, _run_all(model, batch, configs)


def _assert_all_agree(model, runs, reference_runs, label):
    theta0 = flat(model.state_dict())
    for (name, perm), (params, metrics, keys) in runs.items():
        ref_params, ref_metrics, ref_keys = reference_runs[(name, PERMUTATIONS[0])]
        where = f"{label} {name} order {perm}"
        assert keys == ref_keys, f"{where}: selection differs ({sorted(keys ^ ref_keys)})"
        assert rel_diff(ref_params, params, theta0) <= REL, where
        assert_metrics_close(ref_metrics, metrics, label=where)


def test_selection_does_not_depend_on_row_order(setup):
    model, _, _, single = setup
    some = next(iter(single.values()))[2]
    assert some, "nothing selected: the test would not see a wrong selection"
    _assert_all_agree(model, single, single, "one process")


@pytest.mark.dist
def test_selection_does_not_depend_on_data_parallel_size(setup):
    model, batch, configs, single = setup
    dp = _gather_keys(run_data_parallel(_dp_worker, 2, model, batch, configs, timeout=240))
    _assert_all_agree(model, dp, single, "DDP=2")
