"""Reward functions: loading them (verl's path forms), calling them as verl or TRL does, checking what
they return.

Two calling conventions, told apart by the function's parameter names (or forced with ``convention``):

- verl: ``compute_score(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs)``,
  called once per sample with keyword arguments; returns a number, or a dict with ``"score"`` and extra
  metrics. ``extra_info`` is passed only when the function takes it (verl always passes it).
- TRL: ``fn(prompts, completions, **kwargs) -> list[float | None]``, called once per batch. ``prompts``
  and ``completions`` are strings for plain prompts; for chat prompts the prompt is the message list and
  each completion ``[{"role": "assistant", "content": text}]``. Keyword arguments: every other dataset
  column (one value per completion; TRL leaves out ``prompt``, ``completion``, ``completion_ids``),
  ``completion_ids`` (the response token ids, EOS included when generation stopped on it) and
  ``trainer_state`` (an object with ``global_step`` and ``max_steps``).

The response text is the response tokens without the final EOS, decoded with ``skip_special_tokens``.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from ..data import reasoning_gym
from . import rules

CONVENTIONS = ("verl", "trl")
PKG_PREFIX, FILE_PREFIX = "pkg://", "file://"
TRL_RESERVED = ("prompt", "completion", "completion_ids")  # columns TRL does not pass as keyword arguments
GROUND_TRUTH_COLUMNS = ("ground_truth", "answer", "solution")


class RewardError(ValueError):
    """A reward function cannot be loaded, does not fit the data, or misbehaved on a sample."""


class SampleLike(Protocol):
    """What scoring needs of a rollout ``Sample``."""

    uid: int
    sample_index: int
    response_ids: Sequence[int]
    finished: bool


@dataclass(frozen=True)
class TrainerState:
    """What TRL's ``trainer_state`` offers reward functions here: the step and the planned number of steps."""

    global_step: int
    max_steps: int


@dataclass(frozen=True)
class RewardFunction:
    """A callable with its calling convention, a name for messages, and fixed extra keyword arguments."""

    fn: Callable
    name: str
    convention: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class RewardResult:
    """``scores[i]`` is sample i's reward; ``extra[key][i]`` its extra metric; ``responses[i]`` its text."""

    scores: torch.Tensor
    extra: dict[str, list[float]]
    responses: list[str]


# ---------------------------------------------------------------------------------------------------------
# Loading


def _parameters(fn: Callable, name: str) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        message = f"reward function {name}: cannot read its signature; pass convention='verl' or 'trl'"
        raise RewardError(message) from None


def _takes_any_keyword(params: dict[str, inspect.Parameter]) -> bool:
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _keyword_names(params: dict[str, inspect.Parameter]) -> set[str]:
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {n for n, p in params.items() if p.kind in kinds}


def detect_convention(fn: Callable, name: str = "reward function") -> str:
    """``"verl"`` if the function names ``solution_str`` or ``data_source``; ``"trl"`` if it names
    ``completions``; anything else is an error asking to say which."""
    names = set(_parameters(fn, name))
    verl = bool(names & {"solution_str", "data_source"})
    trl = "completions" in names
    if verl != trl:
        return "verl" if verl else "trl"
    raise RewardError(
        f"reward function {name}: cannot tell its calling convention from its parameters ({', '.join(names)}); "
        "verl's is compute_score(data_source, solution_str, ground_truth, extra_info=None), TRL's is "
        "fn(prompts, completions, **kwargs); pass convention='verl' or 'trl'"
    )


def _load_module(path: str):
    """The module a verl path names: ``pkg://package.module`` (or ``pkg://package/module``), ``file://PATH``
    or a file path."""
    if path.startswith(PKG_PREFIX):
        module_name = path[len(PKG_PREFIX) :].replace("/", ".").strip(".")
        try:
            return importlib.import_module(module_name)
        except Exception as err:
            message = f"reward module {path}: cannot import {module_name}: {type(err).__name__}: {err}"
            raise RewardError(message) from None
    file = Path(path[len(FILE_PREFIX) :] if path.startswith(FILE_PREFIX) else path).expanduser()
    if not file.is_file():
        raise RewardError(f"reward function file {path}: not found")
    module_name = "splitproof_reward_" + hashlib.sha1(str(file.resolve()).encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward function file {path}: not a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # so dataclasses and pickling inside the file work
    try:
        spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        if not isinstance(err, Exception):
            raise
        raise RewardError(f"reward function file {path}: importing it failed: {type(err).__name__}: {err}") from None
    return module


def load_reward_function(
    path: str | os.PathLike,
    name: str | None = "compute_score",
    *,
    convention: str | None = None,
    reward_kwargs: dict | None = None,
) -> RewardFunction:
    """verl's ``custom_reward_function.path`` / ``.name`` (+ ``.reward_kwargs``) → a checked RewardFunction.

    ``convention`` None detects it from the parameter names. Errors (file missing, import failing, no
    such function, a signature that cannot take the convention's arguments) are ``RewardError``.
    """
    path = os.fspath(path) if path is not None else ""
    if not path:
        raise RewardError("custom_reward_function.path is empty")
    name = name or "compute_score"
    if convention is not None and convention not in CONVENTIONS:
        raise RewardError(f"reward convention must be one of {', '.join(CONVENTIONS)}, got {convention!r}")
    module = _load_module(path)
    fn = getattr(module, name, None)
    label = f"{name} ({path})"
    if fn is None:
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise RewardError(
            f"reward function file {path}: no function {name!r} (custom_reward_function.name); "
            f"it defines: {', '.join(found) or 'no functions'}"
        )
    if not callable(fn):
        raise RewardError(f"reward function {label}: {name!r} is a {type(fn).__name__}, not a function")
    convention = convention or detect_convention(fn, label)
    if convention == "verl":
        _check_verl_signature(fn, label, reward_kwargs or {})
    return RewardFunction(fn=fn, name=label, convention=convention, kwargs=dict(reward_kwargs or {}))


def _check_verl_signature(fn: Callable, label: str, reward_kwargs: dict) -> None:
    params = _parameters(fn, label)
    if _takes_any_keyword(params):
        return
    missing = {"data_source", "solution_str", "ground_truth"} - _keyword_names(params)
    if missing:
        raise RewardError(
            f"reward function {label}: verl calls compute_score(data_source=, solution_str=, ground_truth=, "
            f"extra_info=); this function does not take {', '.join(sorted(missing))}"
        )
    extra = set(reward_kwargs) - _keyword_names(params)
    if extra:
        raise RewardError(
            f"reward function {label}: custom_reward_function.reward_kwargs passes {', '.join(sorted(extra))}, "
            "which it does not take; add the parameter (or **kwargs)"
        )


def _rule_function(rule: Callable[[str, Any], float], answer: Callable[[str], str | None] | None) -> Callable:
    """verl's ``compute_score`` of a rule: the score, with the answer it compared as ``pred`` when known."""

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        if answer is None:
            return rule(solution_str, ground_truth)
        return {"score": rule(solution_str, ground_truth), "pred": rules.answer_id(answer(solution_str))}

    return compute_score


def default_reward_for(data_source: str) -> RewardFunction:
    """The built-in rule for a ``data_source`` (verl convention); an unknown one is a ``RewardError``."""
    if data_source.startswith(reasoning_gym.SOURCE_PREFIX):  # the task's own score_answer
        return RewardFunction(fn=reasoning_gym.compute_score, name=f"reasoning-gym's {data_source}", convention="verl")
    rule = rules.RULES.get(data_source)
    if rule is None:
        what = f"data_source {data_source!r} has" if data_source else "rows without a data_source have"
        raise RewardError(
            f"{what} no built-in reward rule; name a reward function (custom_reward_function.path and .name) "
            f"or use a data_source with a rule: {', '.join(rules.RULES)}"
        )
    return RewardFunction(
        fn=_rule_function(rule, rules.ANSWERS.get(data_source)),
        name=f"built-in rule for {data_source!r}",
        convention="verl",
    )


# ---------------------------------------------------------------------------------------------------------
# Checking a dataset against a reward function, before any model is loaded


def ground_truth_of(columns: dict) -> Any:
    """verl's ``reward_model.ground_truth``; else TRL's first column of ``ground_truth``/``answer``/``solution``."""
    reward_model = columns.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        return reward_model["ground_truth"]
    for key in GROUND_TRUTH_COLUMNS:
        if columns.get(key) is not None:
            return columns[key]
    return None


def trl_keyword_names(column_names) -> set[str]:
    """The keyword arguments a TRL reward function receives for rows with these columns."""
    return {c for c in column_names if c not in TRL_RESERVED} | {"completion_ids", "trainer_state"}


def check_reward_sources(dataset, reward_fn: RewardFunction | None) -> None:
    """Fail now, naming the data source or row, if scoring ``dataset`` would fail for want of a rule, a
    ground truth, an optional package, or a parameter the reward function does not take."""
    if reward_fn is None:
        for source, uid in dataset.data_sources.items():
            try:
                default_reward_for(source)
            except RewardError as err:
                raise RewardError(f"{dataset.origin(uid)}: {err}") from None
            needs_math_verify = rules.RULES.get(source) is rules.math_verify_score
            if needs_math_verify and not rules.math_verify_available():
                raise RewardError(
                    f"{dataset.origin(uid)}: data_source {source!r} is scored with math-verify, which is not "
                    f"installed: {rules.MATH_VERIFY_HINT}"
                )
        for record in dataset:
            if ground_truth_of(record.columns) is None:
                raise RewardError(
                    f"{dataset.origin(record.uid)}: no ground truth for the built-in rule of {record.data_source!r} "
                    f"(reward_model.ground_truth, or a column {', '.join(GROUND_TRUTH_COLUMNS)})"
                )
        return
    if reward_fn.convention == "trl":
        params = _parameters(reward_fn.fn, reward_fn.name)
        if _takes_any_keyword(params):
            return
        wanted = trl_keyword_names(dataset.column_names) | {"prompts", "completions"} | set(reward_fn.kwargs)
        missing = wanted - _keyword_names(params)
        if missing:
            raise RewardError(
                f"reward function {reward_fn.name}: TRL passes it {', '.join(sorted(missing))} for this dataset, "
                "which it does not take; add **kwargs to its parameters"
            )


# ---------------------------------------------------------------------------------------------------------
# Scoring


def response_text(tokenizer, sample: SampleLike) -> str:
    """The response without its final EOS (when generation stopped on it), special tokens skipped."""
    ids = list(sample.response_ids)
    if sample.finished and ids:
        ids = ids[:-1]
    return tokenizer.decode(ids, skip_special_tokens=True)


def _number(value) -> float | None:
    """A real number as float, or None when ``value`` is not one (str, None, containers, ...)."""
    if type(value) is float or type(value) is int:  # the common case, without the ABC checks below
        return float(value)
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real):  # bool, int, float, NumPy scalars
        return float(value)
    if hasattr(value, "shape") and getattr(value, "shape", None) == () and hasattr(value, "item"):
        return _number(value.item())  # a 0-d NumPy array
    return None


def _where(sample: SampleLike) -> str:
    return f"sample (uid={sample.uid}, index={sample.sample_index})"


def _checked_score(value, reward_fn: RewardFunction, sample: SampleLike) -> float:
    number = _number(value)
    if number is None:
        raise RewardError(
            f"reward function {reward_fn.name} returned {type(value).__name__} {value!r:.80} for {_where(sample)}; "
            "expected a number"
        )
    if not math.isfinite(number):
        raise RewardError(
            f"reward function {reward_fn.name} returned {number} for {_where(sample)}; expected a finite number"
        )
    return number


@functools.lru_cache(maxsize=64)
def _takes_extra_info(fn: Callable) -> bool:
    params = _parameters(fn, getattr(fn, "__name__", "reward function"))
    return "extra_info" in params or _takes_any_keyword(params)


def _call_verl(reward_fn: RewardFunction, record, sample: SampleLike, text: str, more: dict) -> tuple[float, dict]:
    kwargs = {
        "data_source": record.data_source,
        "solution_str": text,
        "ground_truth": ground_truth_of(record.columns),
        **more,
    }
    if _takes_extra_info(reward_fn.fn):
        kwargs["extra_info"] = dict(record.columns.get("extra_info") or {})
    try:
        result = reward_fn.fn(**{**kwargs, **reward_fn.kwargs})  # verl's merge: reward_kwargs win
    except Exception as err:
        raise RewardError(
            f"reward function {reward_fn.name} raised {type(err).__name__}: {err} on {_where(sample)}"
        ) from err
    if isinstance(result, dict):
        if "score" not in result:
            raise RewardError(
                f"reward function {reward_fn.name} returned a dict without 'score' for {_where(sample)} "
                f"(keys: {', '.join(map(str, result))})"
            )
        extra = {str(k): _number(v) for k, v in result.items() if k != "score"}
        return _checked_score(result["score"], reward_fn, sample), {k: v for k, v in extra.items() if v is not None}
    return _checked_score(result, reward_fn, sample), {}


def _call_trl(reward_fn, records, samples, texts, step: int, max_steps: int, more: list[dict]) -> list[float]:
    chat = [not isinstance(r.prompt, str) for r in records]
    columns = {}
    for record in records:
        for key in record.columns:
            if key not in TRL_RESERVED:
                columns.setdefault(key, None)
    kwargs = {key: [r.columns.get(key) for r in records] for key in columns}
    kwargs["completion_ids"] = [list(s.response_ids) for s in samples]
    kwargs["trainer_state"] = TrainerState(global_step=step, max_steps=max_steps)
    kwargs.update({key: [m[key] for m in more] for key in (more[0] if more else {})})
    completions = [[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat)]
    prompts = [r.prompt for r in records]
    batch = f"a batch of {len(samples)} samples (first: {_where(samples[0])})"
    try:
        result = reward_fn.fn(**{"prompts": prompts, "completions": completions, **kwargs, **reward_fn.kwargs})
        if inspect.isawaitable(result):
            result = asyncio.run(result)
    except Exception as err:
        raise RewardError(f"reward function {reward_fn.name} raised {type(err).__name__}: {err} on {batch}") from err
    if isinstance(result, (str, bytes, dict)) or not hasattr(result, "__len__"):
        raise RewardError(
            f"reward function {reward_fn.name} returned {type(result).__name__} for {batch}; TRL reward "
            "functions return one value per completion"
        )
    values = list(result)
    if len(values) != len(samples):
        raise RewardError(f"reward function {reward_fn.name} returned {len(values)} values for {batch}")
    scores, skipped = [], []
    for value, sample in zip(values, samples):
        if value is None:  # TRL: not applicable; with one function its nan-sum is 0
            skipped.append(sample)
            scores.append(0.0)
        else:
            scores.append(_checked_score(value, reward_fn, sample))
    if skipped:
        warnings.warn(
            f"reward function {reward_fn.name} returned None for {len(skipped)} samples (first: "
            f"{_where(skipped[0])}); they score 0.0, as TRL's sum over reward functions gives",
            stacklevel=3,
        )
    return scores


def score(
    reward_fn: RewardFunction | None,
    records,
    samples: Sequence[SampleLike],
    tokenizer,
    *,
    step: int,
    max_steps: int,
    sample_kwargs: Sequence[dict] | None = None,
) -> RewardResult:
    """Score every sample. ``records`` holds the prompt record of every sample's uid (any order, repeats
    allowed); ``reward_fn`` None uses each row's built-in rule by ``data_source``. Any misbehaviour of the
    function is a ``RewardError`` naming it and the sample; nothing is returned then. ``sample_kwargs[i]``:
    more keyword arguments for sample i (a reward model's ``rm_score``; a list per name for TRL)."""
    by_uid = {record.uid: record for record in records}
    missing = [s for s in samples if s.uid not in by_uid]
    if missing:
        raise RewardError(f"score: no prompt record for {_where(missing[0])}")
    rows = [by_uid[s.uid] for s in samples]
    texts = [response_text(tokenizer, s) for s in samples]
    extras: list[dict] = [{} for _ in samples]
    more = list(sample_kwargs) if sample_kwargs is not None else [{} for _ in samples]
    if reward_fn is not None and reward_fn.convention == "trl":
        values = _call_trl(reward_fn, rows, samples, texts, step, max_steps, more) if samples else []
    else:
        values = []
        rules: dict[str, RewardFunction] = {}
        for i, (record, sample, text) in enumerate(zip(rows, samples, texts)):
            fn = reward_fn
            if fn is None:
                if record.data_source not in rules:
                    try:
                        rules[record.data_source] = default_reward_for(record.data_source)
                    except RewardError as err:
                        raise RewardError(f"{_where(sample)}: {err}") from None
                fn = rules[record.data_source]
            value, extras[i] = _call_verl(fn, record, sample, text, more[i])
            values.append(value)
    keys = dict.fromkeys(k for extra in extras for k in extra)
    extra = {k: [e.get(k, math.nan) for e in extras] for k in keys}
    return RewardResult(scores=torch.tensor(values, dtype=torch.float64, device="cpu"), extra=extra, responses=texts)
