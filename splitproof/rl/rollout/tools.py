"""Tools a multi-turn episode can call, in the conventions users already have.

- ``function_tool_path``: a Python file (or ``pkg://package.module``); each public function defined in it
  (name not starting with ``_``), sync or ``async``, is a tool. Its JSON schema is derived from its type
  hints and Google-style docstring by ``transformers.utils.get_json_schema`` (what TRL's ``tools=`` and
  verl use), so every parameter needs a type hint and a line under ``Args:``.
- ``tool_config_path``: verl's tool YAML, ``tools: [{class_name, config, tool_schema}]``. ``class_name`` is
  a dotted path (``package.module.name``, or ``path/to/file.py:name``) to a plain function (its
  ``tool_schema``, when given, replaces the derived one) or to a class in verl's ``BaseTool`` shape:
  built as ``cls(config=..., tool_schema=...)``, called through ``create`` / ``execute`` / ``release``
  (each may be async; ``execute`` returns a response or a ``(response, reward, metrics)`` tuple).

A call's result becomes the tool-response text: a string as is, an object with a ``text`` attribute (verl's
``ToolResponse``) its text, anything else as JSON (``json.dumps``, non-ASCII kept) or, when that fails,
``str()``. A call that raises (unknown tool, arguments that are not a JSON object, an error inside the
tool, ``sys.exit`` in the tool) gives ``"Error when executing tool: <error>"`` (verl's text); one that
exceeds ``tool_timeout`` gives ``"Error when executing tool: timed out after <s> s"`` and is abandoned on
its daemon thread (``rl/rollout/tool_runner.py`` runs the calls). Texts longer than
``max_tool_response_length`` characters are cut as verl cuts them (``tool_response_truncate_side``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...loss_config import ConfigError

KEY = "actor_rollout_ref.rollout.multi_turn"
ERROR_PREFIX = "Error when executing tool: "


@dataclass(frozen=True)
class Tool:
    """A callable tool: ``run(arguments)`` → the result; ``schema`` the OpenAI function schema; ``sync``: a plain
    function (not a coroutine function), which a quick call may run on the generating thread
    (``rl/rollout/tool_runner.py``)."""

    name: str
    schema: dict
    run: Callable[[dict], Any]
    sync: bool = False


@dataclass(frozen=True)
class ToolCall:
    """One call as parsed from a model turn: the name and the arguments as JSON text (verl's form)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolResult:
    """The text appended for one call; ``status``: ``ok`` | ``error`` | ``timeout``."""

    text: str
    status: str


# ------------------------------------------------------------------------------------------ loading


def _run_maybe_async(fn: Callable, *args, **kwargs) -> Any:
    result = fn(*args, **kwargs)
    return asyncio.run(result) if inspect.isawaitable(result) else result


def function_schema(fn: Callable, where: str) -> dict:
    """The schema ``get_json_schema`` derives; ``ConfigError`` naming the function and what is missing."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # TypeHintParsingException, DocstringParsingException, ...
        raise ConfigError(where, f"tool {fn.__name__!r}: {e}") from None


def function_tool(fn: Callable, where: str, schema: dict | None = None) -> Tool:
    schema = schema or function_schema(fn, where)
    sync = not inspect.iscoroutinefunction(fn)
    return Tool(schema["function"]["name"], schema, lambda args: _run_maybe_async(fn, **args), sync)


def import_file(path: str, where: str):
    """The module of a file path (``file://`` optional) or of ``pkg://package.module``."""
    if path.startswith("pkg://"):
        try:
            return importlib.import_module(path[len("pkg://") :])
        except Exception as e:
            raise ConfigError(where, f"{path} failed to import: {type(e).__name__}: {e}") from None
    file = Path(path.removeprefix("file://")).expanduser()
    if not file.is_file():
        raise ConfigError(where, f"{path}: no such file")
    name = f"splitproof_tools_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # a user file: any error (SyntaxError, ImportError, SystemExit) is theirs
        del sys.modules[name]
        raise ConfigError(where, f"{path} failed to import: {type(e).__name__}: {e}") from None
    return module


def load_function_tools(path: str) -> list[Tool]:
    """Every public function defined in the file ``path``, as a tool (sorted by name)."""
    where = f"{KEY}.function_tool_path"
    module = import_file(path, where)
    functions = [
        obj
        for name, obj in sorted(vars(module).items())
        if not name.startswith("_") and inspect.isfunction(obj) and obj.__module__ == module.__name__
    ]
    if not functions:
        raise ConfigError(where, f"{path} defines no public function")
    return [function_tool(fn, where) for fn in functions]


def resolve_object(class_name: str, where: str):
    if ":" in class_name:
        path, _, attr = class_name.rpartition(":")
        module = import_file(path, where)
    else:
        module_name, _, attr = class_name.rpartition(".")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise ConfigError(
                where, f"unknown class {class_name!r}: cannot import {module_name!r} ({type(e).__name__}: {e})"
            ) from None
    if not attr or not hasattr(module, attr):
        raise ConfigError(where, f"unknown class {class_name!r}: {attr!r} not found")
    return getattr(module, attr)


def _class_tool(cls, config: dict, schema: dict | None, where: str) -> Tool:
    """A tool in verl's ``BaseTool`` shape: create → execute → release per call."""
    try:
        instance = cls(config=config, tool_schema=schema)
    except Exception as e:
        raise ConfigError(
            where, f"{cls.__name__}(config=..., tool_schema=...) failed: {type(e).__name__}: {e}"
        ) from None
    if not callable(getattr(instance, "execute", None)):
        raise ConfigError(where, f"{cls.__name__} has no execute method")
    schema = schema or getattr(instance, "tool_schema", None)
    if hasattr(schema, "model_dump"):
        schema = schema.model_dump(exclude_unset=True, exclude_none=True)
    if not isinstance(schema, dict) or "function" not in schema:
        raise ConfigError(where, f"{cls.__name__}: needs a tool_schema (an OpenAI function schema)")

    def run(args: dict) -> Any:
        async def call():
            instance_id = None
            if hasattr(instance, "create"):
                created = instance.create()
                created = await created if inspect.isawaitable(created) else created
                instance_id = created[0] if isinstance(created, tuple) else created
            try:
                result = instance.execute(instance_id, args)
                result = await result if inspect.isawaitable(result) else result
            finally:
                if hasattr(instance, "release"):
                    released = instance.release(instance_id)
                    if inspect.isawaitable(released):
                        await released
            return result[0] if isinstance(result, tuple) else result

        return asyncio.run(call())

    return Tool(name=schema["function"]["name"], schema=schema, run=run)


def load_tool_config(path: str) -> list[Tool]:
    """The tools of verl's tool YAML ``path``."""
    from omegaconf import OmegaConf

    where = f"{KEY}.tool_config_path"
    try:
        entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True).get("tools")
    except Exception as e:
        raise ConfigError(where, f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(where, f"{path}: needs a non-empty list under 'tools'")
    tools = []
    for i, entry in enumerate(entries):
        at = f"{where} ({path}, tools[{i}])"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ConfigError(at, "each tool needs a class_name")
        target = resolve_object(entry["class_name"], at)
        schema = entry.get("tool_schema")
        if inspect.isclass(target):
            tools.append(_class_tool(target, entry.get("config") or {}, schema, at))
        elif callable(target):
            tools.append(function_tool(target, at, schema))
        else:
            raise ConfigError(at, f"{entry['class_name']!r} is neither a class nor a function")
    return tools


def load_tools(function_tool_path: str | None, tool_config_path: str | None) -> dict[str, Tool]:
    """The configured tools by name (``ConfigError`` for a duplicate name)."""
    tools = (load_function_tools(function_tool_path) if function_tool_path else []) + (
        load_tool_config(tool_config_path) if tool_config_path else []
    )
    by_name: dict[str, Tool] = {}
    for tool in tools:
        if tool.name in by_name:
            raise ConfigError(KEY, f"two tools are named {tool.name!r}")
        by_name[tool.name] = tool
    return by_name


# ------------------------------------------------------------------------------------------ calling


def result_text(result: Any) -> str:
    """A tool's result as text: str as is, ``.text`` (verl's ToolResponse), else JSON, else ``str()``."""
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    if isinstance(text, str):
        return text
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def truncate(text: str, limit: int, side: str) -> str:
    """verl's cut of a long tool response: ``left`` keeps the first ``limit`` characters, ``right`` the
    last, ``middle`` ``limit // 2`` of each end."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[-half:]


def call_tool(tools: dict[str, Tool], call: ToolCall) -> ToolResult:
    """Run one call to completion; anything it raises becomes verl's error text. ``SystemExit`` (a tool
    calling ``sys.exit``) and a ``KeyboardInterrupt`` the tool raises itself are failures like any other
    (``Error when executing tool: SystemExit(0)``); a ``KeyboardInterrupt`` on the main thread is the
    user's Ctrl-C and propagates."""
    try:
        if call.name not in tools:
            raise KeyError(f"unknown tool {call.name!r}")
        args = json.loads(call.arguments)
        if not isinstance(args, dict):
            raise TypeError(f"arguments must be a JSON object, got {call.arguments!r}")
        return ToolResult(result_text(tools[call.name].run(args)), "ok")
    except Exception as e:
        return ToolResult(f"{ERROR_PREFIX}{e}", "error")
    except BaseException as e:  # SystemExit, KeyboardInterrupt, asyncio.CancelledError, ...
        if isinstance(e, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
            raise
        return ToolResult(f"{ERROR_PREFIX}{e!r}", "error")
