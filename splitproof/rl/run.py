"""The parts of a training run, built once from its config and then passed as arguments.

``prepare_inputs`` checks what can be checked before any model is loaded (the config, the data files, the
reward function against every row's data source); ``build_parts`` then loads the models. The parts, each
with one owner: the ``actor`` and the ``critic`` (``models.learner.Learner``: model, optimizer, schedule,
inference copy, update), the ``reference_policy``, the rollout ``engine`` with its sampling settings
(``Generation``), the ``prompts`` (datasets and sampler), the ``reward`` (function and manager) and the KL
controller. ``Parts`` bundles them, frozen: a stage reads the parts it names and never writes onto them;
what changes during a run (a model's weights, the sampler's position, in-flight batches) is owned by the
part it belongs to, or returned.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from ..aggregation import token_weights
from ..collective import default_collective
from ..devices import this_process_device
from ..engine import UpdateConfig
from ..engine.precision import compute_in
from ..lora import apply_lora
from ..loss_config import ConfigError
from ..stats import MinibatchStats
from .config.derive import (
    critic_enabled,
    dp_strategy,
    lora_settings,
    multi_turn_settings,
    reward_kwargs,
    reward_manager_of,
    sampling_params,
    to_update_config,
)
from .config.derive import (
    reward_function as reward_function_setting,
)
from .config.load import dump_config
from .config.mixed_precision import actor_precision
from .config.reward_models import reward_model_settings
from .config.schema import TrainConfig
from .data.dynamic_sampling import PromptStream
from .data.prompts import PromptDataset, PromptSampler, load_prompts
from .environments.session import EnvironmentSet
from .environments.setup import PreparedEnvironments, prepare_environments, schema_tools
from .environments.trl_factory import load_environments
from .environments.verifiers_env import verifiers_inputs
from .environments.vf_rollout import VerifiersRollout
from .models.critic import build_critic
from .models.learner import Learner, ReferencePolicy, no_grad_split, wrap_for_ranks
from .models.optim import make_optimizer, make_scheduler
from .models.policy import MODEL_DTYPES, autocast_dtype, frozen_copy, generation_eos_ids, load_policy, load_tokenizer
from .rewards.dapo import RewardManager
from .rewards.filter_metric import check_filter_metric
from .rewards.functions import RewardError, check_reward_sources, load_reward_function
from .rewards.judge import JudgeSettings, load_judge
from .rewards.kl_penalty import make_kl_controller
from .rewards.model_scoring import check_function_takes_score
from .rewards.remote_judge import RemoteJudge, RemoteJudgeSettings
from .rewards.reward_model import RewardModelSettings, load_reward_model
from .rollout.episode import EpisodeRollout
from .rollout.hf import HFRollout, SamplingParams
from .rollout.tool_format import check_tool_template
from .rollout.tools import Tool, load_tools
from .rollout.vllm_engine import VLLMRollout, start_engine, vllm_settings


@dataclass(frozen=True)
class Generation:
    """The rollout engine and its sampling settings (training, and held-out ``val_kwargs``)."""

    engine: HFRollout | VLLMRollout | EpisodeRollout
    sampling: SamplingParams
    val_sampling: SamplingParams


@dataclass(frozen=True)
class Prompts:
    """The training and validation prompts and the sampler that draws the training batches."""

    train: PromptDataset
    val: PromptDataset | None
    sampler: PromptSampler | PromptStream


@dataclass(frozen=True)
class Reward:
    """The reward function (None: each row's built-in rule), the reward manager, and what they read."""

    fn: Any
    manager: RewardManager
    tokenizer: Any
    total_steps: int  # the run's steps (a TRL-style function's ``max_steps``)
    environment_only: bool = False  # the environments' get_reward is the whole score (rl/environments)
    environment_instances: bool = False  # the reward function gets environments= (TRL's environment_factory)
    model: Any = None  # a reward model (rewards/reward_model.py: RewardModel) or a judge (rewards/judge.py), or None
    rule_metric: bool = False  # with a reward model and no function: the built-in rule reported as ``acc``


@dataclass(frozen=True)
class Parts:
    """Everything a run built once (see the module docstring); ``config`` is the resolved config."""

    config: TrainConfig
    collective: Any
    tokenizer: Any
    actor: Learner
    critic: Learner | None  # PPO with a value model (critic.enable, or gae)
    reference_policy: ReferencePolicy | None  # the KL loss or the KL penalty reads its log-probs
    generation: Generation
    prompts: Prompts
    reward: Reward
    kl_ctrl: Any  # algorithm.use_kl_in_reward: the KL penalty's controller
    total_steps: int
    float_dtype: torch.dtype
    config_yaml: str  # the resolved config as YAML (``config.load.dump_config``), written into every checkpoint
    lora: bool = False  # the policy trains a LoRA adapter; its base weights never change
    device: torch.device = torch.device("cpu")  # trainer.device on this rank: the models and the step's tensors

    @property
    def pad_token_id(self) -> int:
        return pad_id(self.tokenizer)

    def token_aggregate(self, values: Tensor, mask: Tensor, index: Tensor) -> float:
        """``values`` aggregated over the rollout batch with the actor's ``loss_agg_mode`` (verl's
        ``actor/entropy``); ``index``: each row's prompt group."""
        loss = self.actor.update_config.loss
        stats = MinibatchStats.of(mask, index=index)
        weights = token_weights(mask, loss.loss_agg_mode, stats, loss.loss_scale_factor, torch.float64, index)
        zero = torch.zeros((), dtype=torch.float64, device=mask.device)
        return float(torch.where(mask, weights * values.double(), zero).sum())


def greedy(params: SamplingParams) -> SamplingParams:
    return replace(params, n=1, do_sample=False)


def total_training_steps(cfg: TrainConfig, num_rows: int) -> int:
    """``trainer.total_training_steps`` if set, else epochs × full batches per epoch (verl's rule)."""
    if cfg.trainer.total_training_steps is not None:
        return int(cfg.trainer.total_training_steps)
    return cfg.trainer.total_epochs * (num_rows // cfg.data.train_batch_size)


@dataclass
class RunInputs:
    """What a run needs before any model is loaded: every user mistake in these shows up here."""

    update_config: UpdateConfig
    tokenizer: Any
    train_data: PromptDataset
    val_data: PromptDataset | None
    reward_fn: Any
    sampler: PromptSampler | PromptStream
    total_steps: int
    tools: dict[str, Tool] = field(default_factory=dict)
    reward_manager: RewardManager = field(default_factory=RewardManager)
    environments: PreparedEnvironments | None = None  # multi_turn.environment_factory
    notices: list[str] = field(default_factory=list)
    reward_model: RewardModelSettings | JudgeSettings | None = None
    rule_metric: bool = False
    verifiers_env: Any = None  # multi_turn.verifiers_env: its dataset is the data, its rubric the score


def prepare_inputs(cfg: TrainConfig) -> RunInputs:
    """The config's derived settings, the tokenizer, the data, the reward function (checked against every
    row's data source) and the prompt sampler; no model is loaded. Raises ``ConfigError``, ``DataError``,
    ``RewardError`` (or ``ValueError`` for a batch larger than the dataset), naming the key or row."""
    update_config = to_update_config(cfg)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(multi_turn.function_tool_path, multi_turn.tool_config_path) if multi_turn.enable else {}
    factory = multi_turn.environment_factory if multi_turn.enable else None
    classes = load_environments(factory) if factory else {}
    check_tool_template(multi_turn.format, tokenizer, {**tools, **schema_tools(classes)}, cfg.actor_rollout_ref.model)
    template_kwargs = dict(cfg.data.apply_chat_template_kwargs)
    if tools:  # chat prompts show the tools' schemas, as verl renders them
        template_kwargs.setdefault("tools", [tool.schema for tool in tools.values()])
    data_kwargs = dict(
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        truncation=cfg.data.truncation,
        apply_chat_template_kwargs=template_kwargs,
        reward_fn_key=cfg.data.reward_fn_key,
        filter_overlong=cfg.data.filter_overlong_prompts,
    )
    reward_fn = reward_function(cfg)
    vf_env, vf_notices = None, []
    if multi_turn.enable and multi_turn.verifiers_env:  # its dataset is the data (before any model)
        vf_env, train_data, val_data, vf_notices = verifiers_inputs(multi_turn, cfg.data, tokenizer, type(cfg.data)())
    else:
        train_data, val_data = load_data(cfg, tokenizer, data_kwargs)
    environments = None
    if factory:
        environments = prepare_environments(classes, tokenizer, tools, data_kwargs, train_data, val_data, reward_fn)
    rm_settings = reward_model_settings(cfg)
    own_score = (environments and environments.environment_only) or vf_env is not None
    datasets = [] if own_score else [d for d in (train_data, val_data) if d is not None]
    rule_metric = check_sources(reward_fn, rm_settings, datasets)
    seed = 1 if cfg.data.seed is None else cfg.data.seed
    manager = reward_manager_of(cfg)
    if cfg.algorithm.filter_groups.enable:
        check_filter_metric(cfg.algorithm.filter_groups.metric, manager, reward_fn, train_data, tokenizer)
        sampler = PromptStream(len(train_data), seed=seed, shuffle=cfg.data.shuffle)
    else:
        sampler = PromptSampler(len(train_data), cfg.data.train_batch_size, seed=seed, shuffle=cfg.data.shuffle)
    return RunInputs(
        update_config=update_config,
        tokenizer=tokenizer,
        train_data=train_data,
        val_data=val_data,
        reward_fn=reward_fn,
        sampler=sampler,
        total_steps=total_training_steps(cfg, len(train_data)),
        tools=tools,
        reward_manager=manager,
        environments=environments,
        notices=(list(environments.notices) if environments else []) + vf_notices,
        reward_model=rm_settings,
        rule_metric=rule_metric,
        verifiers_env=vf_env,
    )


def check_sources(reward_fn, rm_settings: RewardModelSettings | JudgeSettings | None, datasets) -> bool:
    """Every row scorable (``check_reward_sources``); with a reward model and no function the rule is
    optional: True when it scores every row (then reported as ``acc``)."""
    if rm_settings is None:
        for dataset in datasets:
            check_reward_sources(dataset, reward_fn)
        return False
    check_function_takes_score(reward_fn)
    if reward_fn is not None:
        for dataset in datasets:
            check_reward_sources(dataset, reward_fn)
        return False
    try:
        for dataset in datasets:
            check_reward_sources(dataset, None)
    except RewardError:
        return False
    return True


def build_actor(
    cfg: TrainConfig,
    collective,
    total_steps: int,
    vocab_size: int,
    update_config: UpdateConfig,
    device: torch.device | str = "cpu",
) -> tuple[Learner, ReferencePolicy | None]:
    """The policy on ``device`` (LoRA-wrapped when ``lora_rank`` > 0) with its optimizer and schedule, and
    the reference policy when the KL loss or the KL penalty reads it."""
    dtype = MODEL_DTYPES[cfg.actor_rollout_ref.actor.fsdp_config.model_dtype]
    torch.manual_seed(cfg.trainer.seed)
    policy = load_policy(cfg.actor_rollout_ref.model, dtype=dtype, vocab_size=vocab_size, device=device)
    lora = lora_settings(cfg)
    if lora.enabled:  # every rank agrees before any collective: a bad adapter fails on all of them
        policy = _agreed_on(collective, lambda: apply_lora(policy, lora, seed=cfg.trainer.seed))
    policy = compute_in(policy, autocast_dtype(actor_precision(cfg)))  # the reference's copy computes alike
    needs_ref = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    # LoRA: the reference is the policy with its adapter disabled, no copy
    frozen = frozen_copy(policy) if needs_ref and not lora.enabled else None
    strategy = dp_strategy(cfg) if collective.world_size > 1 else ""
    policy, inference_copy = wrap_for_ranks(policy, strategy, collective.world_size)
    optimizer = make_optimizer(policy, cfg.actor_rollout_ref.actor.optim)
    scheduler = make_scheduler(optimizer, cfg.actor_rollout_ref.actor.optim, total_steps)
    r = cfg.actor_rollout_ref.rollout
    split = no_grad_split(
        r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu
    )
    actor = Learner(
        kind="actor",
        model=policy,
        optimizer=optimizer,
        scheduler=scheduler,
        update_config=update_config,
        no_grad_split=split,
        inference_copy=inference_copy,
        trainable_only=lora.enabled,
    )
    reference = None
    if needs_ref:
        reference = ReferencePolicy(actor=actor) if lora.enabled else ReferencePolicy(frozen=frozen)
    return actor, reference


def reference_split(cfg: TrainConfig) -> dict:
    """The reference log-prob pass's split (``actor_rollout_ref.ref.log_prob_*``)."""
    r = cfg.actor_rollout_ref.ref
    return no_grad_split(
        r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu
    )


def build_generation(
    cfg: TrainConfig,
    model,
    tokenizer,
    tools: dict[str, Tool],
    environments: EnvironmentSet | None = None,
    llm=None,
    verifiers_env=None,
) -> Generation:
    """The rollout engine on ``model`` (the actor's inference policy): ``rollout.name`` hf, or vllm (on the
    started engine ``llm``, else one started here), multi-turn when enabled."""
    eos, pad = generation_eos_ids(model, tokenizer), pad_id(tokenizer)
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        engine = VLLMRollout(model, vllm_settings(cfg), eos_token_ids=eos, pad_token_id=pad, llm=llm)
    else:
        engine = HFRollout(
            model, eos_token_ids=eos, pad_token_id=pad, max_num_seqs=cfg.actor_rollout_ref.rollout.max_num_seqs
        )
    if verifiers_env is not None:  # the environment's own rollout loop drives the engine
        template_kwargs = {k: v for k, v in cfg.data.apply_chat_template_kwargs.items() if k != "tools"}
        engine = VerifiersRollout(engine, tokenizer, verifiers_env, template_kwargs)
    elif cfg.actor_rollout_ref.rollout.multi_turn.enable:
        engine = EpisodeRollout(engine, tokenizer, tools, multi_turn_settings(cfg), environments)
    train, val = sampling_params(cfg)
    return Generation(engine=engine, sampling=train, val_sampling=val)


def build_parts(cfg: TrainConfig, *, collective=None, inputs: RunInputs | None = None) -> Parts:
    """Data, reward and config checks first (``prepare_inputs``, no model loaded yet; pass its result as
    ``inputs`` when already done), then the models and the optimizers, on ``trainer.device``
    (``devices.this_process_device``: under torchrun GPU ``LOCAL_RANK``)."""
    device = this_process_device(cfg.trainer.device)
    collective = collective or default_collective(device)
    inputs = inputs or prepare_inputs(cfg)
    dtype = MODEL_DTYPES[cfg.actor_rollout_ref.actor.fsdp_config.model_dtype]
    tokenizer, total = inputs.tokenizer, inputs.total_steps
    # the vLLM engine first: a model it cannot load fails before the trainer's models are loaded
    llm = start_engine(vllm_settings(cfg)) if cfg.actor_rollout_ref.rollout.name == "vllm" else None
    actor, reference = build_actor(cfg, collective, total, len(tokenizer), inputs.update_config, device)
    prepared = inputs.environments
    environments = prepared.environments if prepared else None
    generation = build_generation(
        cfg, actor.for_inference(), tokenizer, inputs.tools, environments, llm=llm, verifiers_env=inputs.verifiers_env
    )
    critic = None
    if critic_enabled(cfg):
        critic = build_critic(
            cfg, world_size=collective.world_size, total_steps=total, vocab_size=len(tokenizer), device=device
        )
    kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
    float_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return Parts(
        config=cfg,
        collective=collective,
        tokenizer=tokenizer,
        actor=actor,
        critic=critic,
        reference_policy=reference,
        generation=generation,
        prompts=Prompts(train=inputs.train_data, val=inputs.val_data, sampler=inputs.sampler),
        reward=Reward(
            fn=inputs.reward_fn,
            manager=inputs.reward_manager,
            tokenizer=tokenizer,
            total_steps=total,
            environment_only=bool(prepared and prepared.environment_only)
            or (inputs.verifiers_env is not None and inputs.reward_fn is None),
            environment_instances=bool(prepared and prepared.pass_instances),
            model=load_scorer(inputs.reward_model, tokenizer, cfg.trainer.default_local_dir, collective.rank),
            rule_metric=inputs.rule_metric,
        ),
        kl_ctrl=kl_ctrl,
        total_steps=total,
        float_dtype=float_dtype,
        config_yaml=dump_config(cfg),
        lora=actor.trainable_only,
        device=device,
    )


def load_scorer(settings, tokenizer, folder: str, rank: int):
    """The run's reward model (``RewardModelSettings``), judge (``JudgeSettings``) or remote judge, whose
    calls are recorded in the run folder ``folder``; or None."""
    if settings is None:
        return None
    if isinstance(settings, RemoteJudgeSettings):
        return RemoteJudge(settings.judge, settings.remote, folder, rank)
    if isinstance(settings, JudgeSettings):
        return load_judge(settings)
    return load_reward_model(settings, tokenizer)


def _agreed_on(collective, work):
    """``work()`` on every rank; an error on any rank is the same ``ConfigError`` on every rank."""
    try:
        value, failure = work(), None
    except (ConfigError, ImportError) as e:
        value, failure = None, str(e)
    failures = [f for f in collective.gather_objects(failure) if f is not None]
    if failures:
        key, _, message = failures[0].partition(": ")
        raise ConfigError(key, message)
    return value


def load_data(cfg: TrainConfig, tokenizer, data_kwargs: dict) -> tuple[PromptDataset, PromptDataset | None]:
    """``data.train_files`` and ``data.val_files`` (None when unset) as prompt records."""
    train_data = load_prompts(
        _files(cfg.data.train_files), tokenizer, max_samples=cfg.data.train_max_samples, **data_kwargs
    )
    val_data = None
    if cfg.data.val_files:
        val_data = load_prompts(
            _files(cfg.data.val_files), tokenizer, max_samples=cfg.data.val_max_samples, **data_kwargs
        )
    return train_data, val_data


def reward_function(cfg: TrainConfig):
    """The named reward function (``custom_reward_function``, else ``reward.custom_reward_function``), or
    None: each row's built-in rule by its data source."""
    path, name = reward_function_setting(cfg)
    return load_reward_function(path, name, reward_kwargs=reward_kwargs(cfg)) if path else None


def _files(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def pad_id(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
