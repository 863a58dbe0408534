"""TRL's ``environment_factory`` contract, loaded from ``actor_rollout_ref.rollout.multi_turn.environment_factory``.

The key names a class (or any zero-argument callable that returns an environment): ``path/to/file.py:Name``
or ``package.module:Name``; or a mapping ``{name: spec}`` whose rows are routed by their ``environment``
column (that column is not passed to ``reset``, as TRL does). One fresh instance per episode. Of an
instance:

- ``reset(**row)`` (required) starts the episode with the row's columns as keyword arguments, and
  ``seed=`` the episode's seed when it takes one (a ``seed`` parameter or ``**kwargs``; a row's own ``seed``
  column wins). A returned string is appended to the content of the prompt's last message (to the prompt
  itself for a plain-text prompt); ``None`` leaves the prompt as it is.
- its public methods (name not starting with ``_``, other than ``reset`` and ``get_reward``) are the
  episode's tools; each needs type hints and a Google-style docstring (the schema ``get_json_schema``
  derives, as for function tools).
- ``get_reward()`` (optional, sync or async) scores the finished episode from the environment's state; it
  is added to the reward function's score (weight 1) and reported under the class name.

Everything is checked here, before any model: the import, ``reset``, every tool's schema, the routing
column of every row, and one probe of reset's determinism (``probe_seed``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ...loss_config import ConfigError
from ..rollout.tools import Tool, function_schema, import_file
from .seeds import seeded_globals

KEY = "actor_rollout_ref.rollout.multi_turn.environment_factory"
RESERVED = ("reset", "get_reward")
ROUTE_COLUMN = "environment"


@dataclass(frozen=True)
class EnvironmentClass:
    """One loadable environment: its factory, the route name (None: every row), its tools' schemas."""

    route: str | None
    factory: Callable[[], Any]
    label: str  # the class name: the reward's metric name, the name in messages
    schemas: tuple[dict, ...]
    has_reward: bool
    takes_seed: bool

    def tools(self, instance) -> dict[str, Tool]:
        """The public methods of ``instance`` as tools (the schemas read from the probe instance)."""
        tools = {}
        for schema in self.schemas:
            name = schema["function"]["name"]
            method = getattr(instance, name)
            tools[name] = Tool(name=name, schema=schema, run=lambda args, m=method: call_maybe_async(m, **args))
        return tools


def call_maybe_async(fn: Callable, *args, **kwargs) -> Any:
    result = fn(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def resolve_factory(spec: str, where: str) -> Callable:
    """The object ``spec`` names: ``file.py:Name`` (a path) or ``package.module:Name``."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(where, f"{spec!r}: name the class as path/to/file.py:Name or package.module:Name")
    module_part, _, attr = spec.rpartition(":")
    if module_part.endswith(".py") or "/" in module_part:
        module = import_file(module_part, where)
    else:
        try:
            module = importlib.import_module(module_part)
        except Exception as e:
            raise ConfigError(where, f"{spec}: cannot import {module_part!r} ({type(e).__name__}: {e})") from None
    if not attr or not hasattr(module, attr):
        defined = sorted(k for k, v in vars(module).items() if inspect.isclass(v) and not k.startswith("_"))
        raise ConfigError(where, f"{spec}: {attr!r} not found; it defines: {', '.join(defined) or 'no classes'}")
    factory = getattr(module, attr)
    if not callable(factory):
        raise ConfigError(where, f"{spec}: {attr!r} is a {type(factory).__name__}, not a class or factory")
    return factory


def build_instance(factory: Callable, label: str, where: str):
    try:
        return factory()
    except Exception as e:
        raise ConfigError(where, f"{label}() failed: {type(e).__name__}: {e}") from None


def public_methods(instance) -> list[tuple[str, Callable]]:
    """TRL's tools of an instance: its bound methods not starting with ``_``, other than reset and get_reward."""
    return [
        (name, member)
        for name, member in inspect.getmembers(instance, predicate=inspect.ismethod)
        if name not in RESERVED and not name.startswith("_")
    ]


def takes_seed(reset: Callable) -> bool:
    params = inspect.signature(reset).parameters.values()
    return any(p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def load_class(spec: str, route: str | None) -> EnvironmentClass:
    """One environment class, checked: importable, builds, has ``reset``, every tool has a schema."""
    where = KEY if route is None else f"{KEY}.{route}"
    factory = resolve_factory(spec, where)
    label = getattr(factory, "__name__", spec)
    instance = build_instance(factory, label, where)
    reset = getattr(instance, "reset", None)
    if not callable(reset):
        raise ConfigError(
            where, f"{label} has no reset method (TRL's environment_factory contract: reset(**row) -> str | None)"
        )
    schemas = tuple(function_schema(method, f"{where} ({label})") for _, method in public_methods(instance))
    return EnvironmentClass(
        route=route,
        factory=factory,
        label=label,
        schemas=schemas,
        has_reward=callable(getattr(instance, "get_reward", None)),
        takes_seed=takes_seed(reset),
    )


def load_environments(spec) -> dict[str | None, EnvironmentClass]:
    """The environments the key names: ``{None: class}`` for one, ``{route: class}`` for a mapping."""
    if isinstance(spec, Mapping):
        if not spec:
            raise ConfigError(KEY, "an empty mapping names no environment")
        return {str(route): load_class(value, str(route)) for route, value in spec.items()}
    return {None: load_class(spec, None)}


def environment_of(classes: dict[str | None, EnvironmentClass], columns: dict, where: str) -> EnvironmentClass:
    """The environment a row is routed to (its ``environment`` column with a mapping); ``ConfigError`` naming
    the row when it names none of them."""
    if None in classes:
        return classes[None]
    route = columns.get(ROUTE_COLUMN)
    if route not in classes:
        raise ConfigError(
            KEY,
            f"{where}: {ROUTE_COLUMN}={route!r} is not among the environments of {KEY}: {', '.join(classes)}",
        )
    return classes[route]


def reset_kwargs(env: EnvironmentClass, columns: dict, seed: int) -> dict:
    """What ``reset`` receives: the row's columns (less the routing column with a mapping), and ``seed``."""
    kwargs = {k: v for k, v in columns.items() if env.route is None or k != ROUTE_COLUMN}
    if env.takes_seed and "seed" not in kwargs:
        kwargs["seed"] = seed
    return kwargs


def probe_seed(env: EnvironmentClass, columns: dict, where: str) -> tuple[str | None, Any, str | None]:
    """Reset two fresh instances with the same row and seed: (a notice naming the environment when their
    first observations differ — its episodes are then not a function of the seed — else None, the first
    instance, its observation). ``ConfigError`` when reset raises or returns something other than a string
    or None."""
    observations, instances = [], []
    for _ in range(2):
        instance = build_instance(env.factory, env.label, KEY)
        try:
            with seeded_globals(12345):
                observation = instance.reset(**reset_kwargs(env, columns, 12345))
        except Exception as e:
            raise ConfigError(KEY, f"{env.label}.reset(**row) raised on {where}: {type(e).__name__}: {e}") from None
        if observation is not None and not isinstance(observation, str):
            raise ConfigError(
                KEY, f"{env.label}.reset returned {type(observation).__name__} on {where}; expected a string or None"
            )
        observations.append(observation)
        instances.append(instance)
    if observations[0] == observations[1]:
        return None, instances[0], observations[0]
    seeded = "ignores seed=" if env.takes_seed else "takes no seed= (and draws from a generator of its own)"
    return (
        (
            f"{KEY}: {env.label}.reset gave two different first observations for the same row ({where}) and seed "
            f"({observations[0]!r:.60} vs {observations[1]!r:.60}); it {seeded}, so its episodes are not a "
            "function of the run's seed"
        ),
        instances[0],
        observations[0],
    )
