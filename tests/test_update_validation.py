"""Bad input to an update fails before the first step, on every rank, with an error naming field and sequence.

Each bad batch puts its defect in the *second* minibatch, so a check made at run time would come after
the first optimizer step had already moved the weights and the AdamW state.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from splitproof.batch import BatchError
from splitproof.engine import UpdateConfig, update_policy, wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.hf_models import tiny_causal_lm
from splitproof.loss_config import ConfigError

from .engine_helpers import (
    flat,
    full_state,
    loss_config,
    make_model,
    make_optimizer,
    make_rollout,
    rel_diff,
    run_update,
)

LAST = 7  # the row whose defect is planted: in the second minibatch of four sequences


def config(**changes):
    values = dict(loss=loss_config("vanilla", "token-mean"), ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    values.update(changes)
    return UpdateConfig(**values)


def without_prompt(batch, row=LAST):
    """Row ``row`` keeps its response but loses every prompt token."""
    attention = batch.attention_mask.clone()
    attention[row, : batch.prompt_width] = 0
    return replace(batch, attention_mask=attention)


def with_value(batch, name, value, row=LAST):
    tensor = getattr(batch, name).clone()
    tensor[row, 0] = value
    return replace(batch, **{name: tensor})


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", torch.float64)
    return model, make_rollout(model, 8, holes=False, seed=2)


def bad_cases(batch):
    """name -> (bad batch, config, error class, field, sequence id or None)."""
    ids = batch.seq_ids.tolist()
    return {
        "no prompt token": (without_prompt(batch), config(), BatchError, "prompts", ids[LAST]),
        "kl loss without ref_log_probs": (
            replace(batch, ref_log_probs=None),
            config(loss=loss_config("vanilla", "token-mean", use_kl_loss=True)),
            BatchError,
            "ref_log_probs",
            None,
        ),
        "old_log_probs non-finite": (
            with_value(batch, "old_log_probs", float("nan")),
            config(),
            BatchError,
            "old_log_probs",
            ids[LAST],
        ),
        "ref_log_probs non-finite": (
            with_value(batch, "ref_log_probs", float("inf")),
            config(),
            BatchError,
            "ref_log_probs",
            ids[LAST],
        ),
        "ref_log_probs shape": (
            replace(batch, ref_log_probs=batch.ref_log_probs[:, :-1]),
            config(),
            BatchError,
            "ref_log_probs",
            None,
        ),
        "seq_ids not integers": (replace(batch, seq_ids=batch.seq_ids.double()), config(), BatchError, "seq_ids", None),
        "token budget below a sequence": (
            batch,
            config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=5),
            BatchError,
            "ppo_max_token_len_per_gpu",
            None,
        ),
        "group mean without group ids": (
            replace(batch, index=None),
            config(loss=GROUP_LOSS),
            BatchError,
            "index",
            None,
        ),
        "group ids shape": (replace(batch, index=batch.index[:-1]), config(loss=GROUP_LOSS), BatchError, "index", None),
        "group ids not integers": (replace(batch, index=batch.index.double()), config(), BatchError, "index", None),
        "group id non-finite": (
            replace(batch, index=nan_at(batch.index.double(), LAST)),
            config(loss=GROUP_LOSS),
            BatchError,
            "index",
            ids[LAST],
        ),
    }


GROUP_LOSS = loss_config("vanilla", "group-mean-token-mean")


def nan_at(values, row):
    values = values.clone()
    values[row] = float("nan")
    return values


CASES = [
    "no prompt token",
    "kl loss without ref_log_probs",
    "old_log_probs non-finite",
    "ref_log_probs non-finite",
    "ref_log_probs shape",
    "seq_ids not integers",
    "token budget below a sequence",
    "group mean without group ids",
    "group ids shape",
    "group ids not integers",
    "group id non-finite",
]


def attempt(model, batch, cfg):
    """Run an update with AdamW; return (error, parameters unchanged, optimizer state empty)."""
    before = flat(full_state(model))
    optimizer = make_optimizer(model, "adamw")
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            update_policy(model, optimizer, batch, cfg)
    except (BatchError, ConfigError) as exc:
        error = exc
    untouched = torch.equal(flat(full_state(model)), before)
    return error, untouched, not optimizer.state


@pytest.mark.parametrize("name", CASES)
def test_bad_input_fails_before_the_first_step(setup, name):
    model, batch = setup
    bad, cfg, error_class, field, sequence = bad_cases(batch)[name]
    error, untouched, no_state = attempt(model, bad, cfg)
    assert isinstance(error, error_class), f"{name}: expected {error_class.__name__}, got {error!r}"
    assert error.field == field and str(error).startswith(field)
    if sequence is not None:
        assert error.sequence == sequence and f"sequence {sequence}" in str(error)
    assert untouched and no_state, f"{name}: the update moved weights or optimizer state before failing"


def test_sequence_beyond_the_models_positions_is_refused(setup):
    _, batch = setup
    attention = batch.attention_mask.clone()
    attention[LAST] = 1  # the longest possible sequence: every prompt and response column real
    batch = replace(batch, attention_mask=attention, response_mask=attention[:, batch.prompt_width :].clone())
    lengths = batch.token_lengths()
    limit = int(lengths[:4].max())  # the first minibatch fits
    assert limit < int(lengths[LAST])
    model = tiny_causal_lm("llama", dtype=torch.float64, max_position_embeddings=limit)
    error, untouched, no_state = attempt(model, batch, config())
    first = int((lengths > limit).nonzero()[0, 0])
    assert isinstance(error, BatchError) and error.field == "attention_mask", error
    assert f"max_position_embeddings {limit}" in str(error) and error.sequence == int(batch.seq_ids[first])
    assert untouched and no_state


def test_int32_token_ids_work_in_both_layouts(setup):
    model, batch = setup
    narrow = replace(batch, prompts=batch.prompts.int(), responses=batch.responses.int())
    theta0 = flat(model.state_dict())
    reference, _ = run_update(model, batch, config())
    for extra in ({}, dict(use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=60)):
        params, _ = run_update(model, narrow, config(**extra))
        assert rel_diff(params, reference, theta0) <= 1e-10, extra


def _dp_attempts(model, cases):
    out = {}
    for name, (bad, cfg, *_rest) in cases.items():
        wrapped = wrap_model(model, "ddp") if not hasattr(model, "module") else model
        error, untouched, no_state = attempt(wrapped, bad, cfg)
        out[name] = (type(error).__name__, getattr(error, "field", None), str(error), untouched, no_state)
        model = wrapped
    dist.barrier()
    return out


@pytest.mark.dist
def test_every_rank_raises_the_same_named_error(setup):
    """Under DDP each rank holds one shard: the defect's row is on one of them, yet both refuse alike."""
    model, batch = setup
    cases = {
        name: bad_cases(batch)[name]
        for name in (
            "no prompt token",
            "old_log_probs non-finite",
            "kl loss without ref_log_probs",
            "group mean without group ids",
        )
    }
    ranks = run_data_parallel(_dp_attempts, 2, model, cases, timeout=60)
    for name, (_, _, error_class, field, _) in cases.items():
        reports = [r[name] for r in ranks]
        assert reports[0] == reports[1], f"{name}: ranks disagree: {reports}"
        kind, got_field, message, untouched, no_state = reports[0]
        assert kind == error_class.__name__ and got_field == field, message
        assert untouched and no_state, name


def _dp_different_batches(model, batch):
    if dist.get_rank() == 1:  # a data loader that gave this rank other advantages
        batch = replace(batch, advantages=batch.advantages + 1.0)
    error, untouched, no_state = attempt(wrap_model(model, "ddp"), batch, config())
    dist.barrier()
    return type(error).__name__, getattr(error, "field", None), str(error), untouched, no_state


@pytest.mark.dist
def test_ranks_given_different_batches_refuse_alike(setup):
    """Each rank takes its own shard of the batch it is given: different batches would diverge silently."""
    model, batch = setup
    reports = run_data_parallel(_dp_different_batches, 2, model, batch, timeout=60)
    assert reports[0] == reports[1]
    kind, field, message, untouched, no_state = reports[0]
    assert (kind, field) == ("BatchError", "advantages") and "differs between ranks" in message
    assert untouched and no_state
