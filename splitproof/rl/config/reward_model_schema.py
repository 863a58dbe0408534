# ruff: noqa: UP045 -- OmegaConf reads these annotations and names typing's Optional in its messages, as in schema.py
"""The reward model's keys (docs/reward-models.md): verl 0.9.1's ``reward.reward_model`` section and the
model part of verl's older ``reward_model.*`` spelling; fields of ``config.schema.TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import II


@dataclass
class JudgeConfig:
    template: Optional[str] = None  # ours: the judge's question, with {response} (and {prompt}, {ground_truth})
    parser: str = "score"  # ours: score (the answer's last number) | verdict (its first yes/no: 1.0 / 0.0)
    failure_score: float = 0.0  # ours: the score of an answer that does not parse (counted in judge/parse_failures)


@dataclass
class JudgeRolloutConfig:
    """The judge's sampling (verl's ``reward.reward_model.rollout``); its tokens draw from their own stream."""

    name: str = "hf"  # ours: hf, splitproof's rollout engine (verl: ??? , an inference server)
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    do_sample: bool = True  # false: greedy judging
    response_length: int = 2048  # the judge's answer, in tokens at most
    seed: int = 42  # keys the judge's sampling streams
    max_num_seqs: int = 1024  # questions per judge forward (speed only)


@dataclass
class RemoteJudgeConfig:
    url: Optional[str] = None  # ours: an OpenAI-compatible API base, e.g. http://127.0.0.1:8000/v1 (kind=remote)
    model: str = "judge"  # ours: the model name sent with every request
    api_key_env: Optional[str] = None  # ours: the environment variable holding the API key (never logged)
    timeout_s: float = 60.0  # ours: seconds a call may take
    retries: int = 2  # ours: further attempts of a failed call before the step fails
    max_concurrent: int = 8  # ours: calls in flight (speed only: answers apply in question order)


@dataclass
class RewardModelConfig:
    """A reward model scoring the samples (docs/reward-models.md): verl 0.9.1's ``reward.reward_model``."""

    enable: bool = False  # score samples with the reward model at model_path
    model_path: Optional[str] = None  # a local sequence classifier (num_labels=1); a causal LM with kind=judge
    chat_template: str = "policy"  # ours: policy (the samples' own token ids) | own (re-rendered, its chat template)
    micro_batch_size_per_gpu: Optional[int] = None  # ours (verl's older key): sequences per forward; null: whole share
    use_dynamic_bsz: bool = False  # ours (verl's older key): micro-batches by a token budget (memory only)
    forward_max_token_len_per_gpu: int = 32768  # ours (verl's older key): the token budget with use_dynamic_bsz
    model_dtype: str = II("actor_rollout_ref.actor.fsdp_config.model_dtype")  # ours: the actor's
    trust_remote_code: bool = False  # run the model directory's own Python code (off unless asked)
    kind: str = "classifier"  # ours: classifier (a sequence classifier) | judge (a causal LM) | remote (an endpoint)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    rollout: JudgeRolloutConfig = field(default_factory=JudgeRolloutConfig)
    remote: RemoteJudgeConfig = field(default_factory=RemoteJudgeConfig)


@dataclass
class LegacyRewardModelModelConfig:
    path: Optional[str] = None  # null: reward.reward_model.model_path
    input_tokenizer: Optional[str] = None  # null: the policy's token ids; set: the reward model's chat template (own)
    trust_remote_code: Optional[bool] = None  # null: reward.reward_model.trust_remote_code
