"""Checks of a resolved `TrainConfig`; every error names its dotted key.

``normalize`` settles verl's alternative spellings in place; ``check_config`` checks every value before any
model is loaded (the components' settings it derives on the way are ``config.derive``'s; the actor's,
rollout's and critic's checks are ``config.check_models``', written with ``config.check_rules``). Two rules
where verl has two names for one thing:

- gradient clipping: ``actor.grad_clip`` (verl's actor) and ``actor.optim.clip_grad`` (verl's engine)
  are one threshold. A value that differs from the default 1.0 wins; both set to different non-default
  values is an error. After ``normalize`` both keys hold the threshold (same for the critic).
- ``optim.warmup_style`` (verl's older name), when set, becomes ``optim.lr_scheduler_type``.
"""

from __future__ import annotations

import os

from ...loss_config import KL_TYPES, ConfigError
from .check_models import check_actor, check_critic, check_rollout
from .check_rules import fail, finite, is_int, one_of, optional_positive_int, positive_int, require
from .derive import ACTOR, ARR, ROLLOUT, reward_manager_of
from .derive import critic_enabled as critic_enabled  # importers take it from here
from .mixed_precision import actor_precision, critic_precision
from .prefix_grouper import check_prefix_grouper
from .schema import OptimConfig, TrainConfig

# verl's estimator names (splitproof.advantages implements them; gae also needs a critic)
KNOWN_ESTIMATORS = (
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_passk",
    "gae",
)
# estimators that compare the n responses of one prompt: with n = 1 they are degenerate
GROUP_ESTIMATORS = ("grpo", "rloo", "opo", "grpo_passk", "gpg", "reinforce_plus_plus_baseline")

DTYPES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp64": "fp64", "float64": "fp64"}
LOGGERS = ("console", "file", "tensorboard", "wandb")
VERL_LOGGERS = ("mlflow", "swanlab", "vemlp_wandb", "clearml", "trackio")
RESUME_MODES = ("auto", "disable", "resume_path")
TRUNCATIONS = ("error", "left", "right", "middle")
KL_CONTROLLERS = ("fixed", "adaptive")
ROLLOUT_IS = (None, "token", "sequence")


# ---------------------------------------------------------------------------------------------- normalize


def _combine_grad_clip(owner, optim: OptimConfig, key: str) -> None:
    default = 1.0
    a, b = owner.grad_clip, optim.clip_grad
    if a != b and a != default and b != default:
        fail(f"{key}.grad_clip", f"{a!r} disagrees with {key}.optim.clip_grad {b!r}; set one of them")
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
    data.train_files = (
        [_expand(p) for p in data.train_files] if isinstance(data.train_files, list) else _expand(data.train_files)
    )
    data.val_files = (
        [_expand(p) for p in data.val_files] if isinstance(data.val_files, list) else _expand(data.val_files)
    )
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


def _check_files(value, key: str, required: bool) -> None:
    items = value if isinstance(value, list) else ([] if value is None else [value])
    if required:
        require(len(items) >= 1, key, "needs at least one file (or a builtin:// task)")
    require(all(isinstance(p, str) and p for p in items), key, f"must be a path or a list of paths, got {value!r}")


def _check_data(cfg: TrainConfig) -> None:
    data = cfg.data
    _check_files(data.train_files, "data.train_files", required=True)
    _check_files(data.val_files, "data.val_files", required=False)
    require(bool(data.prompt_key), "data.prompt_key", "must not be empty")
    require(bool(data.reward_fn_key), "data.reward_fn_key", "must not be empty")
    for name in ("max_prompt_length", "max_response_length", "train_batch_size"):
        positive_int(getattr(data, name), f"data.{name}")
    optional_positive_int(data.val_batch_size, "data.val_batch_size")
    _check_gen_batch_size(cfg)
    one_of(data.truncation, TRUNCATIONS, "data.truncation")
    for name in ("train_max_samples", "val_max_samples"):
        value = getattr(data, name)
        require(value == -1 or value >= 1, f"data.{name}", f"must be -1 (all) or >= 1, got {value!r}")


def _check_gen_batch_size(cfg: TrainConfig) -> None:
    data, key = cfg.data, "data.gen_batch_size"
    size = data.gen_batch_size
    if not cfg.algorithm.filter_groups.enable:
        require(
            size is None or size == data.train_batch_size,
            key,
            f"must be null or equal data.train_batch_size ({data.train_batch_size}) without "
            f"algorithm.filter_groups.enable (it sizes dynamic sampling's generation rounds), got {size!r}",
        )
        return
    optional_positive_int(size, key)
    require(
        size is None or size >= data.train_batch_size,
        key,
        f"{size} is smaller than data.train_batch_size ({data.train_batch_size}): a generation round must be "
        "able to fill a step",
    )


def _check_filter_groups(cfg: TrainConfig) -> None:
    fg, key = cfg.algorithm.filter_groups, "algorithm.filter_groups"
    require(
        isinstance(fg.metric, str) and bool(fg.metric), f"{key}.metric", f"must be a metric name, got {fg.metric!r}"
    )
    require(
        is_int(fg.max_num_gen_batches),
        f"{key}.max_num_gen_batches",
        f"must be an integer (<= 0: no bound), got {fg.max_num_gen_batches!r}",
    )
    if fg.enable and fg.metric == "seq_final_reward":
        require(
            not cfg.algorithm.use_kl_in_reward,
            f"{key}.metric",
            "seq_final_reward with algorithm.use_kl_in_reward=true is not supported (it would need the KL "
            "of every generation round); use reward or seq_reward",
        )


def _check_algorithm(cfg: TrainConfig) -> None:
    algo = cfg.algorithm
    estimator = algo.adv_estimator
    one_of(estimator, KNOWN_ESTIMATORS, "algorithm.adv_estimator")
    n = cfg.actor_rollout_ref.rollout.n
    if estimator in GROUP_ESTIMATORS:
        require(
            n >= 2,
            f"{ROLLOUT}.n",
            f"algorithm.adv_estimator={estimator} compares the n responses of a prompt and needs n >= 2, got {n}",
        )
    for name in ("gamma", "lam"):
        value = getattr(algo, name)
        require(finite(value) and 0 <= value <= 1, f"algorithm.{name}", f"must be in [0, 1], got {value!r}")
    one_of(algo.kl_penalty, KL_TYPES, "algorithm.kl_penalty", later=("full",), later_reason="not supported")
    ctrl = algo.kl_ctrl
    one_of(ctrl.type, KL_CONTROLLERS, "algorithm.kl_ctrl.type")
    require(
        finite(ctrl.kl_coef) and ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {ctrl.kl_coef!r}"
    )
    positive_int(ctrl.horizon, "algorithm.kl_ctrl.horizon")
    require(
        finite(ctrl.target_kl) and ctrl.target_kl > 0,
        "algorithm.kl_ctrl.target_kl",
        f"must be > 0, got {ctrl.target_kl!r}",
    )
    _check_rollout_correction(cfg)
    _check_filter_groups(cfg)


def _check_rollout_correction(cfg: TrainConfig) -> None:
    corr, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction"
    one_of(corr.rollout_is, ROLLOUT_IS, f"{key}.rollout_is")
    require(
        finite(corr.rollout_is_threshold) and corr.rollout_is_threshold > 0,
        f"{key}.rollout_is_threshold",
        f"must be a finite number > 0, got {corr.rollout_is_threshold!r}",
    )
    for name in ("bypass_mode", "rollout_is"):
        value = getattr(corr, name)
        require(
            cfg.actor_rollout_ref.rollout.calculate_log_probs or value in (False, None),
            f"{ROLLOUT}.calculate_log_probs",
            f"must be true with {key}.{name}={str(value).lower()}: it needs the rollout's log-probs",
        )
    require(
        not (corr.bypass_mode and corr.rollout_is is not None),
        f"{key}.rollout_is",
        f"must be null with {key}.bypass_mode=true: the old log-probs are then the rollout's, so the "
        f"weights exp(old - rollout) would all be 1 (verl's ppo_clip bypass loss does not apply them either)",
    )


def _check_trainer(cfg: TrainConfig) -> None:
    trainer = cfg.trainer
    positive_int(trainer.total_epochs, "trainer.total_epochs")
    optional_positive_int(trainer.total_training_steps, "trainer.total_training_steps")
    for name in trainer.logger:
        one_of(name, LOGGERS, "trainer.logger", later=VERL_LOGGERS, later_reason="not supported")
    require(
        len(set(trainer.logger)) == len(trainer.logger), "trainer.logger", f"lists a logger twice: {trainer.logger}"
    )
    one_of(trainer.resume_mode, RESUME_MODES, "trainer.resume_mode")
    if trainer.resume_mode == "resume_path":
        require(
            bool(trainer.resume_from_path),
            "trainer.resume_from_path",
            "must name a checkpoint (global_step_N) when trainer.resume_mode=resume_path",
        )
    else:
        require(
            trainer.resume_from_path is None,
            "trainer.resume_from_path",
            f"is read only with trainer.resume_mode=resume_path (it is {trainer.resume_mode!r})",
        )
    require(bool(trainer.default_local_dir), "trainer.default_local_dir", "must not be empty")
    optional_positive_int(trainer.max_actor_ckpt_to_keep, "trainer.max_actor_ckpt_to_keep")
    optional_positive_int(trainer.cpu_threads, "trainer.cpu_threads")
    _check_device(cfg)


def _check_device(cfg: TrainConfig) -> None:
    """``trainer.device`` names a device this process has (``cuda``: GPU ``LOCAL_RANK``), and it computes in
    the models' dtypes (``devices.resolve_device``, ``devices.check_dtype``); the compute dtypes resolve
    (``mixed_precision.resolve``: its errors on every device)."""
    compute = [(actor_precision(cfg), f"{ACTOR}.fsdp_config")]
    if critic_enabled(cfg):
        compute.append((critic_precision(cfg), "critic.fsdp"))
    if cfg.trainer.device == "cpu":  # nothing to check, and no torch to import (a finished run's rerun needs none)
        return
    from ...devices import check_dtype, this_process_device
    from ..models.policy import MODEL_DTYPES

    device = this_process_device(cfg.trainer.device)
    check_dtype(
        device, MODEL_DTYPES[cfg.actor_rollout_ref.actor.fsdp_config.model_dtype], f"{ACTOR}.fsdp_config.model_dtype"
    )
    if critic_enabled(cfg):
        check_dtype(device, MODEL_DTYPES[cfg.critic.fsdp.model_dtype], "critic.fsdp.model_dtype")
    for precision, prefix in compute:
        check_dtype(device, MODEL_DTYPES[precision.compute], f"{prefix}.dtype")


def _check_reward(cfg: TrainConfig) -> None:
    top, nested = cfg.custom_reward_function, cfg.reward.custom_reward_function
    same = (top.path, top.name or "compute_score") == (nested.path, nested.name or "compute_score")
    if top.path is not None and nested.path is not None and not same:
        fail(
            "reward.custom_reward_function.path",
            f"names {nested.path!r} while custom_reward_function.path names {top.path!r}; set one place",
        )
    require(
        top.name is None or top.path is not None,
        "custom_reward_function.name",
        "needs custom_reward_function.path (the file or module that defines it)",
    )
    for key, place in (("custom_reward_function", top), ("reward.custom_reward_function", nested)):
        require(
            not place.reward_kwargs or place.path is not None,
            f"{key}.reward_kwargs",
            f"needs {key}.path: reward_kwargs are passed to the function named there",
        )
    if top.path is not None and nested.reward_kwargs and nested.reward_kwargs != top.reward_kwargs:
        fail(
            "reward.custom_reward_function.reward_kwargs",
            "is set while custom_reward_function names the function; set reward_kwargs there",
        )
    reward_manager_of(cfg)


def _check_async(cfg: TrainConfig) -> None:
    key, k = "async_training.staleness_steps", cfg.async_training.staleness_steps
    require(is_int(k) and k >= 0, key, f"must be an integer >= 0 (0: synchronous), got {k!r}")
    if k > 0:  # remax's greedy baseline is generated in the training process, by the current policy
        require(
            cfg.algorithm.adv_estimator != "remax",
            key,
            f"= {k} cannot be combined with algorithm.adv_estimator=remax: its greedy baseline would be "
            "generated by another policy than the samples it baselines; use 0",
        )
        require(
            not cfg.actor_rollout_ref.rollout.multi_turn.enable,
            key,
            f"= {k} cannot be combined with {ARR}.rollout.multi_turn.enable=true yet: the rollout process "
            "generates single-turn samples; use 0",
        )
        require(
            not cfg.algorithm.filter_groups.enable,
            key,
            f"= {k} cannot be combined with algorithm.filter_groups.enable: dynamic sampling decides its "
            "next generation round from the current round's rewards; use 0",
        )


CHECKS = (
    _check_data,
    check_actor,
    check_prefix_grouper,
    check_rollout,
    _check_algorithm,
    check_critic,
    _check_trainer,
    _check_reward,
    _check_async,
)


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
