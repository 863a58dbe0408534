"""Shared helpers for the `splitproof train` config tests: load a config from overrides with its notices, the
ConfigError a load raises, a verl-style command line."""

import pytest

from splitproof import ConfigError
from splitproof.rl.config.load import load_train_config

USER_MODEL = "actor_rollout_ref.model.path=/models/my-model"
VERL_LINE = [
    "data.train_files=x.parquet",
    "data.train_batch_size=16",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8",
    "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
    "algorithm.adv_estimator=grpo",
    "trainer.total_training_steps=20",
]


def load(*overrides, config_file=None):
    notices = []
    cfg = load_train_config(config_file, list(overrides), on_notice=notices.append)
    return cfg, notices


def error_of(*overrides, config_file=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(*overrides, config_file=config_file)
    return info.value
