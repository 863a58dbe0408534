"""Loading the policy a run trains: gradient checkpointing through transformers' current API, silently."""

import warnings

import torch

from splitproof.rl.config.schema import ModelConfig
from splitproof.rl.models.policy import load_policy


def test_gradient_checkpointing_is_enabled_without_a_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # transformers' FutureWarning for gradient_checkpointing_enable would raise
        model = load_policy(ModelConfig(enable_gradient_checkpointing=True), dtype=torch.float32)
    assert model.is_activation_checkpointing
