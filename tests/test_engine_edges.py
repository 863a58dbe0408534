"""Edge cases of the engine loop: sequences with no response token, ranks with nothing to compute."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from splitproof import LossConfig
from splitproof.diagnose.synthetic import synthetic_rollout
from splitproof.engine import UpdateConfig, update_policy, wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.hf_models import tiny_causal_lm


def batch_with_empty_responses(model, empty_rows=(2, 3)):
    batch = synthetic_rollout(model, 6, 6, 10, seed=4)
    attention = batch.attention_mask.clone()
    response_mask = batch.response_mask.clone()
    for row in empty_rows:  # no response token at all: nothing for the model to predict
        attention[row, batch.prompt_width :] = 0
        response_mask[row] = 0
    return replace(batch, attention_mask=attention, response_mask=response_mask)


def flat(model):
    inner = model.module if hasattr(model, "module") else model
    return torch.cat(
        [
            (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().flatten()
            for _, v in sorted(inner.state_dict().items())
        ]
    )


def one_update(model, batch, micro, wrapper=None, loss_mode="vanilla"):
    model = copy.deepcopy(model)
    if wrapper:
        model = wrap_model(model, wrapper)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = UpdateConfig(
        loss=LossConfig(loss_mode=loss_mode, loss_agg_mode="seq-mean-token-mean", kl_cov_ratio=0.05),
        ppo_mini_batch_size=len(batch),
        ppo_micro_batch_size_per_gpu=micro,
        grad_clip=1e9,
    )
    steps = update_policy(model, optimizer, batch, config)
    return flat(model), steps[0].metrics


@pytest.fixture(scope="module")
def setup():
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=3)
    return model, batch_with_empty_responses(model)


@pytest.mark.parametrize("loss_mode", ["vanilla", "geo_mean", "kl_cov"])
def test_microbatches_of_empty_sequences_are_skipped(setup, loss_mode):
    model, batch = setup
    before = flat(model)
    whole, metrics_whole = one_update(model, batch, None, loss_mode=loss_mode)
    split, metrics_split = one_update(model, batch, 1, loss_mode=loss_mode)
    scale = float((whole - before).abs().max())
    assert scale > 0
    assert float((split - whole).abs().max()) <= 1e-10 * scale
    for name, value in metrics_whole.items():
        assert abs(metrics_split[name] - value) <= 1e-10 * max(1.0, abs(value)), name


def _dp_worker(model, batch, wrapper):
    return [one_update(model, batch, 1, wrapper, loss_mode)[0] for loss_mode in ("vanilla", "kl_cov")]


@pytest.mark.dist
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_a_rank_whose_microbatch_has_nothing_to_compute_stays_in_lockstep(setup, wrapper):
    model, batch = setup
    batch = batch_with_empty_responses(model, empty_rows=(0, 1, 2, 3))  # one rank gets only empty rows
    expected = [one_update(model, batch, None, loss_mode=mode)[0] for mode in ("vanilla", "kl_cov")]
    ranks = run_data_parallel(_dp_worker, 2, model, batch, wrapper, timeout=120)
    before = flat(model)
    for got, want in zip(ranks[0], expected):
        scale = float((want - before).abs().max())
        assert float((got - want).abs().max()) <= 1e-10 * scale
