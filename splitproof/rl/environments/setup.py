"""A run's environments, loaded and checked before any model: ``prepare_environments``."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...loss_config import ConfigError
from ..rewards import rules
from ..rollout.tools import Tool
from .session import EnvironmentSet
from .trl_factory import KEY, EnvironmentClass, environment_of, probe_seed


@dataclass(frozen=True)
class PreparedEnvironments:
    """The environment set for the rollout, whether the environments own the reward alone, the notices."""

    environments: EnvironmentSet
    environment_only: bool
    notices: list[str] = field(default_factory=list)


def schema_tools(classes: dict[str | None, EnvironmentClass]) -> dict[str, Tool]:
    """Every environment's tool schemas (for the chat-template probe; never called)."""
    return {
        s["function"]["name"]: Tool(s["function"]["name"], s, run=lambda args: None)
        for env in classes.values()
        for s in env.schemas
    }


def check_rows(environments: EnvironmentSet, dataset) -> list[str]:
    """Route every row (``ConfigError`` naming the first that names no environment); probe each environment
    on its first row: the seed (notices) and the prompt after reset (``ConfigError`` when it is too long)."""
    classes, first = environments.classes, {}
    for record in dataset:
        env = environment_of(classes, record.columns, dataset.origin(record.uid))
        first.setdefault(env.route, record.uid)
    notices = []
    for route, uid in first.items():
        env, where = classes[route], dataset.origin(uid)
        notice, instance, observation = probe_seed(env, dataset[uid].columns, where)
        if notice is not None:
            notices.append(notice)
        if env.takes_seed and "seed" in dataset[uid].columns:
            notices.append(
                f"{KEY}: the rows have a 'seed' column ({where}): {env.label}.reset receives it, not the "
                "episode's seed (episodes of one row then start alike at every step and sample index)"
            )
        try:
            environments.prompt_ids(dataset[uid].prompt, observation, env.tools(instance), env.label)
        except ValueError as e:
            raise ConfigError(KEY, f"{where}: {e}") from None
    return notices


def owns_reward(classes: dict[str | None, EnvironmentClass], reward_fn, datasets) -> bool:
    """True when no reward function is named, every environment has ``get_reward`` and some row has no
    built-in rule: the environments' rewards are then the whole score."""
    if reward_fn is not None or not all(env.has_reward for env in classes.values()):
        return False
    sources = {source for data in datasets if data is not None for source in data.data_sources}
    return any(source not in rules.RULES for source in sources)


def prepare_environments(
    classes: dict[str | None, EnvironmentClass],
    tokenizer,
    standalone: dict[str, Tool],
    data_kwargs: dict,
    train_data,
    val_data,
    reward_fn,
) -> PreparedEnvironments:
    """The loaded environments (``load_environments`` of ``KEY``) with every row of both datasets routed and
    each environment's reset probed."""
    environments = EnvironmentSet(
        classes=classes,
        tokenizer=tokenizer,
        standalone=dict(standalone),
        template_kwargs={k: v for k, v in data_kwargs["apply_chat_template_kwargs"].items() if k != "tools"},
        max_prompt_length=data_kwargs["max_prompt_length"],
        truncation=data_kwargs["truncation"],
    )
    notices = check_rows(environments, train_data)
    if val_data is not None:
        notices += [n for n in check_rows(environments, val_data) if n not in notices]
    return PreparedEnvironments(environments, owns_reward(classes, reward_fn, (train_data, val_data)), notices)


__all__ = ["KEY", "PreparedEnvironments", "prepare_environments", "schema_tools"]
