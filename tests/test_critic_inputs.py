"""The critic's bad input (named errors before any weight or optimizer change) and the value model builder."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from splitproof.batch import BatchError
from splitproof.diagnose.per_microbatch import per_microbatch
from splitproof.diagnose.split_run import RunSettings
from splitproof.engine import CriticUpdateConfig, compute_values, update_critic
from splitproof.hf_models import tiny_causal_lm
from splitproof.loss_config import ConfigError, ValueLossConfig
from splitproof.value_model import value_model_from_config, value_model_from_pretrained

from .critic_helpers import critic_rollout, make_models
from .engine_helpers import flat, full_state


@pytest.fixture(scope="module")
def models():
    return make_models()


@pytest.fixture(scope="module")
def batch(models):
    return critic_rollout(*models)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("cliprange_value", 0.0, "cliprange_value: must be a finite number > 0"),
        ("cliprange_value", -0.5, "cliprange_value: must be a finite number > 0"),
        ("cliprange_value", float("nan"), "cliprange_value: must be a finite number > 0"),
        ("loss_agg_mode", "mean", "loss_agg_mode: unknown 'mean'"),
        ("loss_scale_factor", 0, "loss_scale_factor: must be > 0"),
        ("ppo_mini_batch_size", 0, "ppo_mini_batch_size: must be an int >= 1"),
        ("ppo_micro_batch_size_per_gpu", 0, "ppo_micro_batch_size_per_gpu: must be None or an int >= 1"),
        ("grad_clip", 0.0, "grad_clip: must be > 0"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=message):
        CriticUpdateConfig(**{field: value})
    if field in ("cliprange_value", "loss_agg_mode", "loss_scale_factor"):
        with pytest.raises(ConfigError, match=message):
            ValueLossConfig(**{field: value})


def test_statistics_scope_error_names_the_field():
    """The per-microbatch scope is the diagnosis's setting (diagnose.per_microbatch), checked where it is set."""
    with pytest.raises(ConfigError, match="statistics_scope: unknown 'rank'"):
        per_microbatch(value=True, statistics_scope="rank")
    with pytest.raises(ConfigError, match="statistics_scope: unknown 'rank'"):
        RunSettings(statistics_scope="rank")


def _nan_on_valid(batch, field):
    value = getattr(batch, field).clone()
    row, col = batch.response_mask.nonzero()[3].tolist()
    value[row, col] = float("nan")
    return replace(batch, **{field: value}), int(batch.seq_ids[row])


@pytest.mark.parametrize(
    "case",
    [
        "no values",
        "no returns",
        "nan values",
        "inf returns",
        "values shape",
        "returns dtype",
        "budget",
        "minibatch size",
        "no group ids",
        "policy model",
    ],
)
def test_bad_input_fails_before_anything_moves(models, batch, case):
    policy, critic = models
    critic = copy.deepcopy(critic)
    model = critic
    config = CriticUpdateConfig(ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2)
    expected, sequence = BatchError, None
    if case == "no values":
        bad, match = replace(batch, values=None), "values: the critic's update needs"
    elif case == "no returns":
        bad, match = replace(batch, returns=None), "returns: the critic's update needs"
    elif case == "nan values":
        bad, sequence = _nan_on_valid(batch, "values")
        match = rf"values \(sequence {sequence}\): non-finite value on a valid response token"
    elif case == "inf returns":
        bad, sequence = _nan_on_valid(batch, "returns")
        bad.returns[bad.returns.isnan()] = float("inf")
        match = rf"returns \(sequence {sequence}\): non-finite"
    elif case == "values shape":
        bad, match = replace(batch, values=batch.values[:, :-1]), "values: shape"
    elif case == "returns dtype":
        bad, match = replace(batch, returns=batch.returns.long()), "returns: must be a floating-point tensor"
    elif case == "budget":
        bad, match = batch, "ppo_max_token_len_per_gpu"
        config = CriticUpdateConfig(ppo_mini_batch_size=4, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=5)
    elif case == "minibatch size":
        bad, match = batch, "ppo_mini_batch_size"
        config = CriticUpdateConfig(ppo_mini_batch_size=3)
    elif case == "no group ids":
        bad, match = replace(batch, index=None), "index: loss_agg_mode 'group-mean-token-mean' needs a group id"
        config = CriticUpdateConfig(ppo_mini_batch_size=4, loss_agg_mode="group-mean-token-mean")
    else:  # a causal LM is not a value model: its output has a vocabulary's channels
        model, bad, match, expected = copy.deepcopy(policy), batch, "model: a value model has one output", ConfigError
    before = flat(full_state(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(expected, match=match):
        update_critic(model, optimizer, bad, config)
    assert torch.equal(flat(full_state(model)), before)
    assert not optimizer.state
    assert all(p.grad is None for p in model.parameters())


def test_nan_on_padding_is_ignored(batch):
    assert batch.values[~batch.response_mask.bool()].isnan().all()  # the helper's batch: NaN on padding
    batch.validate()


def test_value_model_head_from_seed_alone():
    policy = tiny_causal_lm("qwen2", dtype=torch.float64, seed=1)
    a = value_model_from_pretrained(policy, seed=4)
    torch.manual_seed(123)  # the global RNG does not matter
    b = value_model_from_pretrained(policy, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.score.weight, value_model_from_pretrained(policy, seed=5).score.weight)
    assert torch.equal(a.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert a.score.bias.abs().sum() == 0 and a.dropout.p == 0.0 and a.dtype == torch.float64
    assert a.model.embed_tokens.weight.data_ptr() != policy.model.embed_tokens.weight.data_ptr()  # a copy


def test_value_model_rng_untouched():
    policy = tiny_causal_lm("llama", seed=1)
    state = torch.get_rng_state()
    value_model_from_pretrained(policy, seed=4)
    value_model_from_config(policy.config, seed=2)
    assert torch.equal(state, torch.get_rng_state())


def test_value_model_save_and_reload(tmp_path, batch):
    policy = tiny_causal_lm("llama", dtype=torch.float64, seed=0)
    policy.save_pretrained(tmp_path / "policy")
    from_path = value_model_from_pretrained(tmp_path / "policy", seed=7)
    from_module = value_model_from_pretrained(policy, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(from_path.state_dict().values(), from_module.state_dict().values()))
    from_module.save_pretrained(tmp_path / "critic")
    reloaded = value_model_from_pretrained(tmp_path / "critic", seed=99)  # a saved head is kept, not redrawn
    assert type(reloaded).__name__ == "LlamaForTokenClassification"
    assert all(torch.equal(x, y) for x, y in zip(reloaded.state_dict().values(), from_module.state_dict().values()))
    values = compute_values(reloaded, batch, micro_batch_size=4)
    assert torch.equal(values, compute_values(from_module, batch, micro_batch_size=4))
    with pytest.raises(ValueError, match="already a value model"):
        value_model_from_pretrained(from_module)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        value_model_from_pretrained(tmp_path / "missing")


def test_value_model_from_an_incomplete_checkpoint_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny_causal_lm("llama", seed=0).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.0.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks 1 of the model's weights \(model.layers.0.mlp.up_proj.weight\)"):
        value_model_from_pretrained(tmp_path)
