"""A run's environments, loaded and checked before any model: ``prepare_environments``."""

from __future__ import annotations

import inspect
import pickle
from dataclasses import dataclass, field

from ...loss_config import ConfigError
from ..rewards import rules
from ..rollout.tools import Tool
from .session import EnvironmentSet
from .trl_factory import KEY, EnvironmentClass, environment_of, probe_seed


@dataclass(frozen=True)
class PreparedEnvironments:
    """The environment set for the rollout, whether the environments own the reward alone, the notices, and
    whether the reward function gets the episodes' instances."""

    environments: EnvironmentSet
    environment_only: bool
    notices: list[str] = field(default_factory=list)
    pass_instances: bool = False  # the reward function gets environments= (TRL)


def schema_tools(classes: dict[str | None, EnvironmentClass]) -> dict[str, Tool]:
    """Every environment's tool schemas (for the chat-template probe; never called)."""
    return {
        s["function"]["name"]: Tool(s["function"]["name"], s, run=lambda args: None)
        for env in classes.values()
        for s in env.schemas
    }


def first_rows(classes: dict[str | None, EnvironmentClass], dataset) -> dict[str | None, int]:
    """Every row routed (``ConfigError`` naming the first that names no environment): route → its first uid."""
    first = {}
    for record in dataset:
        env = environment_of(classes, record.columns, dataset.origin(record.uid))
        first.setdefault(env.route, record.uid)
    return first


def check_rows(environments: EnvironmentSet, dataset) -> list[str]:
    """Route every row; probe each environment on its first row: the seed (notices) and the prompt after
    reset (``ConfigError`` when it is too long)."""
    classes = environments.classes
    notices = []
    for route, uid in first_rows(classes, dataset).items():
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


def takes_keyword(reward_fn, name: str) -> str:
    """How a TRL-convention reward function takes keyword ``name``: ``"named"``, ``"kwargs"`` (only through
    ``**kwargs``) or ``""`` (not at all, or not a TRL-convention function). Its signature was read when it
    was loaded."""
    if reward_fn is None or reward_fn.convention != "trl":
        return ""
    params = inspect.signature(reward_fn.fn).parameters
    if name in params and params[name].kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        return "named"
    return "kwargs" if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) else ""


def passes_instances(classes, reward_fn, datasets) -> tuple[bool, list[str]]:
    """Whether the reward function gets ``environments=`` (a TRL-convention function that takes it, by name
    or through ``**kwargs``), and the notices. An instance travels with its episode's sample (to the other
    data-parallel ranks), so each environment's instance after reset on its first row must pickle, whatever
    the DP size: a function that names ``environments`` is then an error, one with ``**kwargs`` a notice."""
    use = takes_keyword(reward_fn, "environments")
    if not use:
        return False, []
    for data in (d for d in datasets if d is not None):
        for route, uid in first_rows(classes, data).items():
            env = classes[route]
            instance = probe_seed(env, data[uid].columns, data.origin(uid))[1]
            try:
                pickle.dumps(instance)
            except Exception as e:
                why = (
                    f"{env.label} cannot be pickled after reset on {data.origin(uid)} ({type(e).__name__}: {e}); "
                    "each episode's instance travels with its sample"
                )
                if use == "named":
                    raise ConfigError(
                        KEY,
                        f"{why}, and reward function {reward_fn.name} takes environments=: keep no open file, "
                        "socket or lock in the environment's state",
                    ) from None
                return False, [
                    f"{KEY}: {why}, so reward function {reward_fn.name}, which takes **kwargs, gets no environments="
                ]
    return True, []


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
    passes, more = passes_instances(classes, reward_fn, (train_data, val_data))
    owns = owns_reward(classes, reward_fn, (train_data, val_data))
    return PreparedEnvironments(environments, owns, notices + more, passes)


__all__ = ["KEY", "PreparedEnvironments", "prepare_environments", "schema_tools"]
