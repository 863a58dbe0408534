"""Where each setting's value comes from, and the notices for settings that another one decides.

A value is *yours* (the ``--config`` file or a ``key=value`` override), *the built-in model's recipe*
(``splitproof/recipes/charlm.yaml``, only with ``actor_rollout_ref.model.path=builtin://charlm``) or
*verl's default* (the schema's; *splitproof's default* where the schema says ``ours:``). Errors about a
value the user did not set name its origin (``Origins.annotate``), and nothing the user set or left at a
default is overridden or switched without a notice (``run_notices``):

- the recipe's task keys (``TASK_KEYS``: the data, the batch and the run length it was tuned with) apply
  only to the built-in tasks; with your own ``data.train_files`` verl's defaults apply instead;
- with your own ``data.train_files``, the built-in task's held-out split (the default ``data.val_files``)
  is not evaluated: ``data.val_files`` is null unless you set it;
- ``trainer.total_epochs`` you set (to other than its default) has no effect while
  ``trainer.total_training_steps`` is set;
- ``algorithm.adv_estimator`` left at verl's default ``gae`` trains a critic beside the policy;
- a key of ``SCHEMA_NO_EFFECT`` set to other than its default has no effect (``data.validation_shuffle``,
  ``data.val_batch_size``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .mixed_precision import precision_notices
from .prefix_grouper import prefix_grouper_notices
from .schema import TrainConfig, schema_keys, walk_defaults
from .vllm_keys import vllm_notices

YOURS = "yours"
RECIPE = "the built-in model's recipe"
DEFAULT = "verl's default"
OURS = "splitproof's default (verl's differs)"
OWN_DATA = "set for your own data"
BUILTIN_DATA = "builtin://"
# the recipe's keys that belong to its task rather than to its model: they apply to built-in tasks only
TASK_KEYS = (
    "data.train_files",
    "data.val_files",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "trainer.total_training_steps",
)
OWN_DATA_LAYER = {"data.val_files": None}  # with your own data: no held-out split unless you name one

Items = list[tuple[str, Any]]
# keys of the schema (verl's) that splitproof reads but that change nothing here: a notice when set
SCHEMA_NO_EFFECT = {
    "data.validation_shuffle": "validation runs every held-out prompt, and their samples and metrics do not "
    "depend on the order they run in",
    "data.val_batch_size": "validation generates in chunks of actor_rollout_ref.rollout.max_num_seqs sequences, "
    "and its results do not depend on the chunks",
}


def is_builtin_data(value) -> bool:
    """``data.train_files`` naming built-in tasks only (or unset)."""
    values = value if isinstance(value, list) else [value]
    return all(v is None or (isinstance(v, str) and v.startswith(BUILTIN_DATA)) for v in values)


def recipe_for_data(recipe: Items, user: dict) -> tuple[Items, list[str]]:
    """The recipe's items that apply to the user's data, and a notice when its task keys do not: with data
    of your own, the keys of ``TASK_KEYS`` you did not set take verl's defaults."""
    if not recipe or is_builtin_data(user.get("data.train_files")):
        return recipe, []
    kept = [(k, v) for k, v in recipe if k not in TASK_KEYS]
    dropped = [
        k for k, _ in recipe if k in TASK_KEYS and k not in user and k not in OWN_DATA_LAYER and k != "data.train_files"
    ]
    if not dropped:
        return kept, []
    defaults = _schema_defaults()
    shown = ", ".join(f"{k}={_show(defaults.get(k))}" for k in dropped)
    return kept, [
        f"data.train_files is your own data, so the built-in model's recipe (tuned for its built-in "
        f"task) leaves its data and batch keys to verl's defaults: {shown}; set any of them to choose"
    ]


def own_data_items(user: dict) -> tuple[Items, list[str]]:
    """With data of your own and no ``data.val_files``: no held-out evaluation (rather than the built-in
    task's held-out split, the schema's default), with a notice."""
    if is_builtin_data(user.get("data.train_files")) or "data.val_files" in user:
        return [], []
    return list(OWN_DATA_LAYER.items()), [
        "data.val_files=null: data.train_files is your own data, so the built-in task's held-out split (the "
        "default data.val_files) is not evaluated; set data.val_files to evaluate held-out prompts"
    ]


@dataclass
class Origins:
    """Each key's value and origin, for the keys the user or the recipe set (anything else: verl's default)."""

    user: dict
    recipe: dict
    own_data: dict

    def of(self, key: str) -> tuple[Any, str]:
        if key in self.user:
            return self.user[key], YOURS
        if key in self.own_data:
            return self.own_data[key], OWN_DATA
        if key in self.recipe:
            return self.recipe[key], RECIPE
        return _schema_defaults().get(key), OURS if key in _our_defaults() else DEFAULT

    def _user_set(self, key: str) -> bool:
        """The user set ``key`` or, for a mapping such as ``reward_model.reward_kwargs``, a key inside it."""
        return key in self.user or any(k.startswith(f"{key}.") for k in self.user)

    def annotate(self, message: str, field: str = "") -> str:
        """``message`` with the value and origin of every config key it (or ``field``) names that the user did
        not set."""
        text = f"{field} {message}"
        named = [key for key in _schema_defaults() if not self._user_set(key) and _names(text, key)]
        if not named:
            return message
        parts = []
        for key in named:
            value, origin = self.of(key)
            parts.append(f"{key}={_show(value)} is {origin}")
        return f"{message} ({'; '.join(parts)})"


def run_notices(cfg, origins: Origins) -> list[str]:
    """Notices for settings the resolved config decides otherwise than their value suggests."""
    notices = []
    trainer = cfg.trainer
    epochs_set = origins.user.get("trainer.total_epochs", _schema_defaults()["trainer.total_epochs"])
    if epochs_set != _schema_defaults()["trainer.total_epochs"] and trainer.total_training_steps is not None:
        _, origin = origins.of("trainer.total_training_steps")
        notices.append(
            f"trainer.total_epochs={trainer.total_epochs} (yours) has no effect: "
            f"trainer.total_training_steps={trainer.total_training_steps} ({origin}) sets the run's "
            "length, as in verl; set trainer.total_training_steps=null to count epochs"
        )
    estimator, origin = origins.of("algorithm.adv_estimator")
    if origin == DEFAULT and cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is not False:
        notices.append(
            f"algorithm.adv_estimator=gae is verl's default (a model you bring gets verl's defaults): "
            f"a critic (critic.model.path={cfg.critic.model.path}) is trained beside the policy (PPO); "
            "set algorithm.adv_estimator=grpo (or another estimator) for a run without one"
        )
    notices.extend(vllm_notices(cfg, origins.user))
    notices.extend(precision_notices(cfg, origins))
    notices.extend(prefix_grouper_notices(cfg))
    for key, reason in SCHEMA_NO_EFFECT.items():
        value = origins.user.get(key, _schema_defaults()[key])
        if value != _schema_defaults()[key]:
            notices.append(f"{key}={_show(value)} has no effect: {reason}")
    return notices


def _names(message: str, key: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message) is not None


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


@lru_cache(maxsize=1)
def _our_defaults() -> frozenset[str]:
    """The keys whose schema default is splitproof's, not verl's (the schema comment says ``ours:``)."""
    return frozenset(key for key, _, comment in walk_defaults(TrainConfig()) if comment.startswith("ours"))


@lru_cache(maxsize=1)
def _schema_defaults() -> dict:
    """Every schema key's default (an interpolation shown as ``${...}``)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False)
    defaults = {}
    for key in schema_keys():
        node = tree
        for part in key.split("."):
            node = node[part]
        defaults[key] = node
    return defaults
