"""Everything a training run builds once from its config: data, reward, models, optimizer, sampler.

``build_run`` checks what can be checked before any model is loaded (the config, the data files, the
reward function against every row's data source), then loads the model (and the critic, for PPO). Under
torchrun the policy is wrapped for DDP or FSDP2; generation and the no-grad log-prob passes run on a
plain module holding the same weights (the policy itself under DDP or on one process, a copy refreshed
after each update under FSDP2, whose sharded forward would need every rank in lockstep). The critic is
kept the same way (``critic.Critic``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from ..aggregation import token_weights
from ..collective import default_collective
from ..engine import UpdateConfig, wrap_model
from ..hf_models import unwrap
from ..lora import adapter_disabled, apply_lora
from ..loss_config import ConfigError
from ..stats import MinibatchStats
from .config.schema import TrainConfig
from .config.check import (critic_enabled, dp_strategy, lora_settings, reward_function as reward_function_setting,
                           reward_kwargs, reward_manager_of, to_update_config)
from .data.dynamic_sampling import PromptStream
from .rewards.dapo import RewardManager
from .rewards.filter_metric import check_filter_metric
from .models.critic import Critic, build_critic
from .data.prompts import PromptDataset, PromptSampler, load_prompts
from .rewards.kl_penalty import make_kl_controller
from .models.policy import MODEL_DTYPES, frozen_copy, generation_eos_ids, load_policy, load_tokenizer, refresh_copy
from .rewards.functions import check_reward_sources, load_reward_function
from .rollout.episode import EpisodeRollout, MultiTurnSettings
from .rollout.hf import HFRollout, SamplingParams
from .rollout.tools import Tool, load_tools
from .models.optim import make_optimizer, make_scheduler


@dataclass
class Run:
    config: TrainConfig
    update_config: UpdateConfig
    collective: Any
    tokenizer: Any
    train_data: PromptDataset
    val_data: PromptDataset | None
    reward_fn: Any
    policy: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    rollout: HFRollout | EpisodeRollout
    ref: nn.Module | None
    sampling: SamplingParams
    val_sampling: SamplingParams
    sampler: PromptSampler | PromptStream
    kl_ctrl: Any
    total_steps: int
    float_dtype: torch.dtype
    reward_manager: RewardManager = field(default_factory=RewardManager)
    inference_copy: nn.Module | None = None  # FSDP2 only
    critic: Critic | None = None  # PPO with a value model (critic.enable, or gae)
    lora: bool = False  # the policy trains a LoRA adapter; its base weights never change
    needs_reference: bool = False  # the KL loss or the KL penalty reads reference log-probs
    optimizer_steps: int = 0
    pipeline: Any = None  # rollout.pipeline.RolloutPipeline while a pipelined run (staleness_steps > 0) trains
    extra: dict = field(default_factory=dict)

    @property
    def pad_token_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def dataset_for(self, stream: int) -> PromptDataset:
        return self.val_data if stream == 1 else self.train_data

    def policy_for_inference(self) -> nn.Module:
        return self.inference_copy if self.inference_copy is not None else unwrap(self.policy)

    @contextmanager
    def reference(self):
        """The reference policy for a no-grad pass: the frozen copy, or with LoRA the inference policy with
        its adapter disabled (the base model, unmerged, no copy)."""
        if not self.lora:
            yield self.ref
            return
        with adapter_disabled(self.policy_for_inference()) as base:
            yield base

    def after_update(self) -> None:
        """Refresh the FSDP2 inference copy from the sharded policy (every rank takes part); with LoRA,
        the adapter alone (the base weights never change)."""
        refresh_copy(self.policy, self.inference_copy, trainable_only=self.lora)

    @property
    def old_log_prob_split(self) -> dict:
        r = self.config.actor_rollout_ref.rollout
        return _split(r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu)

    @property
    def ref_log_prob_split(self) -> dict:
        r = self.config.actor_rollout_ref.ref
        return _split(r.log_prob_micro_batch_size_per_gpu, r.log_prob_use_dynamic_bsz, r.log_prob_max_token_len_per_gpu)

    def token_aggregate(self, values: Tensor, mask: Tensor, index: Tensor) -> float:
        """``values`` aggregated over the rollout batch with the actor's ``loss_agg_mode`` (verl's
        ``actor/entropy``); ``index``: each row's prompt group."""
        loss = self.update_config.loss
        stats = MinibatchStats.of(mask, index=index)
        weights = token_weights(mask, loss.loss_agg_mode, stats, loss.loss_scale_factor, torch.float64, index)
        return float(torch.where(mask, weights * values.double(), torch.zeros((), dtype=torch.float64)).sum())


def _split(micro_batch_size, use_dynamic_bsz, max_token_len) -> dict:
    if use_dynamic_bsz:
        return {"max_token_len": int(max_token_len)}
    return {"micro_batch_size": micro_batch_size}


def sampling_params(cfg: TrainConfig) -> tuple[SamplingParams, SamplingParams]:
    """The training and validation sampling settings (verl's rollout keys and ``rollout.val_kwargs``)."""
    r, v = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.rollout.val_kwargs
    train = SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, do_sample=r.do_sample,
                           max_response_length=cfg.data.max_response_length, seed=r.seed)
    val = SamplingParams(n=v.n, temperature=v.temperature, top_p=v.top_p, top_k=v.top_k, do_sample=v.do_sample,
                         max_response_length=cfg.data.max_response_length, seed=r.seed)
    return train, val


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


def prepare_inputs(cfg: TrainConfig) -> RunInputs:
    """The config's derived settings, the tokenizer, the data, the reward function (checked against every
    row's data source) and the prompt sampler; no model is loaded. Raises ``ConfigError``, ``DataError``,
    ``RewardError`` (or ``ValueError`` for a batch larger than the dataset), naming the key or row."""
    update_config = to_update_config(cfg)
    tokenizer = load_tokenizer(cfg.actor_rollout_ref.model)
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    tools = load_tools(multi_turn.function_tool_path, multi_turn.tool_config_path) if multi_turn.enable else {}
    template_kwargs = dict(cfg.data.apply_chat_template_kwargs)
    if tools:  # chat prompts show the tools' schemas, as verl renders them
        template_kwargs.setdefault("tools", [tool.schema for tool in tools.values()])
    data_kwargs = dict(prompt_key=cfg.data.prompt_key, max_prompt_length=cfg.data.max_prompt_length,
                       truncation=cfg.data.truncation, apply_chat_template_kwargs=template_kwargs,
                       reward_fn_key=cfg.data.reward_fn_key, filter_overlong=cfg.data.filter_overlong_prompts)
    train_data = load_prompts(_files(cfg.data.train_files), tokenizer, max_samples=cfg.data.train_max_samples,
                              **data_kwargs)
    val_data = None
    if cfg.data.val_files:
        val_data = load_prompts(_files(cfg.data.val_files), tokenizer, max_samples=cfg.data.val_max_samples,
                                **data_kwargs)
    reward_fn = reward_function(cfg)
    for dataset in (train_data, val_data):
        if dataset is not None:
            check_reward_sources(dataset, reward_fn)
    seed = 1 if cfg.data.seed is None else cfg.data.seed
    manager = reward_manager_of(cfg)
    if cfg.algorithm.filter_groups.enable:
        check_filter_metric(cfg.algorithm.filter_groups.metric, manager, reward_fn, train_data, tokenizer)
        sampler = PromptStream(len(train_data), seed=seed, shuffle=cfg.data.shuffle)
    else:
        sampler = PromptSampler(len(train_data), cfg.data.train_batch_size, seed=seed, shuffle=cfg.data.shuffle)
    return RunInputs(update_config=update_config, tokenizer=tokenizer, train_data=train_data, val_data=val_data,
                     reward_fn=reward_fn, sampler=sampler, total_steps=total_training_steps(cfg, len(train_data)),
                     tools=tools,
                     reward_manager=manager)


def build_run(cfg: TrainConfig, *, collective=None, inputs: RunInputs | None = None) -> Run:
    """Data, reward and config checks first (``prepare_inputs``, no model loaded yet; pass its result as
    ``inputs`` when already done), then the models and the optimizer."""
    collective = collective or default_collective("cpu")
    inputs = inputs or prepare_inputs(cfg)
    dtype = MODEL_DTYPES[cfg.actor_rollout_ref.actor.fsdp_config.model_dtype]
    tokenizer, total = inputs.tokenizer, inputs.total_steps
    train_sampling, val_sampling = sampling_params(cfg)

    torch.manual_seed(cfg.trainer.seed)
    policy = load_policy(cfg.actor_rollout_ref.model, dtype=dtype, vocab_size=len(tokenizer))
    lora = lora_settings(cfg)
    if lora.enabled:  # every rank agrees before any collective: a bad adapter fails on all of them
        policy = _agreed_on(collective, lambda: apply_lora(policy, lora, seed=cfg.trainer.seed))
    needs_ref = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
    # LoRA: the reference is the policy with its adapter disabled (Run.reference), no copy
    ref = frozen_copy(policy) if needs_ref and not lora.enabled else None
    inference_copy = None
    if collective.world_size > 1:
        strategy = dp_strategy(cfg)
        if strategy == "fsdp2":
            inference_copy = frozen_copy(policy)
        policy = wrap_model(policy, strategy)
    optimizer = make_optimizer(policy, cfg.actor_rollout_ref.actor.optim)
    scheduler = make_scheduler(optimizer, cfg.actor_rollout_ref.actor.optim, total)
    rollout_model = inference_copy if inference_copy is not None else unwrap(policy)
    rollout = HFRollout(rollout_model, eos_token_ids=generation_eos_ids(rollout_model, tokenizer),
                        pad_token_id=_pad_id(tokenizer),
                        max_num_seqs=cfg.actor_rollout_ref.rollout.max_num_seqs)
    if cfg.actor_rollout_ref.rollout.multi_turn.enable:
        rollout = EpisodeRollout(rollout, tokenizer, inputs.tools, multi_turn_settings(cfg))
    critic = None
    if critic_enabled(cfg):
        critic = build_critic(cfg, world_size=collective.world_size, total_steps=total, vocab_size=len(tokenizer))
    kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl) if cfg.algorithm.use_kl_in_reward else None
    float_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    return Run(config=cfg, update_config=inputs.update_config, collective=collective, tokenizer=tokenizer,
               train_data=inputs.train_data, val_data=inputs.val_data, reward_fn=inputs.reward_fn, policy=policy,
               optimizer=optimizer, scheduler=scheduler, rollout=rollout, ref=ref, sampling=train_sampling,
               val_sampling=val_sampling, sampler=inputs.sampler, kl_ctrl=kl_ctrl, total_steps=total,
               float_dtype=float_dtype, inference_copy=inference_copy, critic=critic, lora=lora.enabled,
               needs_reference=needs_ref, reward_manager=inputs.reward_manager)


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


def multi_turn_settings(cfg: TrainConfig) -> MultiTurnSettings:
    r = cfg.actor_rollout_ref.rollout
    mt = r.multi_turn
    return MultiTurnSettings(format=mt.format, max_assistant_turns=mt.max_assistant_turns,
                             max_user_turns=mt.max_user_turns, max_parallel_calls=mt.max_parallel_calls,
                             max_tool_response_length=mt.max_tool_response_length,
                             tool_response_truncate_side=mt.tool_response_truncate_side,
                             tool_timeout=mt.tool_timeout, num_workers=r.agent.num_workers)


def reward_function(cfg: TrainConfig):
    """The named reward function (``custom_reward_function``, else ``reward.custom_reward_function``), or
    None: each row's built-in rule by its data source."""
    path, name = reward_function_setting(cfg)
    return load_reward_function(path, name, reward_kwargs=reward_kwargs(cfg)) if path else None


def _files(value) -> list[str]:
    return [value] if isinstance(value, str) else [str(v) for v in value]


def _pad_id(tokenizer) -> int:
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


