"""Checks of a resolved `TrainConfig`; every error names its dotted key.

``normalize`` settles verl's alternative spellings in place; ``check_config`` checks every value before any
model is loaded (the components' settings it derives on the way are ``config.derive``'s). Two rules where
verl has two names for one thing:

- gradient clipping: ``actor.grad_clip`` (verl's actor) and ``actor.optim.clip_grad`` (verl's engine)
  are one threshold. A value that differs from the default 1.0 wins; both set to different non-default
  values is an error. After ``normalize`` both keys hold the threshold (same for the critic).
- ``optim.warmup_style`` (verl's older name), when set, becomes ``optim.lr_scheduler_type``.
"""

from __future__ import annotations

import math
import os
from dataclasses import fields

from ...loss_config import KL_TYPES, ConfigError
from .derive import (ACTOR, ARR, CRITIC_ESTIMATORS, ROLLOUT, STRATEGIES, critic_enabled, lora_settings,
                     reward_manager_of, to_critic_update_config, to_update_config)
from .schema import MultiTurnConfig, OptimConfig, TrainConfig

# verl's estimator names (splitproof.advantages implements them; gae also needs a critic)
KNOWN_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "opo",
                    "gpg", "grpo_passk", "gae")
# estimators that compare the n responses of one prompt: with n = 1 they are degenerate
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus_baseline")

DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp64": "fp64", "float64": "fp64"}
ROLLOUT_NAMES = ("hf",)
LATER_ROLLOUTS = ("vllm", "sglang", "trtllm")
LOGGERS = ("console", "file", "tensorboard", "wandb")
VERL_LOGGERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")
RESUME_MODES = ("auto", "disable", "resume_path")
TRUNCATIONS = ("error", "left", "right", "middle")
OPTIMIZERS = ("AdamW", "SGD")
LR_SCHEDULERS = ("constant", "cosine")
KL_CONTROLLERS = ("fixed", "adaptive")
ROLLOUT_IS = (None, "token", "sequence")


def _fail(key: str, message: str):
    raise ConfigError(key, message)


def _require(cond: bool, key: str, message: str) -> None:
    if not cond:
        _fail(key, message)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _positive_int(value, key: str) -> None:
    _require(_is_int(value) and value >= 1, key, f"must be an integer >= 1, got {value!r}")


def _optional_positive_int(value, key: str) -> None:
    _require(value is None or (_is_int(value) and value >= 1), key, f"must be null or an integer >= 1, got {value!r}")


def _one_of(value, choices, key: str, later=(), later_reason="not supported yet") -> None:
    if value in later:
        _fail(key, f"{value!r} is {later_reason}; expected one of {', '.join(map(str, choices))}")
    _require(value in choices, key, f"unknown {value!r}; expected one of {', '.join(map(str, choices))}")


# ---------------------------------------------------------------------------------------------- normalize

def _combine_grad_clip(owner, optim: OptimConfig, key: str) -> None:
    default = 1.0
    a, b = owner.grad_clip, optim.clip_grad
    if a != b and a != default and b != default:
        _fail(f"{key}.grad_clip", f"{a!r} disagrees with {key}.optim.clip_grad {b!r}; set one of them")
    owner.grad_clip = optim.clip_grad = a if a != default else b


def _expand(path):
    if isinstance(path, str) and "://" not in path:
        return os.path.expanduser(path)
    return path


def normalize(cfg: TrainConfig) -> TrainConfig:
    """verl's alternative spellings made canonical, in place (and returned)."""
    actor = cfg.actor_rollout_ref.actor
    for owner in (actor.fsdp_config, cfg.critic.fsdp):
        owner.model_dtype = DTYPES.get(owner.model_dtype, owner.model_dtype)
    for optim in (actor.optim, cfg.critic.optim):
        if optim.warmup_style is not None:
            optim.lr_scheduler_type, optim.warmup_style = optim.warmup_style, None
    _combine_grad_clip(actor, actor.optim, ACTOR)
    _combine_grad_clip(cfg.critic, cfg.critic.optim, "critic")
    if isinstance(cfg.trainer.logger, str):
        cfg.trainer.logger = [cfg.trainer.logger]
    data = cfg.data
    data.train_files = [_expand(p) for p in data.train_files] if isinstance(data.train_files, list) else _expand(data.train_files)
    data.val_files = [_expand(p) for p in data.val_files] if isinstance(data.val_files, list) else _expand(data.val_files)
    model = cfg.actor_rollout_ref.model
    model.path, model.tokenizer_path = _expand(model.path), _expand(model.tokenizer_path)
    cfg.critic.model.path = _expand(cfg.critic.model.path)
    cfg.trainer.default_local_dir = _expand(cfg.trainer.default_local_dir)
    cfg.trainer.resume_from_path = _expand(cfg.trainer.resume_from_path)
    cfg.trainer.rollout_data_dir = _expand(cfg.trainer.rollout_data_dir)
    cfg.trainer.validation_data_dir = _expand(cfg.trainer.validation_data_dir)
    for reward in (cfg.custom_reward_function, cfg.reward.custom_reward_function):
        reward.path = _expand(reward.path)
    return cfg


# ---------------------------------------------------------------------------------------------- validate

def _check_optim(optim: OptimConfig, key: str) -> None:
    _one_of(optim.optimizer, OPTIMIZERS, f"{key}.optimizer")
    _require(_finite(optim.lr) and optim.lr > 0, f"{key}.lr", f"must be a number > 0, got {optim.lr!r}")
    betas = optim.betas
    _require(len(betas) == 2 and all(_finite(b) and 0 <= b < 1 for b in betas), f"{key}.betas",
             f"must be two numbers in [0, 1), got {betas!r}")
    _require(_finite(optim.weight_decay) and optim.weight_decay >= 0, f"{key}.weight_decay",
             f"must be >= 0, got {optim.weight_decay!r}")
    _require(optim.lr_warmup_steps >= -1, f"{key}.lr_warmup_steps", f"must be -1 or >= 0, got {optim.lr_warmup_steps!r}")
    _require(0 <= optim.lr_warmup_steps_ratio <= 1, f"{key}.lr_warmup_steps_ratio",
             f"must be in [0, 1], got {optim.lr_warmup_steps_ratio!r}")
    _one_of(optim.lr_scheduler_type, LR_SCHEDULERS, f"{key}.lr_scheduler_type")
    _require(0 <= optim.min_lr_ratio <= 1, f"{key}.min_lr_ratio", f"must be in [0, 1], got {optim.min_lr_ratio!r}")
    _require(_finite(optim.num_cycles) and optim.num_cycles >= 0, f"{key}.num_cycles",
             f"must be >= 0, got {optim.num_cycles!r}")
    _require(optim.total_training_steps == -1 or optim.total_training_steps >= 1, f"{key}.total_training_steps",
             f"must be -1 (the trainer's) or >= 1, got {optim.total_training_steps!r}")
    _require(_finite(optim.clip_grad) and optim.clip_grad > 0, f"{key}.clip_grad", f"must be > 0, got {optim.clip_grad!r}")


def _check_files(value, key: str, required: bool) -> None:
    items = value if isinstance(value, list) else ([] if value is None else [value])
    if required:
        _require(len(items) >= 1, key, "needs at least one file (or a builtin:// task)")
    _require(all(isinstance(p, str) and p for p in items), key, f"must be a path or a list of paths, got {value!r}")


def _check_data(cfg: TrainConfig) -> None:
    data = cfg.data
    _check_files(data.train_files, "data.train_files", required=True)
    _check_files(data.val_files, "data.val_files", required=False)
    _require(bool(data.prompt_key), "data.prompt_key", "must not be empty")
    _require(bool(data.reward_fn_key), "data.reward_fn_key", "must not be empty")
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        _positive_int(getattr(data, name), f"data.{name}")
    _optional_positive_int(data.val_batch_size, "data.val_batch_size")
    _check_gen_batch_size(cfg)
    _one_of(data.truncation, TRUNCATIONS, "data.truncation")
    for name in ("train_max_samples", "val_max_samples"):
        value = getattr(data, name)
        _require(value == -1 or value >= 1, f"data.{name}", f"must be -1 (all) or >= 1, got {value!r}")


def _check_gen_batch_size(cfg: TrainConfig) -> None:
    data, key = cfg.data, "data.gen_batch_size"
    size = data.gen_batch_size
    if not cfg.algorithm.filter_groups.enable:
        _require(size is None or size == data.train_batch_size, key,
                 f"must be null or equal data.train_batch_size ({data.train_batch_size}) without "
                 f"algorithm.filter_groups.enable (it sizes dynamic sampling's generation rounds), got {size!r}")
        return
    _optional_positive_int(size, key)
    _require(size is None or size >= data.train_batch_size, key,
             f"{size} is smaller than data.train_batch_size ({data.train_batch_size}): a generation round must be "
             "able to fill a step")


def _check_filter_groups(cfg: TrainConfig) -> None:
    fg, key = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    _require(isinstance(fg.metric, str) and bool(fg.metric), f"{key}.metric", f"must be a metric name, got {fg.metric!r}")
    _require(_is_int(fg.max_num_gen_batches), f"{key}.max_num_gen_batches",
             f"must be an integer (<= 0: no bound), got {fg.max_num_gen_batches!r}")
    if fg.enable and fg.metric == "seq_final_reward":
        _require(not cfg.algorithm.use_kl_in_reward, f"{key}.metric",
                 "seq_final_reward with algorithm.use_kl_in_reward=true is not supported (it would need the KL "
                 "of every generation round); use reward or seq_reward")


def _check_actor(cfg: TrainConfig) -> None:
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    _require(bool(arr.model.path), f"{ARR}.model.path", "must not be empty")
    _one_of(actor.strategy, tuple(STRATEGIES), f"{ACTOR}.strategy", later=("megatron",), later_reason="not supported")
    dtype = actor.fsdp_config.model_dtype
    _one_of(dtype, ("fp32", "bf16", "fp64"), f"{ACTOR}.fsdp_config.model_dtype", later=("fp16", "float16"),
            later_reason="not supported (fp16 needs loss scaling)")
    _positive_int(actor.ppo_mini_batch_size, f"{ACTOR}.ppo_mini_batch_size")
    _require(cfg.data.train_batch_size % actor.ppo_mini_batch_size == 0, f"{ACTOR}.ppo_mini_batch_size",
             f"must divide data.train_batch_size ({cfg.data.train_batch_size}) into whole minibatches, "
             f"got {actor.ppo_mini_batch_size}")
    _optional_positive_int(actor.ppo_micro_batch_size_per_gpu, f"{ACTOR}.ppo_micro_batch_size_per_gpu")
    for section, owner in ((ROLLOUT, arr.rollout), (f"{ARR}.ref", arr.ref)):
        _optional_positive_int(owner.log_prob_micro_batch_size_per_gpu, f"{section}.log_prob_micro_batch_size_per_gpu")
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    budgets = [(f"{ACTOR}.ppo_max_token_len_per_gpu", actor.ppo_max_token_len_per_gpu, actor.use_dynamic_bsz)]
    for section, owner in ((ROLLOUT, arr.rollout), (f"{ARR}.ref", arr.ref)):
        budgets.append((f"{section}.log_prob_max_token_len_per_gpu", owner.log_prob_max_token_len_per_gpu,
                        owner.log_prob_use_dynamic_bsz))
    for key, budget, dynamic in budgets:
        _positive_int(budget, key)
        if dynamic:
            _require(budget >= sequence, key, f"must hold one whole sequence (data.max_prompt_length + "
                                              f"data.max_response_length = {sequence}), got {budget}")
    _positive_int(actor.ppo_epochs, f"{ACTOR}.ppo_epochs")
    _positive_int(arr.nccl_timeout, f"{ARR}.nccl_timeout")
    _check_optim(actor.optim, f"{ACTOR}.optim")
    lora_settings(cfg)
    to_update_config(cfg)  # every loss and update field, named


def _check_rollout(cfg: TrainConfig) -> None:
    rollout = cfg.actor_rollout_ref.rollout
    _one_of(rollout.name, ROLLOUT_NAMES, f"{ROLLOUT}.name", later=LATER_ROLLOUTS)
    _positive_int(rollout.n, f"{ROLLOUT}.n")
    _positive_int(rollout.max_num_seqs, f"{ROLLOUT}.max_num_seqs")
    _require(_finite(rollout.temperature) and rollout.temperature > 0, f"{ROLLOUT}.temperature",
             f"must be > 0, got {rollout.temperature!r}")
    for key, sampling in ((ROLLOUT, rollout), (f"{ROLLOUT}.val_kwargs", rollout.val_kwargs)):
        _require(_finite(sampling.top_p) and 0 < sampling.top_p <= 1, f"{key}.top_p",
                 f"must be in (0, 1], got {sampling.top_p!r}")
        _require(sampling.top_k == -1 or sampling.top_k >= 0, f"{key}.top_k",
                 f"must be -1 (off) or >= 0, got {sampling.top_k!r}")
    val = rollout.val_kwargs
    _positive_int(val.n, f"{ROLLOUT}.val_kwargs.n")
    _require(_finite(val.temperature) and val.temperature >= 0, f"{ROLLOUT}.val_kwargs.temperature",
             f"must be >= 0, got {val.temperature!r}")
    _require(not val.do_sample or val.temperature > 0, f"{ROLLOUT}.val_kwargs.temperature",
             "must be > 0 when val_kwargs.do_sample is true (0 means greedy: set do_sample=false)")
    _require(rollout.prompt_length == cfg.data.max_prompt_length, f"{ROLLOUT}.prompt_length",
             f"must equal data.max_prompt_length ({cfg.data.max_prompt_length}), got {rollout.prompt_length}")
    _require(rollout.response_length == cfg.data.max_response_length, f"{ROLLOUT}.response_length",
             f"must equal data.max_response_length ({cfg.data.max_response_length}), got {rollout.response_length}")
    _check_multi_turn(cfg)


TOOL_FORMATS = ("hermes", "simple")
TRUNCATE_SIDES = ("left", "right", "middle")


def _check_multi_turn(cfg: TrainConfig) -> None:
    """``rollout.multi_turn.*`` and ``rollout.agent.num_workers``; the tools themselves are loaded (and
    checked) with the data, before any model."""
    mt, key = cfg.actor_rollout_ref.rollout.multi_turn, f"{ROLLOUT}.multi_turn"
    _positive_int(cfg.actor_rollout_ref.rollout.agent.num_workers, f"{ROLLOUT}.agent.num_workers")
    if not mt.enable:  # nothing of multi_turn is read: a setting would be silently ignored
        for f in fields(MultiTurnConfig):
            value, default = getattr(mt, f.name), getattr(MultiTurnConfig(), f.name)
            _require(value == default, f"{key}.{f.name}",
                     f"{value!r} is only read with {key}.enable=true (default {default!r})")
        return
    _optional_positive_int(mt.max_assistant_turns, f"{key}.max_assistant_turns")
    _optional_positive_int(mt.max_user_turns, f"{key}.max_user_turns")
    _positive_int(mt.max_parallel_calls, f"{key}.max_parallel_calls")
    _positive_int(mt.max_tool_response_length, f"{key}.max_tool_response_length")
    _one_of(mt.tool_response_truncate_side, TRUNCATE_SIDES, f"{key}.tool_response_truncate_side")
    _one_of(mt.format, TOOL_FORMATS, f"{key}.format", later=("gpt-oss",))
    _require(mt.function_tool_path or mt.tool_config_path, f"{key}.enable",
             f"multi-turn episodes need a tool: set {key}.function_tool_path or {key}.tool_config_path")
    _require(mt.tool_timeout is None or (_finite(mt.tool_timeout) and mt.tool_timeout > 0), f"{key}.tool_timeout",
             f"must be null or a number of seconds > 0, got {mt.tool_timeout!r}")


def _check_algorithm(cfg: TrainConfig) -> None:
    algo = cfg.algorithm
    estimator = algo.adv_estimator
    _one_of(estimator, KNOWN_ESTIMATORS, "algorithm.adv_estimator")
    n = cfg.actor_rollout_ref.rollout.n
    if estimator in GROUP_ESTIMATORS:
        _require(n >= 2, f"{ROLLOUT}.n", f"algorithm.adv_estimator={estimator} compares the n responses of a prompt "
                                         f"and needs n >= 2, got {n}")
    for name in ("gamma", "lam"):
        value = getattr(algo, name)
        _require(_finite(value) and 0 <= value <= 1, f"algorithm.{name}", f"must be in [0, 1], got {value!r}")
    _one_of(algo.kl_penalty, KL_TYPES, "algorithm.kl_penalty", later=("full",), later_reason="not supported")
    ctrl = algo.kl_ctrl
    _one_of(ctrl.type, KL_CONTROLLERS, "algorithm.kl_ctrl.type")
    _require(_finite(ctrl.kl_coef) and ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {ctrl.kl_coef!r}")
    _positive_int(ctrl.horizon, "algorithm.kl_ctrl.horizon")
    _require(_finite(ctrl.target_kl) and ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl",
             f"must be > 0, got {ctrl.target_kl!r}")
    _check_rollout_correction(cfg)
    _check_filter_groups(cfg)


def _check_critic(cfg: TrainConfig) -> None:
    """The critic's keys, when it is on (as verl checks them only then)."""
    critic = cfg.critic
    estimator = cfg.algorithm.adv_estimator
    if estimator in CRITIC_ESTIMATORS:
        _require(critic_enabled(cfg), "critic.enable",
                 f"algorithm.adv_estimator={estimator} reads a critic's values; set critic.enable=true (or null)")
    _require(_is_int(cfg.trainer.critic_warmup) and cfg.trainer.critic_warmup >= 0, "trainer.critic_warmup",
             f"must be an integer >= 0, got {cfg.trainer.critic_warmup!r}")
    if not critic_enabled(cfg):
        return
    _one_of(critic.strategy, tuple(STRATEGIES), "critic.strategy", later=("megatron",), later_reason="not supported")
    _one_of(critic.fsdp.model_dtype, ("fp32", "bf16", "fp64"), "critic.fsdp.model_dtype", later=("fp16", "float16"),
            later_reason="not supported (fp16 needs loss scaling)")
    _require(bool(critic.model.path), "critic.model.path",
             "the critic needs a model: a local Hugging Face directory (default: actor_rollout_ref.model.path)")
    _positive_int(critic.ppo_mini_batch_size, "critic.ppo_mini_batch_size")
    _require(cfg.data.train_batch_size % critic.ppo_mini_batch_size == 0, "critic.ppo_mini_batch_size",
             f"must divide data.train_batch_size ({cfg.data.train_batch_size}) into whole minibatches, "
             f"got {critic.ppo_mini_batch_size}")
    for name in ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"):
        _optional_positive_int(getattr(critic, name), f"critic.{name}")
    sequence = cfg.data.max_prompt_length + cfg.data.max_response_length
    for name in ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"):
        budget = getattr(critic, name)
        _positive_int(budget, f"critic.{name}")
        if critic.use_dynamic_bsz:
            _require(budget >= sequence, f"critic.{name}", f"must hold one whole sequence (data.max_prompt_length + "
                                                           f"data.max_response_length = {sequence}), got {budget}")
    _positive_int(critic.ppo_epochs, "critic.ppo_epochs")
    _require(_finite(critic.cliprange_value) and critic.cliprange_value > 0, "critic.cliprange_value",
             f"must be a number > 0, got {critic.cliprange_value!r}")
    _require(_finite(critic.grad_clip) and critic.grad_clip > 0, "critic.grad_clip",
             f"must be > 0, got {critic.grad_clip!r}")
    _check_optim(critic.optim, "critic.optim")
    to_critic_update_config(cfg)  # every critic update field, named (loss_agg_mode, loss_scale_factor, ...)


def _check_rollout_correction(cfg: TrainConfig) -> None:
    corr, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    _one_of(corr.rollout_is, ROLLOUT_IS, f"{key}.rollout_is")
    _require(_finite(corr.rollout_is_threshold) and corr.rollout_is_threshold > 0, f"{key}.rollout_is_threshold",
             f"must be a finite number > 0, got {corr.rollout_is_threshold!r}")
    for name in ("bypass_mode", "rollout_is"):
        value = getattr(corr, name)
        _require(cfg.actor_rollout_ref.rollout.calculate_log_probs or value in (False, None),
                 f"{ROLLOUT}.calculate_log_probs",
                 f"must be true with {key}.{name}={str(value).lower()}: it needs the rollout's log-probs")
    _require(not (corr.bypass_mode and corr.rollout_is is not None), f"{key}.rollout_is",
             f"must be null with {key}.bypass_mode=true: the old log-probs are then the rollout's, so the "
             f"weights exp(old - rollout) would all be 1 (verl's ppo_clip bypass loss does not apply them either)")


def _check_trainer(cfg: TrainConfig) -> None:
    trainer = cfg.trainer
    _positive_int(trainer.total_epochs, "trainer.total_epochs")
    _optional_positive_int(trainer.total_training_steps, "trainer.total_training_steps")
    for name in trainer.logger:
        _one_of(name, LOGGERS, "trainer.logger", later=VERL_LOGGERS, later_reason="not supported")
    _require(len(set(trainer.logger)) == len(trainer.logger), "trainer.logger", f"lists a logger twice: {trainer.logger}")
    _one_of(trainer.resume_mode, RESUME_MODES, "trainer.resume_mode")
    if trainer.resume_mode == "resume_path":
        _require(bool(trainer.resume_from_path), "trainer.resume_from_path",
                 "must name a checkpoint (global_step_N) when trainer.resume_mode=resume_path")
    else:
        _require(trainer.resume_from_path is None, "trainer.resume_from_path",
                 f"is read only with trainer.resume_mode=resume_path (it is {trainer.resume_mode!r})")
    _require(bool(trainer.default_local_dir), "trainer.default_local_dir", "must not be empty")
    _optional_positive_int(trainer.max_actor_ckpt_to_keep, "trainer.max_actor_ckpt_to_keep")
    _optional_positive_int(trainer.cpu_threads, "trainer.cpu_threads")
    _check_device(trainer.device)


def _check_device(device) -> None:
    """``trainer.device``: cpu. CUDA is refused, not ignored: `splitproof train` has no GPU path yet."""
    cuda = isinstance(device, str) and (device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit()))
    _require(device == "cpu" or cuda, "trainer.device", f"must be cpu, got {device!r}")
    if cuda:
        import torch

        here = "" if torch.cuda.is_available() else "; this machine has no CUDA device either"
        _fail("trainer.device", f"{device!r} is not supported: splitproof train runs on the CPU only (the model, "
                                f"its tensors and the process group's gloo backend){here}; set trainer.device=cpu")


def _check_reward(cfg: TrainConfig) -> None:
    top, nested = cfg.custom_reward_function, cfg.reward.custom_reward_function
    same = (top.path, top.name or "compute_score") == (nested.path, nested.name or "compute_score")
    if top.path is not None and nested.path is not None and not same:
        _fail("reward.custom_reward_function.path",
              f"names {nested.path!r} while custom_reward_function.path names {top.path!r}; set one place")
    _require(top.name is None or top.path is not None, "custom_reward_function.name",
             "needs custom_reward_function.path (the file or module that defines it)")
    for key, place in (("custom_reward_function", top), ("reward.custom_reward_function", nested)):
        _require(not place.reward_kwargs or place.path is not None, f"{key}.reward_kwargs",
                 f"needs {key}.path: reward_kwargs are passed to the function named there")
    if top.path is not None and nested.reward_kwargs and nested.reward_kwargs != top.reward_kwargs:
        _fail("reward.custom_reward_function.reward_kwargs",
              "is set while custom_reward_function names the function; set reward_kwargs there")
    reward_manager_of(cfg)


def _check_async(cfg: TrainConfig) -> None:
    key, k = "async_training.staleness_steps", cfg.async_training.staleness_steps
    _require(_is_int(k) and k >= 0, key, f"must be an integer >= 0 (0: synchronous), got {k!r}")
    if k > 0:  # remax's greedy baseline is generated in the training process, by the current policy
        _require(cfg.algorithm.adv_estimator != "remax", key,
                 f"= {k} cannot be combined with algorithm.adv_estimator=remax: its greedy baseline would be "
                 "generated by another policy than the samples it baselines; use 0")
        _require(not cfg.actor_rollout_ref.rollout.multi_turn.enable, key,
                 f"= {k} cannot be combined with {ARR}.rollout.multi_turn.enable=true yet: the rollout process "
                 "generates single-turn samples; use 0")
        _require(not cfg.algorithm.filter_groups.enable, key,
                 f"= {k} cannot be combined with algorithm.filter_groups.enable: dynamic sampling decides its "
                 "next generation round from the current round's rewards; use 0")


CHECKS = (_check_data, _check_actor, _check_rollout, _check_algorithm, _check_critic, _check_trainer, _check_reward,
          _check_async)


def check_config(cfg: TrainConfig) -> None:
    """Raise ``ConfigError`` (dotted key + reason) for the first bad value; a normalized config is assumed."""
    for check in CHECKS:
        check(cfg)


def problems(cfg: TrainConfig) -> list[ConfigError]:
    """The first bad value of each part of the config (``CHECKS``), in order; a part that cannot be judged
    after an earlier bad value (it fails other than with a ``ConfigError``) ends the list."""
    found: list[ConfigError] = []
    for check in CHECKS:
        try:
            check(cfg)
        except ConfigError as e:
            found.append(e)
        except Exception:
            if not found:
                raise
            break
    return found
