"""Environments in multi-turn episodes: one instance per episode, reset with its seed, its methods as the
episode's tools, its ``get_reward`` read when the episode ends.

``EnvironmentSet`` (built once per run) starts a batch's episodes with ``begin``: in canonical order (the
batch's order: prompt, then sample index), each episode gets a fresh instance, ``reset(**row, seed=...)``
under ``seeded_globals`` of its seed, and its prompt re-rendered with the observation appended to the last
message and its environment's tool schemas in the chat template (then ``data.truncation`` as for any
prompt). The ``EnvironmentSession`` it returns gives each episode its tools and says, after a tool turn,
whether it goes on; ``finish`` calls ``get_reward`` in canonical order.

An environment that raises: in ``reset``, the episode runs on the row's prompt as loaded, without the
environment's tools, reward 0; in a tool, the error text is the tool's response (as for any tool) and
the episode ends after it; in ``get_reward``, reward 0. Each counts in ``environment/errors``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..data.prompts import truncate
from ..rollout.tools import Tool, ToolCall, ToolResult
from .seeds import episode_seed, seeded_globals
from .trl_factory import EnvironmentClass, call_maybe_async, environment_of, reset_kwargs


@dataclass(frozen=True)
class EpisodeStart:
    """How an episode starts: its prompt ids, its tools (None: the rollout's own), its environment's label."""

    prompt_ids: list[int]
    tools: dict[str, Tool] | None
    environment: str = ""
    error: str | None = None


@dataclass(frozen=True)
class EnvironmentSet:
    """The run's environments and what re-rendering a prompt needs."""

    classes: dict[str | None, EnvironmentClass]
    tokenizer: object
    standalone: dict[str, Tool] = field(default_factory=dict)  # function tools offered beside the methods
    template_kwargs: dict = field(default_factory=dict)
    max_prompt_length: int = 512
    truncation: str = "error"

    def begin(self, episodes: Sequence, records: Sequence, *, step: int, stream: int, seed: int) -> EnvironmentSession:
        """Reset one fresh instance per episode, in the order given (canonical)."""
        session = EnvironmentSession(self)
        for episode, record in zip(episodes, records):
            s = episode_seed(seed, stream, step, episode.uid, episode.sample_index)
            session.start(episode, record, s)
        return session

    def prompt_ids(self, prompt, observation: str | None, tools: dict[str, Tool], label: str) -> list[int]:
        """The prompt with ``observation`` appended to its last message (TRL's rule), rendered and tokenized."""
        if isinstance(prompt, str):
            text = prompt + (observation or "")
        else:
            messages = list(prompt)
            if observation is not None:
                messages[-1] = {**messages[-1], "content": messages[-1]["content"] + observation}
            kwargs = dict(self.template_kwargs)
            if tools:
                kwargs["tools"] = [t.schema for t in tools.values()]
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) > self.max_prompt_length and self.truncation == "error":
            raise ValueError(
                f"{label}: the prompt after reset is {len(ids)} tokens, longer than data.max_prompt_length="
                f"{self.max_prompt_length} (data.truncation=error)"
            )
        return truncate(ids, self.max_prompt_length, self.truncation)


class EnvironmentSession:
    """The environments of one batch of episodes (local to one ``generate`` call)."""

    def __init__(self, environments: EnvironmentSet):
        self.environments = environments
        self.starts: list[EpisodeStart] = []
        self._instances: list = []
        self._classes: list[EnvironmentClass | None] = []
        self._seeds: list[int] = []
        self._tool_errors: list[int] = []

    def start(self, episode, record, seed: int) -> None:
        envs = self.environments
        env = environment_of(envs.classes, record.columns, f"row uid={record.uid}")
        instance, error, observation = None, None, None
        try:
            instance = env.factory()
            with seeded_globals(seed):
                observation = instance.reset(**reset_kwargs(env, record.columns, seed))
            if observation is not None and not isinstance(observation, str):
                raise TypeError(f"reset returned {type(observation).__name__}, not a string or None")
        except Exception as e:
            error = f"{env.label}.reset: {type(e).__name__}: {e}"
        if error is None:
            tools = {**envs.standalone, **env.tools(instance)}
            ids = envs.prompt_ids(record.prompt, observation, tools, env.label)
            start = EpisodeStart(ids, tools, env.label)
        else:
            start, instance = EpisodeStart(list(episode.prompt_ids), None, env.label, error), None
        self.starts.append(start)
        self._instances.append(instance)
        self._classes.append(env)
        self._seeds.append(seed)
        self._tool_errors.append(0)

    def goes_on(self, index: int, calls: Sequence[ToolCall], results: Sequence[ToolResult]) -> bool:
        """False when one of the environment's own tools raised in this turn (its state is then unknown)."""
        env = self._classes[index]
        own = {s["function"]["name"] for s in env.schemas} if self._instances[index] is not None else set()
        failed = sum(r.status != "ok" and c.name in own for c, r in zip(calls, results))
        self._tool_errors[index] += failed
        return not failed

    def finish(self, episodes: Sequence) -> None:
        """Each episode's environment label, instance (None when its reset raised), errors and ``get_reward()``
        (None without one), in canonical order."""
        for i, episode in enumerate(episodes):
            env, instance, start = self._classes[i], self._instances[i], self.starts[i]
            episode.environment = start.environment
            episode.environment_instance = instance
            episode.environment_errors += (start.error is not None) + self._tool_errors[i]
            if not env.has_reward:
                continue
            episode.environment_reward = 0.0
            if instance is None:
                continue
            try:
                with seeded_globals(episode_seed(self._seeds[i], 0, 0, 0, 0, "reward")):
                    value = call_maybe_async(instance.get_reward)
                if not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                    raise TypeError(f"returned {value!r:.40}, not a finite number")
                episode.environment_reward = float(value)
            except Exception:
                episode.environment_errors += 1
