"""The components' settings derived from a resolved `TrainConfig`, in one place.

``derive`` builds a component's config dataclass (the engine's ``LossConfig``, ``UpdateConfig`` and
``CriticUpdateConfig``, the rollout's ``SamplingParams`` and ``MultiTurnSettings``, ``LoraSettings``) by
copying every field of the same name from the config's sections, with the values the schema keeps under
another name or elsewhere given explicitly; a ``ConfigError`` the component raises is re-keyed to the
dotted key the value came from (``actor_rollout_ref.actor.clip_ratio_low: ...``). Beside them the
config's other derived views: which strategy wraps a model, whether the run has a critic, which reward
function and manager it scores with.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from ...engine import CriticUpdateConfig, UpdateConfig
from ...lora_settings import LoraSettings
from ...loss_config import ConfigError, LossConfig
from ..rewards.dapo import reward_manager
from .schema import TrainConfig

if TYPE_CHECKING:
    from ..rollout.episode import MultiTurnSettings
    from ..rollout.hf import SamplingParams

ARR = "actor_rollout_ref"
ACTOR = f"{ARR}.actor"
ROLLOUT = f"{ARR}.rollout"
STRATEGIES = {"fsdp": "fsdp2", "fsdp2": "fsdp2", "ddp": "ddp"}
CRITIC_ESTIMATORS = ("gae",)  # read the critic's values: need critic.enable (null turns it on for them)


def derive(
    cls, *sources: tuple[object, str], given: dict[str, tuple[object, str]] | None = None, key_prefix: str | None = None
):
    """``cls(...)`` with each field from the first of ``sources`` — (a schema section, its dotted prefix) —
    that has a field of that name, or from ``given`` {field: (value, its dotted key)}; a ``ConfigError``
    from ``cls`` names the dotted key of the value it is about (a name ``cls`` made up: under
    ``key_prefix``, default the first source's; an already dotted name stays)."""
    given = given or {}
    values, keys = {}, {}
    for f in fields(cls):
        if f.name in given:
            values[f.name], keys[f.name] = given[f.name]
            continue
        for section, prefix in sources:
            if f.name in {g.name for g in fields(section)}:
                values[f.name], keys[f.name] = getattr(section, f.name), f"{prefix}.{f.name}"
                break
    try:
        return cls(**values)
    except ConfigError as e:
        if e.field not in keys and "." in e.field:
            raise
        key = keys.get(e.field, f"{key_prefix or sources[0][1]}.{e.field}")
        raise ConfigError(key, str(e).split(": ", 1)[1]) from None


def to_loss_config(cfg: TrainConfig) -> LossConfig:
    """The policy objective from ``actor.policy_loss`` and ``actor`` (fields shared by name)."""
    actor = cfg.actor_rollout_ref.actor
    return derive(
        LossConfig,
        (actor.policy_loss, f"{ACTOR}.policy_loss"),
        (actor, ACTOR),
        given={"seed": (actor.data_loader_seed, f"{ACTOR}.data_loader_seed")},
        key_prefix=ACTOR,
    )


def to_update_config(cfg: TrainConfig) -> UpdateConfig:
    """The engine's update: actor keys, ``rollout.n``, ``rollout.temperature`` (the log-prob temperature)."""
    actor, rollout = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    loss = to_loss_config(cfg)
    return derive(
        UpdateConfig,
        (actor, ACTOR),
        (actor.policy_loss, f"{ACTOR}.policy_loss"),
        given={
            "loss": (loss, ACTOR),
            "rollout_n": (rollout.n, f"{ROLLOUT}.n"),
            "temperature": (rollout.temperature, f"{ROLLOUT}.temperature"),
        },
    )


def to_critic_update_config(cfg: TrainConfig) -> CriticUpdateConfig:
    """The engine's critic update from ``critic.*`` (and ``rollout.n``)."""
    c = cfg.critic
    return derive(
        CriticUpdateConfig,
        (c, "critic"),
        (c.model, "critic.model"),
        given={"rollout_n": (cfg.actor_rollout_ref.rollout.n, f"{ROLLOUT}.n")},
    )


def sampling_params(cfg: TrainConfig) -> tuple[SamplingParams, SamplingParams]:
    """The training and validation sampling settings (verl's rollout keys and ``rollout.val_kwargs``)."""
    from ..rollout.hf import SamplingParams  # here: the config checks import this module, torch-free

    r = cfg.actor_rollout_ref.rollout
    width = (cfg.data.max_response_length, "data.max_response_length")
    train = derive(SamplingParams, (r, ROLLOUT), given={"max_response_length": width})
    val = derive(
        SamplingParams,
        (r.val_kwargs, f"{ROLLOUT}.val_kwargs"),
        given={"max_response_length": width, "seed": (r.seed, f"{ROLLOUT}.seed")},
    )
    return train, val


def multi_turn_settings(cfg: TrainConfig) -> MultiTurnSettings:
    """The multi-turn episodes' settings (``rollout.multi_turn``, ``rollout.agent.num_workers``)."""
    from ..rollout.episode import MultiTurnSettings  # here: the config checks import this module, torch-free

    r = cfg.actor_rollout_ref.rollout
    return derive(
        MultiTurnSettings,
        (r.multi_turn, f"{ROLLOUT}.multi_turn"),
        given={"num_workers": (r.agent.num_workers, f"{ROLLOUT}.agent.num_workers")},
    )


def lora_settings(cfg: TrainConfig) -> LoraSettings:
    """The actor's LoRA keys (``actor_rollout_ref.model.lora_*``, ``target_modules``, ``exclude_modules``),
    checked; ``lora_rank`` 0 is full fine-tuning."""
    m, prefix = cfg.actor_rollout_ref.model, f"{ARR}.model"
    targets = m.target_modules if isinstance(m.target_modules, str) else list(m.target_modules or ())
    excluded = list(m.exclude_modules) if m.exclude_modules is not None else None
    return derive(
        LoraSettings,
        (m, prefix),
        given={
            "target_modules": (targets, f"{prefix}.target_modules"),
            "exclude_modules": (excluded, f"{prefix}.exclude_modules"),
            "prefix": (f"{prefix}.", prefix),
        },
    )


def dp_strategy(cfg: TrainConfig) -> str:
    """``ddp`` or ``fsdp2`` (verl's ``fsdp`` is run as FSDP2)."""
    return STRATEGIES[cfg.actor_rollout_ref.actor.strategy]


def critic_strategy(cfg: TrainConfig) -> str:
    """The critic's ``ddp`` or ``fsdp2`` (``critic.strategy``, the actor's unless set)."""
    return STRATEGIES[cfg.critic.strategy]


def critic_enabled(cfg: TrainConfig) -> bool:
    """verl's rule: ``critic.enable`` when set, else on exactly for an estimator that reads values (gae)."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def reward_function(cfg: TrainConfig) -> tuple[str | None, str]:
    """(path, name) of the reward function from either of verl's two places; (None, ...) when none is named."""
    top, nested = cfg.custom_reward_function, cfg.reward.custom_reward_function
    if top.path is not None:
        return top.path, top.name or "compute_score"
    if nested.path is not None:
        return nested.path, nested.name or "compute_score"
    return None, "compute_score"


def reward_kwargs(cfg: TrainConfig) -> dict:
    """``reward_kwargs`` of the place that names the reward function (``{}`` when none does)."""
    top, nested = cfg.custom_reward_function, cfg.reward.custom_reward_function
    return dict((top if top.path is not None else nested).reward_kwargs or {})


def gen_batch_size(cfg: TrainConfig) -> int:
    """Prompts per generation round: ``data.gen_batch_size``, or ``train_batch_size`` when null."""
    return cfg.data.gen_batch_size or cfg.data.train_batch_size


def reward_manager_of(cfg: TrainConfig):
    """The run's reward manager (``rewards.dapo.RewardManager``) from verl's keys, checked."""
    return reward_manager(
        cfg.reward.reward_manager.name,
        cfg.reward_model.reward_manager,
        cfg.reward.reward_kwargs,
        cfg.reward_model.reward_kwargs,
        cfg.data.max_response_length,
    )
