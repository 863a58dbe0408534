"""Checks of the model parts of a `TrainConfig`: the actor (with its optimizer), the rollout (with multi-turn
episodes) and the critic; ``config.check`` runs them in ``CHECKS``."""

from __future__ import annotations

from dataclasses import fields

from .check_rules import finite, is_int, one_of, optional_positive_int, positive_int, require
from .derive import (
    ACTOR,
    ARR,
    CRITIC_ESTIMATORS,
    ROLLOUT,
    STRATEGIES,
    critic_enabled,
    lora_settings,
    to_critic_update_config,
    to_update_config,
)
from .schema import MultiTurnConfig, OptimConfig, TrainConfig
from .vllm_keys import check_vllm_rollout

ROLLOUT_NAMES = ("hf", "vllm")
LATER_ROLLOUTS = ("sglang", "trtllm")
OPTIMIZERS = ("AdamW", "SGD")
LR_SCHEDULERS = ("constant", "cosine")


def check_optim(optim: OptimConfig, key: str) -> None:
    one_of(optim.optimizer, OPTIMIZERS, f"{key}.optimizer")
    require(finite(optim.lr) and optim.lr > 0, f"{key}.lr", f"must be a number > 0, got {optim.lr!r}")
    betas = optim.betas
    require(
        len(betas) == 2 and all(finite(b) and 0 <= b < 1 for b in betas),
        f"{key}.betas",
        f"must be two numbers in [0, 1), got {betas!r}",
    )
    require(
        finite(optim.weight_decay) and optim.weight_decay >= 0,
        f"{key}.weight_decay",
        f"must be >= 0, got {optim.weight_decay!r}",
    )
    require(optim.lr_warmup_steps >= -1, f"{key}.lr_warmup_steps", f"must be -1 or >= 0, got {optim.lr_warmup_steps!r}")
    require(
        0 <= optim.lr_warmup_steps_ratio <= 1,
        f"{key}.lr_warmup_steps_ratio",
        f"must be in [0, 1], got {optim.lr_warmup_steps_ratio!r}",
    )
    one_of(optim.lr_scheduler_type, LR_SCHEDULERS, f"{key}.lr_scheduler_type")
    require(0 <= optim.min_lr_ratio <= 1, f"{key}.min_lr_ratio", f"must be in [0, 1], got {optim.min_lr_ratio!r}")
    require(
        finite(optim.num_cycles) and optim.num_cycles >= 0,
        f"{key}.num_cycles",
        f"must be >= 0, got {optim.num_cycles!r}",
    )
    require(
        optim.total_training_steps == -1 or optim.total_training_steps >= 1,
        f"{key}.total_training_steps",
        f"must be -1 (the trainer's) or >= 1, got {optim.total_training_steps!r}",
    )
    require(
        finite(optim.clip_grad) and optim.clip_grad > 0, f"{key}.clip_grad", f"must be > 0, got {optim.clip_grad!r}"
    )


def check_actor(cfg: TrainConfig) -> None:
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    require(bool(arr.model.path), f"{ARR}.model.path", "must not be empty")
    one_of(actor.strategy, tuple(STRATEGIES), f"{ACTOR}.strategy", later=("megatron",), later_reason="not supported")
    dtype = actor.fsdp_config.model_dtype
    one_of(
        dtype,
        ("fp32", "bf16", "fp64"),
        f"{ACTOR}.fsdp_config.model_dtype",
        later=("fp16", "float16"),
        later_reason="not supported (fp16 needs loss scaling)",
    )
    positive_int(actor.ppo_mini_batch_size, f"{ACTOR}.ppo_mini_batch_size")
    require(
        cfg.data.train_batch_size % actor.ppo_mini_batch_size == 0,
        f"{ACTOR}.ppo_mini_batch_size",
        f"must divide data.train_batch_size ({cfg.data.train_batch_size}) into whole minibatches, "
        f"got {actor.ppo_mini_batch_size}",
    )
    optional_positive_int(actor.ppo_micro_batch_size_per_gpu, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    for section, owner in ((ROLLOUT, arr.rollout), (f"{ARR}.ref", arr.ref)):
        optional_positive_int(owner.log_prob_micro_batch_size_per_gpu, f"{section}.log_prob_micro_batch_size_per_gpu")
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    budgets = [(f"{ACTOR}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, actor.use_dynamic_bsz)]
    for section, owner in ((ROLLOUT, arr.rollout), (f"{ARR}.ref", arr.ref)):
        budgets.append(
            (
                f"{section}.log_prob_max_token_len_per_gpu",
                owner.log_prob_max_token_len_per_gpu,
                owner.log_prob_use_dynamic_bsz,
            )
        )
    for key, budget, dynamic in budgets:
        positive_int(budget, key)
        if dynamic:
            require(
                budget >= sequence,
                key,
                f"must hold one whole sequence (data.max_prompt_length + "
                f"data.max_response_length = {sequence}), got {budget}",
            )
    positive_int(actor.ppo_epochs, f"{ACTOR}.ppo_epochs")
    positive_int(arr.nccl_timeout, f"{ARR}.nccl_timeout")
    check_optim(actor.optim, f"{ACTOR}.optim")
    lora_settings(cfg)
    to_update_config(cfg)  # every loss and update field, named


def check_rollout(cfg: TrainConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    one_of(rollout.name, ROLLOUT_NAMES, f"{ROLLOUT}.name", later=LATER_ROLLOUTS)
    positive_int(rollout.n, f"{ROLLOUT}.n")
    positive_int(rollout.max_num_seqs, f"{ROLLOUT}.max_num_seqs")
    require(
        finite(rollout.temperature) and rollout.temperature > 0,
        f"{ROLLOUT}.temperature",
        f"must be > 0, got {rollout.temperature!r}",
    )
    for key, sampling in ((ROLLOUT, rollout), (f"{ROLLOUT}.val_kwargs", rollout.val_kwargs)):
        require(
            finite(sampling.top_p) and 0 < sampling.top_p <= 1,
            f"{key}.top_p",
            f"must be in (0, 1], got {sampling.top_p!r}",
        )
        require(
            sampling.top_k == -1 or sampling.top_k >= 0,
            f"{key}.top_k",
            f"must be -1 (off) or >= 0, got {sampling.top_k!r}",
        )
    val = rollout.val_kwargs
    positive_int(val.n, f"{ROLLOUT}.val_kwargs.n")
    require(
        finite(val.temperature) and val.temperature >= 0,
        f"{ROLLOUT}.val_kwargs.temperature",
        f"must be >= 0, got {val.temperature!r}",
    )
    require(
        not val.do_sample or val.temperature > 0,
        f"{ROLLOUT}.val_kwargs.temperature",
        "must be > 0 when val_kwargs.do_sample is true (0 means greedy: set do_sample=false)",
    )
    require(
        rollout.prompt_length == cfg.data.max_prompt_length,
        f"{ROLLOUT}.prompt_length",
        f"must equal data.max_prompt_length ({cfg.data.max_prompt_length}), got {rollout.prompt_length}",
    )
    require(
        rollout.response_length == cfg.data.max_response_length,
        f"{ROLLOUT}.response_length",
        f"must equal data.max_response_length ({cfg.data.max_response_length}), got {rollout.response_length}",
    )
    _check_multi_turn(cfg)
    check_vllm_rollout(cfg)


TOOL_FORMATS = ("hermes", "simple")
TRUNCATE_SIDES = ("left", "right", "middle")


def check_verifiers_keys(mt: MultiTurnConfig, key: str) -> None:
    """With ``verifiers_env`` the environment runs its own episodes: the tool and turn keys are not read."""
    if not mt.verifiers_env:
        return
    for name in ("function_tool_path", "tool_config_path", "environment_factory"):
        require(
            not getattr(mt, name),
            f"{key}.{name}",
            f"is not read with {key}.verifiers_env (the environment brings its own tools)",
        )
    for name in ("max_assistant_turns", "max_user_turns"):
        require(
            getattr(mt, name) is None,
            f"{key}.{name}",
            f"is not read with {key}.verifiers_env (the environment's own max_turns decides)",
        )
    require(
        mt.verifiers_env_args is None or isinstance(mt.verifiers_env_args, dict),
        f"{key}.verifiers_env_args",
        f"must be a mapping of load_environment's keyword arguments, got {mt.verifiers_env_args!r}",
    )


def _check_multi_turn(cfg: TrainConfig) -> None:
    """``rollout.multi_turn.*`` and ``rollout.agent.num_workers``; the tools themselves are loaded (and
    checked) with the data, before any model."""
    mt, key = cfg.actor_rollout_ref.rollout.multi_turn, f"{ROLLOUT}.multi_turn"
    positive_int(cfg.actor_rollout_ref.rollout.agent.num_workers, f"{ROLLOUT}.agent.num_workers")
    if not mt.enable:  # nothing of multi_turn is read: a setting would be silently ignored
        for f in fields(MultiTurnConfig):
            value, default = getattr(mt, f.name), getattr(MultiTurnConfig(), f.name)
            require(
                value == default,
                f"{key}.{f.name}",
                f"{value!r} is only read with {key}.enable=true (default {default!r})",
            )
        return
    optional_positive_int(mt.max_assistant_turns, f"{key}.max_assistant_turns")
    optional_positive_int(mt.max_user_turns, f"{key}.max_user_turns")
    positive_int(mt.max_parallel_calls, f"{key}.max_parallel_calls")
    positive_int(mt.max_tool_response_length, f"{key}.max_tool_response_length")
    one_of(mt.tool_response_truncate_side, TRUNCATE_SIDES, f"{key}.tool_response_truncate_side")
    one_of(mt.format, TOOL_FORMATS, f"{key}.format", later=("gpt-oss",))
    require(
        mt.function_tool_path or mt.tool_config_path or mt.environment_factory or mt.verifiers_env,
        f"{key}.enable",
        f"multi-turn episodes need a tool: set {key}.function_tool_path, {key}.tool_config_path, "
        f"{key}.environment_factory or {key}.verifiers_env",
    )
    check_verifiers_keys(mt, key)
    require(
        mt.tool_timeout is None or (finite(mt.tool_timeout) and mt.tool_timeout > 0),
        f"{key}.tool_timeout",
        f"must be null or a number of seconds > 0, got {mt.tool_timeout!r}",
    )


def check_critic(cfg: TrainConfig) -> None:
    """The critic's keys, when it is on (as verl checks them only then)."""
    critic = cfg.critic
    estimator = cfg.algorithm.adv_estimator
    if estimator in CRITIC_ESTIMATORS:
        require(
            critic_enabled(cfg),
            "critic.enable",
            f"algorithm.adv_estimator={estimator} reads a critic's values; set critic.enable=true (or null)",
        )
    require(
        is_int(cfg.trainer.critic_warmup) and cfg.trainer.critic_warmup >= 0,
        "trainer.critic_warmup",
        f"must be an integer >= 0, got {cfg.trainer.critic_warmup!r}",
    )
    if not critic_enabled(cfg):
        return
    one_of(critic.strategy, tuple(STRATEGIES), "critic.strategy", later=("megatron",), later_reason="not supported")
    one_of(
        critic.fsdp.model_dtype,
        ("fp32", "bf16", "fp64"),
        "critic.fsdp.model_dtype",
        later=("fp16", "float16"),
        later_reason="not supported (fp16 needs loss scaling)",
    )
    require(
        bool(critic.model.path),
        "critic.model.path",
        "the critic needs a model: a local Hugging Face directory (default: actor_rollout_ref.model.path)",
    )
    positive_int(critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size")
    require(
        cfg.data.train_batch_size % critic.ppo_mini_batch_size == 0,
        "critic.ppo_mini_batch_size",
        f"must divide data.train_batch_size ({cfg.data.train_batch_size}) into whole minibatches, "
        f"got {critic.ppo_mini_batch_size}",
    )
    for name in ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"):
        optional_positive_int(getattr(critic, name), f"critic.{name}")
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    for name in ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"):
        budget = getattr(critic, name)
        positive_int(budget, f"critic.{name}")
        if critic.use_dynamic_bsz:
            require(
                budget >= sequence,
                f"critic.{name}",
                f"must hold one whole sequence (data.max_prompt_length + "
                f"data.max_response_length = {sequence}), got {budget}",
            )
    positive_int(critic.ppo_epochs, "critic.ppo_epochs")
    require(
        finite(critic.cliprange_value) and critic.cliprange_value > 0,
        "critic.cliprange_value",
        f"must be a number > 0, got {critic.cliprange_value!r}",
    )
    require(
        finite(critic.grad_clip) and critic.grad_clip > 0, "critic.grad_clip", f"must be > 0, got {critic.grad_clip!r}"
    )
    check_optim(critic.optim, "critic.optim")
    to_critic_update_config(cfg)  # every critic update field, named (loss_agg_mode, loss_scale_factor, ...)
