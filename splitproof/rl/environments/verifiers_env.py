"""verifiers environments (the classic API, ``verifiers`` 0.3.x): a module's ``load_environment(**kwargs)``
gives a ``vf.Environment``: its dataset (and eval dataset) become the run's prompt rows, its rubric the
score, its own rollout loop the episodes (``vf_rollout``).

``actor_rollout_ref.rollout.multi_turn.verifiers_env`` names the module: a file (``path/to/env.py``) or
an importable module (``my_env``, an installed environment package; ``-`` read as ``_`` as verifiers
does); ``multi_turn.verifiers_env_args`` are its keyword arguments.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys

from ...loss_config import ConfigError
from ..data.prompts import PromptDataset, PromptRecord

KEY = "actor_rollout_ref.rollout.multi_turn.verifiers_env"
ARGS_KEY = "actor_rollout_ref.rollout.multi_turn.verifiers_env_args"
DATA_SOURCE = "verifiers"


def import_module_of(spec: str):
    """The module a spec names: a ``.py`` file, else an importable module name."""
    if spec.endswith(".py") or os.sep in spec:
        if not os.path.isfile(spec):
            raise ConfigError(KEY, f"no file {spec!r}")
        name = "splitproof_vf_env_" + os.path.splitext(os.path.basename(spec))[0].replace("-", "_")
        loader_spec = importlib.util.spec_from_file_location(name, spec)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            sys.modules.pop(name, None)
            raise ConfigError(KEY, f"{spec} fails to import: {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(spec.replace("-", "_"))
    except Exception as e:
        raise ConfigError(KEY, f"module {spec!r} fails to import: {type(e).__name__}: {e}") from None


def require_verifiers():
    """``verifiers`` with its classic API, or ``ConfigError`` saying what to install."""
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018  (the classic API resolves at the top level in 0.3.x)
    except (ImportError, AttributeError):
        raise ConfigError(
            KEY, "needs verifiers' classic API: pip install 'splitproof[verifiers]' (verifiers 0.3.x)"
        ) from None
    return vf


def load_verifiers_environment(spec: str, kwargs: dict | None = None):
    """``load_environment(**kwargs)`` of the module ``spec`` names; ``ConfigError`` (one line) for a module
    that fails to import, has no ``load_environment``, whose call raises or does not return an Environment."""
    if not isinstance(spec, str) or not spec:
        raise ConfigError(KEY, f"must name a file (path/to/env.py) or a module, got {spec!r}")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ConfigError(ARGS_KEY, f"must be a mapping of load_environment's keyword arguments, got {kwargs!r}")
    module = import_module_of(spec)
    load = getattr(module, "load_environment", None)
    if not callable(load):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ConfigError(
            KEY, f"{spec} defines no load_environment (functions it defines: {', '.join(defined) or 'none'})"
        )
    vf = require_verifiers()
    try:
        env = load(**(kwargs or {}))
    except Exception as e:
        raise ConfigError(KEY, f"{spec}: load_environment raised {type(e).__name__}: {e}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(KEY, f"{spec}: load_environment returned {type(env).__name__}, not a vf.Environment")
    env.env_id = env.env_id or os.path.splitext(os.path.basename(spec))[0]
    return env


def environment_rows(env, tokenizer, *, eval_split: bool = False, max_samples: int | None = None) -> PromptDataset:
    """The environment's dataset (``eval_split``: its eval dataset) as prompt records: the row's columns are
    verifiers' rollout input (``prompt``, ``answer``, ``info``, ``task``, ``example_id``), the prompt ids
    the chat template's (the episode renders them again with the environment's tools)."""
    data = env.get_eval_dataset() if eval_split else env.get_dataset()
    n = len(data) if max_samples is None or max_samples < 0 else min(max_samples, len(data))
    records, origins = [], []
    name = f"{env.env_id or 'verifiers'}:{'eval' if eval_split else 'train'}"
    for i in range(n):
        row = dict(data[i])
        prompt = row["prompt"]
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        records.append(PromptRecord(uid=i, prompt=prompt, prompt_ids=ids, data_source=DATA_SOURCE, columns=row))
        origins.append((name, i))
    return PromptDataset(records, origins, prompt_key="prompt")


def verifiers_inputs(multi_turn, data_cfg, tokenizer, defaults) -> tuple:
    """The environment ``multi_turn.verifiers_env`` names, its train rows and held-out rows (its eval
    dataset, else none), and the notices for ``data.*`` files it replaces (``defaults``: ``DataConfig()``)."""
    env = load_verifiers_environment(multi_turn.verifiers_env, dict(multi_turn.verifiers_env_args or {}))
    train = environment_rows(env, tokenizer, max_samples=data_cfg.train_max_samples)
    if len(train) == 0:
        raise ConfigError(KEY, f"{multi_turn.verifiers_env}: the environment's dataset has no rows")
    val = None
    if env.eval_dataset is not None or env.eval_dataset_source is not None:
        val = environment_rows(env, tokenizer, eval_split=True, max_samples=data_cfg.val_max_samples)
    notices = [
        f"data.{name}={getattr(data_cfg, name)!r} is not read: the rows come from {KEY}="
        f"{multi_turn.verifiers_env} (its {'eval ' if name == 'val_files' else ''}dataset)"
        for name in ("train_files", "val_files")
        if getattr(data_cfg, name) != getattr(defaults, name)
    ]
    return env, train, val, notices
