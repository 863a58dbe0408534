# ruff: noqa: UP045 -- OmegaConf reads these annotations and names typing's Optional in its messages, as in schema.py
"""The ``algorithm.*`` keys (the advantage estimator, KL in the reward and its controller, rollout correction,
dynamic sampling's filter); fields of ``config.schema.TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # beta (the start value when adaptive)
    horizon: int = 10000  # adaptive controller's horizon
    target_kl: float = 0.1  # adaptive controller's target


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None  # IS weights old/rollout: null (off) | token | sequence
    rollout_is_threshold: float = 2.0  # weights above it are set to it (truncated IS)
    bypass_mode: bool = False  # old log-probs := the rollout's (no recompute, no rollout_is)


@dataclass
class FilterGroupsConfig:
    enable: bool = False  # dynamic sampling: keep the first train_batch_size groups whose metric varies
    metric: str = "reward"  # reward | seq_reward | seq_final_reward | a reward extra value (e.g. acc)
    max_num_gen_batches: int = 0  # generation rounds a step may take; 0: no bound


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"  # see docs/advantages.md; gae trains a critic (critic.*)
    gamma: float = 1.0  # discount (REINFORCE++, GAE)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std_in_grpo: bool = True  # false: Dr. GRPO (no division by the group's std)
    use_kl_in_reward: bool = False  # score - beta * KL to the reference, per token
    kl_penalty: str = "kl"  # the KL estimator in the reward (as kl_loss_type)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
