"""The `splitproof train` configuration: verl's config tree, key names and defaults, typed.

Every key splitproof reads is a field below, with verl 0.9.1's default unless the field's comment says
``ours:``. A default written ``II("a.b")`` follows key ``a.b`` unless set (verl's interpolations).
Keys verl has and this schema does not are handled by ``config_verl``: infrastructure knobs with no
effect here are accepted with a notice, "off" values are accepted, anything else is an error.
``config_load.load_train_config`` merges and resolves; ``config_check.validate`` checks values.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, is_dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import II

BUILTIN_MODEL = "builtin://charlm"


@dataclass
class DataConfig:
    train_files: Any = "builtin://addition/train"  # ours: a built-in task (verl: a gsm8k parquet path); str or list
    val_files: Any = "builtin://addition/test"  # ours: the task's held-out split; str, list or null (no evaluation)
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    max_prompt_length: int = 512
    max_response_length: int = 512
    train_batch_size: int = 1024
    val_batch_size: Optional[int] = None  # no effect on results: validation runs in max_num_seqs chunks
    gen_batch_size: Optional[int] = None  # must be null or equal train_batch_size (no over-sampling)
    shuffle: bool = True
    validation_shuffle: bool = False
    seed: Optional[int] = None  # null -> 1, as verl's sampler does
    truncation: str = "error"  # error | left | right
    filter_overlong_prompts: bool = False
    train_max_samples: int = -1
    val_max_samples: int = -1
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    path: str = BUILTIN_MODEL  # ours: the built-in character model (verl: a 7B checkpoint path)
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False
    custom_chat_template: Optional[str] = None
    use_remove_padding: bool = False  # ours: off (verl: on); on CPU packing is opt-in
    enable_gradient_checkpointing: bool = False  # ours: off (verl: on); exact either way


@dataclass
class OptimConfig:
    optimizer: str = "AdamW"  # AdamW | SGD
    lr: float = 1e-6
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 0.01
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: str = "constant"  # constant | cosine
    warmup_style: Optional[str] = None  # verl's older name for lr_scheduler_type; when set it wins
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_training_steps: int = -1  # -1: the trainer's
    clip_grad: float = 1.0  # verl's engine name for grad_clip: see config_check.combine_grad_clip


@dataclass
class FSDPConfig:
    model_dtype: str = "fp32"  # fp32 | bf16 | fp64 (float32 | bfloat16 | float64 accepted)


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: Optional[float] = None
    cov_strategy: str = "auto"  # ours: how KL-Cov/Clip-Cov obtain their minibatch selection (same update)


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # fsdp (= fsdp2) | fsdp2 | ddp; used when torchrun starts several processes
    ppo_mini_batch_size: int = 256  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = 0.2  # as in verl, set low/high win over clip_ratio
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int = 42  # also seeds Clip-Cov's priority hash
    grad_clip: float = 1.0
    use_remove_padding: bool = II("actor_rollout_ref.model.use_remove_padding")
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class LogProbConfig:
    """The micro-batching of a no-grad log-prob pass (the ref's, or the old log-probs')."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = None
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")


@dataclass
class ValKwargsConfig:
    top_k: int = -1
    top_p: float = 1.0
    temperature: float = 0.0  # 0 with do_sample false: greedy
    n: int = 1
    do_sample: bool = False


@dataclass
class RolloutConfig(LogProbConfig):
    name: str = "hf"  # ours: hf, a KV-cached decode loop (verl: required, vllm | sglang)
    n: int = 1
    temperature: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    top_p: float = 1.0
    do_sample: bool = True
    seed: int = 42
    max_num_seqs: int = 256  # generation batch size: memory and speed only, never the tokens
    prompt_length: int = II("data.max_prompt_length")  # must equal it
    response_length: int = II("data.max_response_length")  # must equal it
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: LogProbConfig = field(default_factory=LogProbConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    nccl_timeout: int = 600  # seconds a collective waits for the other ranks under torchrun (gloo too)


@dataclass
class KLControlConfig:
    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[str] = None  # null | token | sequence
    rollout_is_threshold: float = 2.0
    bypass_mode: bool = False


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "gae"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CriticModelConfig:
    path: Optional[str] = None  # null: the actor's checkpoint
    tokenizer_path: Optional[str] = None
    trust_remote_code: bool = False


@dataclass
class CriticConfig:
    strategy: str = II("actor_rollout_ref.actor.strategy")
    enable: Optional[bool] = None  # null: on exactly when adv_estimator is gae
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")
    ppo_micro_batch_size_per_gpu: Optional[int] = None
    use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")
    ppo_max_token_len_per_gpu: int = 32768
    forward_max_token_len_per_gpu: int = II("critic.ppo_max_token_len_per_gpu")
    forward_micro_batch_size_per_gpu: Optional[int] = II("critic.ppo_micro_batch_size_per_gpu")
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")
    shuffle: bool = II("actor_rollout_ref.actor.shuffle")
    data_loader_seed: int = 42
    cliprange_value: float = 0.5
    loss_agg_mode: str = II("actor_rollout_ref.actor.loss_agg_mode")
    loss_scale_factor: Optional[float] = II("actor_rollout_ref.actor.loss_scale_factor")
    grad_clip: float = 1.0
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 30
    total_training_steps: Optional[int] = None  # null: total_epochs x steps per epoch
    project_name: str = "splitproof"  # ours (verl: verl_examples)
    experiment_name: str = "default"  # ours (verl: gsm8k)
    logger: List[str] = field(default_factory=lambda: ["console", "file"])  # ours (verl: console, wandb)
    save_freq: int = -1
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None
    resume_allow_config_change: bool = False  # ours: resume although result-affecting keys changed
    val_before_train: bool = True
    val_only: bool = False
    test_freq: int = -1
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"
    max_actor_ckpt_to_keep: Optional[int] = None
    device: str = "cpu"  # ours: cpu (verl: cuda)
    seed: int = 0  # ours: the model-initialisation and global RNG seed


@dataclass
class RewardFunctionConfig:
    path: Optional[str] = None  # a file, file://PATH or pkg://package.module
    name: Optional[str] = None  # null: compute_score


@dataclass
class RewardConfig:
    """verl 0.9.1 also reads the reward function from ``reward.custom_reward_function``."""

    custom_reward_function: RewardFunctionConfig = field(
        default_factory=lambda: RewardFunctionConfig(name="compute_score"))


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)


@dataclass(frozen=True)
class KeyInfo:
    """One leaf of the schema: its dotted key and its (unwrapped) type."""

    key: str
    type: Any  # int, float, bool, str, list, dict or Any
    optional: bool


def _unwrap(annotation) -> tuple[Any, bool]:
    """(base type, optional) of an annotation: ``Optional[int]`` -> (int, True), ``List[str]`` -> (list, False)."""
    optional = False
    if typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else Any
    origin = typing.get_origin(annotation)
    if origin in (list, List):
        return list, optional
    if origin in (dict, Dict):
        return dict, optional
    return annotation, optional


def _walk(cls, prefix: str):
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        annotation = hints[f.name]
        if is_dataclass(annotation):
            yield from _walk(annotation, key + ".")
        else:
            base, optional = _unwrap(annotation)
            yield KeyInfo(key, base, optional or base is Any)


@lru_cache(maxsize=None)
def schema_keys(cls=TrainConfig) -> Mapping[str, KeyInfo]:
    """Every leaf key of the schema, dotted (``data.train_batch_size``), with its type (read-only)."""
    return MappingProxyType({info.key: info for info in _walk(cls, "")})


@lru_cache(maxsize=None)
def schema_sections(cls=TrainConfig) -> frozenset[str]:
    """Every inner node of the schema, dotted (``actor_rollout_ref.actor.optim``)."""
    sections = set()
    for key in schema_keys(cls):
        parts = key.split(".")
        sections.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(sections)
