# ruff: noqa: UP045 -- OmegaConf reads these annotations and names typing's Optional in its messages, as in schema.py
"""The reward model's keys (docs/reward-models.md): verl 0.9.1's ``reward.reward_model`` section and the
model part of verl's older ``reward_model.*`` spelling; fields of ``config.schema.TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import II


@dataclass
class RewardModelConfig:
    """A reward model scoring the samples (docs/reward-models.md): verl 0.9.1's ``reward.reward_model``."""

    enable: bool = False  # score samples with the reward model at model_path
    model_path: Optional[str] = None  # a local AutoModelForSequenceClassification directory (num_labels=1)
    chat_template: str = "policy"  # ours: policy (the samples' own token ids) | own (re-rendered, its chat template)
    micro_batch_size_per_gpu: Optional[int] = None  # ours (verl's older key): sequences per forward; null: whole share
    use_dynamic_bsz: bool = False  # ours (verl's older key): micro-batches by a token budget (memory only)
    forward_max_token_len_per_gpu: int = 32768  # ours (verl's older key): the token budget with use_dynamic_bsz
    model_dtype: str = II("actor_rollout_ref.actor.fsdp_config.model_dtype")  # ours: the actor's
    trust_remote_code: bool = False  # run the model directory's own Python code (off unless asked)


@dataclass
class LegacyRewardModelModelConfig:
    path: Optional[str] = None  # null: reward.reward_model.model_path
    input_tokenizer: Optional[str] = None  # null: the policy's token ids; set: the reward model's chat template (own)
    trust_remote_code: Optional[bool] = None  # null: reward.reward_model.trust_remote_code
