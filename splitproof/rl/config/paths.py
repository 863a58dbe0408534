"""The files and folders a config names, checked before any other value: a missing one blocks the run
whatever else is wrong, so it is reported first (with every other missing one, then the other problems).

Checked without reading them (no torch, no data library): the prompt files (``data.train_files``,
``data.val_files``; ``builtin://`` and ``reasoning-gym://`` tasks need none), the model and tokenizer
folders, the critic's model folder when the critic is on, and the reward function's file.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...loss_config import ConfigError
from .check import critic_enabled
from .schema import BUILTIN_MODEL, TrainConfig

BUILTIN = "builtin://"
GENERATED = (BUILTIN, "reasoning-gym://")  # data sources generated, not read from a file


def _as_list(value) -> list:
    return value if isinstance(value, list) else [] if value is None else [value]


def _prompt_file_problem(name: str) -> str | None:
    path = Path(name).expanduser()
    if path.is_file():
        return None
    return f"{name}: prompt file {'is a directory, not a file' if path.is_dir() else 'not found'}"


def _folder_problem(path: str) -> str | None:
    if path == BUILTIN_MODEL or os.path.isdir(os.path.expanduser(path)):
        return None
    return f"{path!r} is not a local directory (models are never downloaded)"


def _reward_file(cfg: TrainConfig) -> tuple[str, str | None]:
    if cfg.custom_reward_function.path is not None:
        return "custom_reward_function.path", cfg.custom_reward_function.path
    return "reward.custom_reward_function.path", cfg.reward.custom_reward_function.path


def missing_paths(cfg: TrainConfig) -> list[tuple[str, str]]:
    """``(key, message)`` for each file or folder the config names that does not exist, in key order."""
    problems: list[tuple[str, str]] = []
    for key in ("data.train_files", "data.val_files"):
        for name in _as_list(getattr(cfg.data, key.split(".")[1])):
            if isinstance(name, str) and name and not name.startswith(GENERATED):
                problem = _prompt_file_problem(name)
                if problem:
                    problems.append((key, problem))
    model = cfg.actor_rollout_ref.model
    folders = [
        ("actor_rollout_ref.model.path", model.path),
        ("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path),
    ]
    if critic_enabled(cfg):
        folders.append(("critic.model.path", cfg.critic.model.path))
    for key, path in folders:
        problem = _folder_problem(path) if isinstance(path, str) and path else None
        if problem:
            problems.append((key, problem))
    key, reward = _reward_file(cfg)
    if isinstance(reward, str) and reward and not Path(reward).expanduser().is_file():
        problems.append((key, f"reward function file {reward}: not found"))
    return problems


def check_paths(cfg: TrainConfig) -> None:
    """``ConfigError`` naming every file or folder of ``cfg`` that does not exist."""
    problems = missing_paths(cfg)
    if problems:
        raise ConfigError(*blocking_message(problems))


def blocking_message(problems: list[tuple[str, str]]) -> tuple[str, str]:
    """One (key, message) for several ``(key, message)`` problems: the first's key, then every message."""
    (key, first), rest = problems[0], problems[1:]
    return key, first + "".join(f"; also {k}: {m}" for k, m in rest)
