"""Load the `splitproof train` config the way Hydra/OmegaConf merge verl's: layers, overrides, interpolations.

Layers, later wins: the schema's defaults (verl's) <- the built-in model's recipe <- ``--config FILE.yaml``
<- ``key=value`` overrides. The recipe layer (``splitproof/recipes/charlm.yaml``: hyper-parameters tuned
for the built-in model on the built-in task) applies exactly when ``actor_rollout_ref.model.path``,
after the file and the overrides, is the built-in model; a user who brings a model gets verl's defaults
for every key they leave unset.

Overrides are Hydra's: dotted keys, YAML-typed values (``trainer.logger=[console,file]``,
``optim.lr=1e-6``, ``x=null``; ``x=`` is the empty string; text that is not YAML is taken as it is);
``+key=value`` and ``++key=value`` set a key like ``key=value``. ``${...}`` interpolations
(``oc.select``, ``oc.env`` included) are resolved.
Every key the user sets is classified by ``verl_keys.classify`` before anything is merged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from functools import lru_cache
from importlib import resources
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, OmegaConfBaseException

from ...loss_config import ConfigError
from . import verl_keys
from .check import normalize, problems
from .derive import CRITIC_ESTIMATORS
from .origins import Origins, own_data_items, recipe_for_data, run_notices
from .paths import blocking_message, missing_paths
from .schema import BUILTIN_MODEL, TrainConfig, schema_keys

RECIPES = {BUILTIN_MODEL: "charlm.yaml"}
MODEL_PATH = "actor_rollout_ref.model.path"

_TYPE_WORDS = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}

Items = list[tuple[str, Any]]


def parse_override(arg: str) -> tuple[str, Any]:
    """``key=value`` (Hydra's ``+``/``++`` prefixes allowed) -> (dotted key, YAML-typed value)."""
    text = arg[2:] if arg.startswith("++") else arg[1:] if arg.startswith("+") else arg
    if text.startswith("~"):
        raise ConfigError(text[1:].split("=")[0] or arg, "deleting a key (Hydra's ~key) is not supported")
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(key or arg, f"expected key=value, got {arg!r}")
    if raw == "":
        return key, ""
    try:
        return key, OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except Exception:  # not YAML (a Jinja chat template, say): the text itself, as a shell would pass it
        return key, raw


BUILTIN_CONFIG = "builtin://"


def _builtin_config(path: str):
    """A config shipped in ``splitproof/recipes`` (``builtin://charlm-dapo``), read as YAML."""
    name = path[len(BUILTIN_CONFIG) :]
    folder = resources.files("splitproof.recipes")
    shipped = sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".yaml"))
    if name not in shipped:
        raise ConfigError(
            "--config", f"no built-in config {path!r}; shipped: {', '.join(BUILTIN_CONFIG + n for n in shipped)}"
        )
    return OmegaConf.create(folder.joinpath(f"{name}.yaml").read_text(encoding="utf-8"))


def read_config_file(path: str) -> dict:
    """A YAML config file (or a shipped one, ``builtin://NAME``) as a plain (unresolved) mapping."""
    try:
        loaded = _builtin_config(path) if path.startswith(BUILTIN_CONFIG) else OmegaConf.load(path)
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError("--config", f"file not found: {path}") from None
    except OSError as e:
        raise ConfigError("--config", f"cannot read {path}: {e.strerror or e}") from None
    except Exception as e:
        raise ConfigError("--config", f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError("--config", f"{path} must hold a mapping of keys, not a list")
    return OmegaConf.to_container(loaded, resolve=False)


def flatten(value: Any, prefix: str = "") -> Items:
    """Leaf (dotted key, value) pairs; a mapping-valued schema key stays whole, Hydra's ``_target_`` is dropped."""
    keys = schema_keys()
    info = keys.get(prefix)
    if isinstance(value, dict) and value and not (info is not None and info.type in (dict, Any)):
        items: Items = []
        for name, child in value.items():
            if name == "_target_":
                continue
            items.extend(flatten(child, f"{prefix}.{name}" if prefix else str(name)))
        return items
    if info is not None and info.type is list and isinstance(value, str) and "${" not in value:
        value = [value]  # trainer.logger=console
    return [(prefix, value)]


def _accept(items: Items, notices: list[str], settings: dict) -> Items:
    """The items for our schema; notices for no-effect keys; a ConfigError for anything else."""
    kept: Items = []
    for key, value in items:
        kind = verl_keys.classify(key, value, settings)
        if kind == "ours":
            kept.append((key, value))
        elif kind == "no_effect":
            notices.append(f"{key}: no effect in splitproof ({verl_keys.no_effect_reason(key)}); ignored")
        elif kind == "unsupported":
            raise ConfigError(key, verl_keys.unsupported_message(key))
        elif kind == "unknown":
            if verl_keys.is_section(key):
                if verl_keys.is_off(value):
                    continue
                raise ConfigError(key, "is a section, not a key; set the keys inside it")
            raise ConfigError(key, verl_keys.unknown_message(key))
    return kept


def _layer(items: Items) -> DictConfig:
    layer = OmegaConf.create({})
    for key, value in items:
        OmegaConf.update(layer, key, value, merge=True, force_add=True)
    return layer


def _describe(key: str) -> str:
    info = schema_keys().get(key)
    if info is None:
        return "a valid value"
    word = _TYPE_WORDS.get(info.type, "a value")
    return word + (" or null" if info.optional else "")


def _config_error(e: OmegaConfBaseException, layers: list[DictConfig]) -> ConfigError:
    key = getattr(e, "full_key", None) or "config"
    if isinstance(e, InterpolationResolutionError):
        return ConfigError(key, f"cannot resolve interpolation: {' '.join(str(e).splitlines()[0].split())}")
    value = None
    for layer in layers:
        found = OmegaConf.select(layer, key, default=None, throw_on_missing=False)
        value = found if found is not None else value
    return ConfigError(key, f"expected {_describe(key)}, got {value!r}")


@lru_cache(maxsize=1)
def _defaults() -> DictConfig:
    """The typed schema with verl's defaults (built once: OmegaConf.merge copies it)."""
    return OmegaConf.structured(TrainConfig)


def _merge(layers: list[DictConfig]) -> DictConfig:
    try:
        return OmegaConf.merge(_defaults(), *layers)
    except OmegaConfBaseException as e:
        raise _config_error(e, layers) from None


def _resolve(merged: DictConfig, layers: list[DictConfig]) -> TrainConfig:
    try:
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        raise _config_error(e, layers) from None


def recipe_items(model_path: str) -> Items:
    """The recipe of a built-in model, as (key, value) pairs; none for any other model."""
    name = RECIPES.get(model_path)
    if name is None:
        return []
    text = resources.files("splitproof.recipes").joinpath(name).read_text(encoding="utf-8")
    return flatten(OmegaConf.to_container(OmegaConf.create(text), resolve=False))


def _with_critic_switch(settings: dict) -> dict:
    """``settings`` with ``critic.enable`` as verl settles it: when unset (or null) the critic is on exactly
    for an estimator that reads values, the estimator being the user's, else the recipe's, else verl's
    default. verl keys inside ``critic`` are then judged against that switch."""
    if settings.get("critic.enable") is not None:
        return settings
    estimator = settings.get("algorithm.adv_estimator")
    if estimator is None:
        recipe = dict(recipe_items(settings.get(MODEL_PATH, BUILTIN_MODEL)))
        estimator = recipe.get("algorithm.adv_estimator", TrainConfig().algorithm.adv_estimator)
    return {**settings, "critic.enable": estimator in CRITIC_ESTIMATORS}


def _print_notice(message: str) -> None:
    print(f"splitproof: notice: {message}", file=sys.stderr)


def _user_items(config_file: str | None, overrides: Iterable[str]) -> tuple[Items, Items]:
    """The (key, value) pairs of the config file and of the overrides."""
    file_items = flatten(read_config_file(config_file)) if config_file else []
    override_items: Items = []
    for arg in overrides:
        key, value = parse_override(arg)
        override_items.extend(flatten(value, key))
    return file_items, override_items


def _applied_layers(user_layers: list[DictConfig], user: dict) -> tuple[Items, Items, list[str]]:
    """The recipe items that apply (by the model and the data), the layer for data of the user's own, and
    the notices about what they leave out."""
    try:
        model_path = OmegaConf.select(_merge(user_layers), MODEL_PATH)
    except OmegaConfBaseException as e:
        raise _config_error(e, user_layers) from None
    recipe, notices = recipe_for_data(recipe_items(model_path), user)
    own, own_notices = own_data_items(user)
    return recipe, own, notices + own_notices


def _layers(config_file: str | None, overrides: Iterable[str]) -> tuple[list[DictConfig], Origins, list[str]]:
    """The layers to merge over the schema (recipe, own data, file, overrides: only keys of ours), each key's
    origin, and the notices (no-effect keys, what the recipe and the data leave out)."""
    notices: list[str] = []
    file_items, override_items = _user_items(config_file, overrides)
    user = dict(file_items + override_items)
    settings = _with_critic_switch(user)
    user_layers = [_layer(_accept(file_items, notices, settings)), _layer(_accept(override_items, notices, settings))]
    recipe, own, layer_notices = _applied_layers(user_layers, user)
    origins = Origins(user=user, recipe=dict(recipe), own_data=dict(own))
    layers = [_layer(_accept(items, [], {})) for items in (recipe, own) if items] + user_layers
    return layers, origins, notices + layer_notices


def setting_origins(config_file: str | None, overrides: Iterable[str] = ()) -> Origins:
    """Where each key's value comes from (yours, the recipe, verl's default), for messages about values.
    The keys are read as ``load_train_config`` reads them (verl's no-effect keys set aside)."""
    return _layers(config_file, overrides)[1]


def load_train_config(
    config_file: str | None,
    overrides: Iterable[str] = (),
    *,
    on_notice: Callable[[str], None] | None = None,
    check_paths: bool = False,
) -> TrainConfig:
    """The resolved, normalized and validated config; ``ConfigError`` names the offending dotted key (and
    the origin of any value it names that the user did not set: the recipe, or verl's default).

    ``on_notice`` receives one line per accepted key that has no effect here, and per setting that another
    decides (``origins.run_notices``) (default: stderr). ``check_paths``: the files and folders it names must
    exist (``paths.missing_paths``), reported before, and with, any other error.
    """
    layers, origins, notices = _layers(config_file, overrides)
    try:
        cfg = normalize(_resolve(_merge(layers), layers))
        _validate(cfg, check_paths)
    except ConfigError as e:  # one line: every problem, each value the user did not set with its origin
        raise ConfigError(e.field, origins.annotate(str(e)[len(e.field) + 2 :], e.field)) from None
    for message in notices + run_notices(cfg, origins):
        (on_notice or _print_notice)(message)
    return cfg


def _validate(cfg: TrainConfig, check_paths: bool) -> None:
    """One ``ConfigError`` naming every problem ``check.problems`` finds, after the files and folders that
    do not exist (they block the rest: ``paths.missing_paths``)."""
    found = (missing_paths(cfg) if check_paths else []) + [(e.field, str(e)[len(e.field) + 2 :]) for e in problems(cfg)]
    if found:
        raise ConfigError(*blocking_message(found))


def dump_config(cfg: TrainConfig) -> str:
    """The resolved config as YAML; fed back through ``--config`` it loads as the same config."""
    body = OmegaConf.to_yaml(OmegaConf.structured(cfg))
    return "# splitproof train: resolved config (verl's key names)\n" + body


def config_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain nested dicts and lists (for trackers and checkpoints)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
