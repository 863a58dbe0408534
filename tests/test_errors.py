"""Bad input (docs/semantics.md, "The batch"): every case raises before any gradient, and the message names the
field (and sequence)."""

from __future__ import annotations

import pytest
import torch

from splitproof import BatchError, ConfigError, LossConfig, objective

from .factories import random_minibatch


def inputs(**changes):
    mb = random_minibatch(3, 4, 6, nan_padding=False)
    mb.response_mask[:] = True
    values = dict(
        log_prob=mb.log_prob,
        old_log_prob=mb.old_log_prob,
        advantages=mb.advantages,
        response_mask=mb.response_mask,
        config=LossConfig(),
        ref_log_prob=mb.ref_log_prob,
        rollout_is_weights=mb.rollout_is_weights,
        entropy=mb.entropy,
        seq_ids=torch.tensor([10, 11, 12, 13]),
    )
    values.update(changes)
    return values


def raises(error, field, sequence=None, **changes):
    with pytest.raises(error) as info:
        objective(**inputs(**changes))
    assert info.value.field == field
    assert field in str(info.value)
    if sequence is not None:
        assert info.value.sequence == sequence
        assert f"sequence {sequence}" in str(info.value)


def with_value(name, row, col, value):
    tensor = inputs()[name].clone()
    tensor[row, col] = value
    return {name: tensor}


def test_valid_inputs_pass():
    loss, metrics = objective(**inputs())
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", ["log_prob", "old_log_prob", "ref_log_prob", "rollout_is_weights", "entropy"])
def test_shape_mismatch_names_field(name):
    raises(BatchError, name, **{name: inputs()[name][:, :-1]})


def test_advantages_shape():
    raises(BatchError, "advantages", advantages=torch.zeros(3))


def test_mask_shape():
    raises(BatchError, "response_mask", response_mask=torch.ones(4, dtype=torch.bool))


@pytest.mark.parametrize("name", ["old_log_prob", "log_prob", "ref_log_prob", "rollout_is_weights", "entropy"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_on_valid_token_names_field_and_sequence(name, bad):
    raises(BatchError, name, sequence=12, **with_value(name, 2, 3, bad))


def test_non_finite_advantage_names_sequence():
    adv = inputs()["advantages"].clone()
    adv = adv[:, None].expand(4, 6).clone() if adv.dim() == 1 else adv
    adv[1, 0] = float("nan")
    raises(BatchError, "advantages", sequence=11, advantages=adv)


def test_non_finite_on_padding_is_ignored():
    mask = inputs()["response_mask"].clone()
    mask[0, 4:] = False
    changes = with_value("old_log_prob", 0, 5, float("nan"))
    loss, _ = objective(**inputs(response_mask=mask, **changes))
    assert torch.isfinite(loss)


def test_mask_not_binary_names_sequence():
    mask = inputs()["response_mask"].to(torch.float64)
    mask[3, 1] = 0.5
    raises(BatchError, "response_mask", sequence=13, response_mask=mask)


def test_empty_minibatch():
    raises(BatchError, "response_mask", response_mask=torch.zeros(4, 6, dtype=torch.bool))


def test_negative_is_weight_names_sequence():
    raises(BatchError, "rollout_is_weights", sequence=10, **with_value("rollout_is_weights", 0, 0, -1.0))


def test_kl_loss_without_reference():
    raises(BatchError, "ref_log_prob", config=LossConfig(use_kl_loss=True), ref_log_prob=None)


@pytest.mark.parametrize(
    "field,value",
    [
        ("loss_mode", "ppo2"),
        ("loss_agg_mode", "token-median"),
        ("kl_loss_type", "k4"),
        ("clip_ratio", -0.1),
        ("clip_ratio_low", float("nan")),
        ("clip_ratio_c", 1.0),
        ("loss_scale_factor", 0.0),
        ("tau_pos", 0.0),
        ("kl_cov_ratio", 0.0),
        ("clip_cov_ratio", 1.5),
        ("clip_cov_lb", 6.0),
        ("entropy_coeff", float("inf")),
    ],
)
def test_config_out_of_range(field, value):
    with pytest.raises(ConfigError) as info:
        LossConfig(**{field: value})
    assert info.value.field == field and field in str(info.value)


def test_dro_needs_beta():
    with pytest.raises(ConfigError, match="dro_beta"):
        LossConfig(loss_mode="dro")


def test_from_dict_accepts_verl_nesting_and_rejects_unknown():
    config = LossConfig.from_dict({"clip_ratio": 0.3, "policy_loss": {"loss_mode": "kl_cov", "kl_cov_ratio": 1e-3}})
    assert config.loss_mode == "kl_cov" and config.kl_cov_ratio == 1e-3 and config.eps_high == 0.3
    with pytest.raises(ConfigError, match="clip_ration"):
        LossConfig.from_dict({"clip_ration": 0.3})
