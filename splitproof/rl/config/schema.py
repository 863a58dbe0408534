"""The `splitproof train` configuration: verl's config tree, key names and defaults, typed.

Every key splitproof reads is a field below, with verl 0.9.1's default unless the field's comment says
``ours:``. A default written ``II("a.b")`` follows key ``a.b`` unless set (verl's interpolations).
Keys verl has and this schema does not are handled by ``config.verl_keys``: infrastructure knobs with no
effect here are accepted with a notice, "off" values are accepted, anything else is an error.
``config.load.load_train_config`` merges and resolves; ``config.check.check_config`` checks values.
"""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from functools import cache
from types import MappingProxyType
from typing import Any, Dict, List, Mapping, Optional

from omegaconf import II

from .algorithm_schema import AlgorithmConfig
from .reward_model_schema import LegacyRewardModelModelConfig, RewardModelConfig

BUILTIN_MODEL = "builtin://charlm"


@dataclass
class DataConfig:
    train_files: Any = "builtin://addition/train"  # ours: a built-in task (verl: a gsm8k parquet path); str or list
    val_files: Any = "builtin://addition/test"  # ours: the task's held-out split; str, list or null (no evaluation)
    prompt_key: str = "prompt"  # the prompt column: a string, or a chat-message list (rendered with the chat template)
    reward_fn_key: str = "data_source"  # the data-source column (picks the built-in rule)
    max_prompt_length: int = 512  # prompt tokens, at most (longer: data.truncation)
    max_response_length: int = 512  # generated tokens per response, at most
    train_batch_size: int = 1024  # prompts per training step
    val_batch_size: Optional[int] = None  # no effect (a notice): validation runs in max_num_seqs chunks
    gen_batch_size: Optional[int] = (
        None  # prompts per generation round of dynamic sampling (speed only); null: train_batch_size
    )
    shuffle: bool = True  # a new prompt order every epoch, from (data.seed, epoch)
    validation_shuffle: bool = False  # no effect (a notice): validation runs every held-out prompt
    seed: Optional[int] = None  # null -> 1, as verl's sampler does
    truncation: str = "error"  # error | left | right | middle (keeps both ends)
    filter_overlong_prompts: bool = False  # true: leave out prompts over max_prompt_length (a notice counts them)
    train_max_samples: int = -1  # -1: every row; else the first N rows
    val_max_samples: int = -1  # -1: every row; else the first N rows
    apply_chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)  # passed to apply_chat_template


@dataclass
class ModelConfig:
    path: str = BUILTIN_MODEL  # ours: the built-in character model (verl: a 7B checkpoint path)
    tokenizer_path: Optional[str] = None  # null: the model's directory
    trust_remote_code: bool = False  # run the model directory's own Python code (off unless asked)
    custom_chat_template: Optional[str] = None  # a Jinja chat template that replaces the tokenizer's
    use_remove_padding: bool = False  # ours: off (verl: on); on CPU packing is opt-in
    enable_gradient_checkpointing: bool = False  # ours: off (verl: on); exact either way
    lora_rank: int = 0  # LoRA adapter rank; 0: off (every weight trains)
    lora_alpha: float = 16.0  # LoRA scale s = lora_alpha / lora_rank
    target_modules: Any = "all-linear"  # LoRA's layers: all-linear, or a list of module names
    exclude_modules: Optional[List[str]] = None  # module names LoRA leaves out
    lora_adapter_path: Optional[str] = None  # start from a saved adapter (PEFT's format)


@dataclass
class OptimConfig:
    optimizer: str = "AdamW"  # AdamW | SGD
    lr: float = 1e-6  # learning rate
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's betas
    weight_decay: float = 0.01  # decoupled weight decay (AdamW), L2 (SGD)
    lr_warmup_steps: int = -1  # -1: use lr_warmup_steps_ratio
    lr_warmup_steps_ratio: float = 0.0  # warm-up steps as a fraction of the run
    lr_scheduler_type: str = "constant"  # constant | cosine
    warmup_style: Optional[str] = None  # verl's older name for lr_scheduler_type; when set it wins
    min_lr_ratio: float = 0.0  # cosine: the floor, as a fraction of lr
    num_cycles: float = 0.5  # cosine: 0.5 = one half-period over the run
    total_training_steps: int = -1  # -1: the trainer's
    clip_grad: float = 1.0  # verl's engine name for grad_clip: one threshold with it (config.check)


@dataclass
class FSDPConfig:
    model_dtype: str = "fp32"  # fp32 | bf16 | fp64 (float32 | bfloat16 | float64 accepted): parameters, optimizer
    dtype: Optional[str] = None  # ours: null = model_dtype (verl: bfloat16); bf16 over fp32: autocast on a GPU


@dataclass
class PolicyLossConfig:
    loss_mode: str = "vanilla"  # see docs/semantics.md
    clip_cov_ratio: float = 0.0002  # Clip-Cov: fraction of tokens clipped
    clip_cov_lb: float = 1.0  # Clip-Cov: covariance lower bound
    clip_cov_ub: float = 5.0  # Clip-Cov: covariance upper bound
    kl_cov_ratio: float = 0.0002  # KL-Cov: fraction of tokens penalised
    ppo_kl_coef: float = 0.1  # KL-Cov: penalty weight
    dro_beta: Optional[float] = None  # DRO's beta
    cov_strategy: str = "auto"  # ours: how KL-Cov/Clip-Cov obtain their minibatch selection (same update)


@dataclass
class ActorConfig:
    strategy: str = "fsdp"  # fsdp (= fsdp2) | fsdp2 | ddp; used when torchrun starts several processes
    ppo_mini_batch_size: int = 256  # prompts per optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # memory only (null: whole shard)
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead (memory only)
    ppo_max_token_len_per_gpu: int = 16384  # the token budget of a micro-batch, padding included
    clip_ratio: float = 0.2  # PPO clip epsilon (both sides unless low/high are set)
    clip_ratio_low: Optional[float] = 0.2  # as in verl, set low/high win over clip_ratio
    clip_ratio_high: Optional[float] = 0.2
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages
    tau_pos: float = 1.0  # SAPO's temperature for positive advantages
    tau_neg: float = 1.05  # SAPO's temperature for negative advantages
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    loss_agg_mode: str = "token-mean"  # or token-sum, seq-mean-token-*, group-mean-token-mean (docs/semantics.md)
    loss_scale_factor: Optional[float] = None  # seq-mean-token-sum-norm's divisor (null: the response width)
    entropy_coeff: float = 0.0  # entropy bonus weight
    use_kl_loss: bool = False  # a KL term to the reference model in the loss (GRPO's)
    kl_loss_coef: float = 0.001  # its weight
    kl_loss_type: str = "low_var_kl"  # k1 = kl | abs | k2 = mse | k3 = low_var_kl
    ppo_epochs: int = 1  # passes over each rollout batch
    shuffle: bool = False  # shuffle the minibatches of each epoch (seeded by data_loader_seed)
    data_loader_seed: int = 42  # also seeds Clip-Cov's priority hash
    grad_clip: float = 1.0  # gradient-norm clip (optim.clip_grad is the same threshold)
    use_remove_padding: bool = II("actor_rollout_ref.model.use_remove_padding")  # packing (memory, speed only)
    use_prefix_grouper: bool = False  # each distinct prompt computed once in the update and log-prob passes (speed)
    optim: OptimConfig = field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class LogProbConfig:
    """The micro-batching of a no-grad log-prob pass (the ref's, or the old log-probs')."""

    log_prob_micro_batch_size_per_gpu: Optional[int] = (
        None  # sequences per no-grad log-prob micro-batch (memory only; on a CPU, forwards of ~2,048 tokens or 32 rows)
    )
    log_prob_use_dynamic_bsz: bool = II("actor_rollout_ref.actor.use_dynamic_bsz")  # token budget (memory only)
    log_prob_max_token_len_per_gpu: int = II("actor_rollout_ref.actor.ppo_max_token_len_per_gpu")  # that budget


@dataclass
class ValKwargsConfig:
    top_k: int = -1  # validation sampling (as the rollout's keys)
    top_p: float = 1.0
    temperature: float = 0.0  # 0 with do_sample false: greedy
    n: int = 1  # responses per held-out prompt (val-core/<source>/reward/mean@n)
    do_sample: bool = False


@dataclass
class MultiTurnConfig:
    """Episodes of several turns with tool calls (docs/train.md, "Tools and multi-turn")."""

    enable: bool = False  # generate → run the tools called → append their responses → generate again
    max_assistant_turns: Optional[int] = None  # model turns per episode, at most (null: the response budget)
    max_user_turns: Optional[int] = None  # tool-response turns per episode, at most (null: the response budget)
    max_parallel_calls: int = 1  # tool calls of one turn that run (later ones in the turn are dropped, as in verl)
    max_tool_response_length: int = 256  # characters of a tool response; longer ones are truncated
    tool_response_truncate_side: str = "middle"  # left (keep the start) | right (keep the end) | middle
    format: str = "hermes"  # tool-call format: hermes (<tool_call>{json}</tool_call>) | simple (name(args))
    function_tool_path: Optional[str] = None  # a Python file: its public functions are the tools
    tool_config_path: Optional[str] = None  # verl's tool YAML (tools: - class_name, config, tool_schema)
    tool_timeout: Optional[float] = None  # ours: seconds a tool call may take (null: no limit)
    environment_factory: Optional[Any] = None  # TRL's: file.py:Name | module:Name | {name: spec, ...}
    verifiers_env: Optional[str] = None  # a verifiers environment: env.py | module (its load_environment)
    verifiers_env_args: Optional[dict] = None  # keyword arguments of its load_environment


@dataclass
class AgentConfig:
    num_workers: int = 8  # threads running tool calls; speed only (responses are applied in canonical order)


@dataclass
class RolloutConfig(LogProbConfig):
    name: str = "hf"  # ours: hf, a KV-cached decode loop | vllm (pip install -e '.[vllm]') (verl: required)
    n: int = 1  # responses per prompt (a GRPO group)
    temperature: float = 1.0  # sampling temperature (also divides the log-prob logits)
    top_k: int = -1  # -1 (or 0): off
    top_p: float = 1.0  # nucleus sampling; 1: off
    do_sample: bool = True  # false: greedy
    seed: int = 42  # keys every sample's randomness with (step, prompt uid, sample index)
    max_num_seqs: int = 256  # generation batch size: memory and speed only, never the tokens
    calculate_log_probs: bool = True  # keep the rollout's log-probs (rollout_corr/ metrics, bypass_mode, rollout_is)
    prompt_length: int = II("data.max_prompt_length")  # must equal it
    response_length: int = II("data.max_response_length")  # must equal it
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    # the vLLM engine's keys: read with name=vllm only (with hf: a notice, no effect)
    dtype: Optional[str] = None  # ours: null = the actor's model_dtype (verl: bfloat16); vllm
    max_num_batched_tokens: int = 8192  # tokens of one engine step (vllm)
    max_model_len: Optional[int] = None  # null: prompt_length + response_length (vllm)
    enable_chunked_prefill: bool = True  # vllm
    enable_prefix_caching: bool = True  # vllm: reuses a prompt's (a turn's) KV cache
    enforce_eager: bool = False  # vllm on a GPU: no CUDA graphs (the CPU backend is eager; a notice)
    gpu_memory_utilization: float = 0.5  # vllm on a GPU (CPU: VLLM_CPU_KVCACHE_SPACE; a notice)
    free_cache_engine: bool = True  # vllm on a GPU: sleep between rollouts (not on CPU; a notice)
    tensor_model_parallel_size: int = 1  # ours: 1 only (verl: 2); vllm


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: LogProbConfig = field(default_factory=LogProbConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    nccl_timeout: int = 600  # seconds a collective waits for the other ranks under torchrun (gloo too)


@dataclass
class CriticModelConfig:
    path: Optional[str] = II("actor_rollout_ref.model.path")  # ours: the actor's model (verl: a 7B checkpoint path)
    trust_remote_code: bool = False  # run the critic model directory's own Python code (off unless asked)
    use_remove_padding: bool = II(
        "actor_rollout_ref.model.use_remove_padding"
    )  # ours: the actor's (verl: on); packing (speed only)
    enable_gradient_checkpointing: bool = II(
        "actor_rollout_ref.model.enable_gradient_checkpointing"
    )  # ours: the actor's (verl: on)


@dataclass
class CriticFSDPConfig:
    model_dtype: str = II("actor_rollout_ref.actor.fsdp_config.model_dtype")  # ours: the actor's (verl: fp32)
    dtype: Optional[str] = II("actor_rollout_ref.actor.fsdp_config.dtype")  # ours: the actor's (verl: bfloat16)


@dataclass
class CriticConfig:
    strategy: str = II("actor_rollout_ref.actor.strategy")  # ddp | fsdp2 | fsdp, under torchrun
    enable: Optional[bool] = None  # null: on exactly when adv_estimator is gae
    ppo_mini_batch_size: int = II("actor_rollout_ref.actor.ppo_mini_batch_size")  # prompts per critic optimizer step
    ppo_micro_batch_size_per_gpu: Optional[int] = None  # memory only (null: whole shard)
    use_dynamic_bsz: bool = II(
        "actor_rollout_ref.actor.use_dynamic_bsz"
    )  # micro-batches by a token budget (memory only)
    ppo_max_token_len_per_gpu: int = 32768  # the update's token budget
    forward_max_token_len_per_gpu: int = II("critic.ppo_max_token_len_per_gpu")  # the values pass's token budget
    forward_micro_batch_size_per_gpu: Optional[int] = II(
        "critic.ppo_micro_batch_size_per_gpu"
    )  # sequences per values micro-batch (memory only; on a CPU, forwards of ~2,048 tokens or 32 rows)
    ppo_epochs: int = II("actor_rollout_ref.actor.ppo_epochs")  # passes over each rollout batch
    shuffle: bool = II("actor_rollout_ref.actor.shuffle")  # shuffle the minibatches (seeded by data_loader_seed)
    data_loader_seed: int = 42  # the critic's minibatch-shuffle seed
    cliprange_value: float = 0.5  # value clip: V_old +- cliprange_value
    loss_agg_mode: str = II("actor_rollout_ref.actor.loss_agg_mode")  # the value loss's aggregation
    loss_scale_factor: Optional[float] = II(
        "actor_rollout_ref.actor.loss_scale_factor"
    )  # seq-mean-token-sum-norm's divisor
    grad_clip: float = 1.0  # gradient-norm clip (optim.clip_grad is the same threshold)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    fsdp: CriticFSDPConfig = field(default_factory=CriticFSDPConfig)


@dataclass
class TrainerConfig:
    total_epochs: int = 30  # used when total_training_steps is null
    total_training_steps: Optional[int] = None  # null: total_epochs x steps per epoch
    project_name: str = "splitproof"  # ours (verl: verl_examples)
    experiment_name: str = "default"  # ours (verl: gsm8k)
    logger: List[str] = field(default_factory=lambda: ["console", "file"])  # ours (verl: console, wandb)
    save_freq: int = -1  # checkpoint every N steps and at the last step; -1: never
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: Optional[str] = None  # a global_step_N directory (or a run directory) for resume_mode=resume_path
    resume_allow_config_change: bool = False  # ours: resume although result-affecting keys changed
    val_before_train: bool = True  # evaluate at step 0 (skipped when resuming)
    val_only: bool = False  # evaluate the current weights, show the scores, then stop (writes no file)
    test_freq: int = -1  # evaluate every N steps and at the last step; -1: only before training
    default_local_dir: str = "checkpoints/${trainer.project_name}/${trainer.experiment_name}"  # outputs
    max_actor_ckpt_to_keep: Optional[int] = None  # null: keep every checkpoint
    critic_warmup: int = (
        0  # the actor is updated from step max(1, critic_warmup) on (verl's rule); the critic every step
    )
    device: str = "cpu"  # ours: cpu; cuda (each rank on GPU LOCAL_RANK, NCCL) or cuda:N (verl: cuda); docs/gpu.md
    seed: int = 0  # ours: the model-initialisation and global RNG seed
    rollout_data_dir: Optional[str] = (
        None  # a folder: each step's samples as <step>.jsonl (input, output, gts, score, step, extras)
    )
    validation_data_dir: Optional[str] = None  # a folder: each evaluation's samples as <step>.jsonl
    cpu_threads: Optional[int] = 1  # ours: torch's CPU threads per process (null: torch's, one per core); speed only
    cpu_keep_freed_memory: bool = True  # ours: on a CPU run glibc's malloc keeps freed memory for reuse; speed only


@dataclass
class AsyncTrainingConfig:
    staleness_steps: int = 0  # ours: k; rollouts come from the policy k steps back (0: synchronous; one-step-off: 1)


@dataclass
class RewardFunctionConfig:
    path: Optional[str] = None  # a file, file://PATH or pkg://package.module
    name: Optional[str] = None  # null: compute_score
    reward_kwargs: Dict[str, Any] = field(
        default_factory=dict
    )  # keyword arguments added to every call (they win over the call's own, as in verl)


@dataclass
class RewardManagerConfig:
    name: str = "naive"  # naive | dapo (score + overlong penalty)


@dataclass
class RewardConfig:
    """verl 0.9.1 also reads the reward function from ``reward.custom_reward_function``."""

    custom_reward_function: RewardFunctionConfig = field(
        default_factory=lambda: RewardFunctionConfig(name="compute_score")
    )
    reward_manager: RewardManagerConfig = field(default_factory=RewardManagerConfig)
    reward_kwargs: Dict[str, Any] = field(
        default_factory=dict
    )  # dapo: overlong_buffer_cfg.{enable,len,penalty_factor,log}, max_resp_len
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class LegacyRewardModelConfig:
    """verl's older spelling of the reward manager, mapped onto ``reward.*``."""

    reward_manager: Optional[str] = None  # null: reward.reward_manager.name
    reward_kwargs: Dict[str, Any] = field(default_factory=dict)  # as reward.reward_kwargs
    enable: Optional[bool] = None  # null: reward.reward_model.enable
    model: LegacyRewardModelModelConfig = field(default_factory=LegacyRewardModelModelConfig)
    micro_batch_size_per_gpu: Optional[int] = None  # null: reward.reward_model.micro_batch_size_per_gpu
    use_dynamic_bsz: Optional[bool] = None  # null: reward.reward_model.use_dynamic_bsz
    forward_max_token_len_per_gpu: Optional[int] = None  # null: reward.reward_model.forward_max_token_len_per_gpu


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    custom_reward_function: RewardFunctionConfig = field(default_factory=RewardFunctionConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: LegacyRewardModelConfig = field(default_factory=LegacyRewardModelConfig)


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


@cache
def schema_keys(cls=TrainConfig) -> Mapping[str, KeyInfo]:
    """Every leaf key of the schema, dotted (``data.train_batch_size``), with its type (read-only)."""
    return MappingProxyType({info.key: info for info in _walk(cls, "")})


@cache
def schema_sections(cls=TrainConfig) -> frozenset[str]:
    """Every inner node of the schema, dotted (``actor_rollout_ref.actor.optim``)."""
    sections = set()
    for key in schema_keys(cls):
        parts = key.split(".")
        sections.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(sections)


def field_comments(cls) -> dict[str, str]:
    """The ``# comment`` of each field of a dataclass, from its source: the first comment within the field's
    statement (after the annotation on its line, or inside the parentheses the formatter wraps a long one in)."""
    source = textwrap.dedent(inspect.getsource(cls))
    by_line: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            by_line.setdefault(token.start[0], token.string[1:].strip())
    comments: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found = [by_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in by_line]
            if found and found[0]:
                comments[node.target.id] = found[0]
    return comments


def walk_defaults(obj, prefix: str = ""):
    """(dotted key, default value, comment) of every leaf, from a default-constructed config."""
    comments = field_comments(type(obj))
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            yield from walk_defaults(value, key + ".")
        else:
            yield key, value, comments.get(f.name, "")
