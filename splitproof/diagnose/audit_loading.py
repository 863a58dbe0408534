"""Loading the policy-loss function an audit runs: ``"package.module:function"`` or ``"file.py:function"``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from typing import Any

from .verl_convention import one_line


def load_loss_fn(spec: str) -> Callable:
    """Resolve ``"package.module:function"`` (or ``"path/to/file.py:function"``) to a callable.

    The part after the colon may be dotted (``module:Class.method``). The current directory is importable,
    as with ``python -m``. Raises ValueError with a one-line message when the spec is malformed, the module
    cannot be imported, the attribute is missing or the object is not callable.
    """
    if not isinstance(spec, str) or spec.count(":") != 1:
        raise ValueError(f"malformed loss function {spec!r}: expected 'package.module:function'")
    module_name, attr_path = (part.strip() for part in spec.split(":"))
    attrs = attr_path.split(".")
    if not module_name or not attr_path or not all(a.isidentifier() for a in attrs):
        raise ValueError(f"malformed loss function {spec!r}: expected 'package.module:function'")

    if module_name.endswith(".py"):
        module = _load_file(module_name, spec)
    else:
        if not all(part.isidentifier() for part in module_name.split(".")):
            raise ValueError(f"malformed loss function {spec!r}: {module_name!r} is not a module name")
        cwd = os.getcwd()
        added = cwd not in sys.path and "" not in sys.path
        if added:
            sys.path.insert(0, cwd)
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # any failure while importing user code is a one-line user error
            raise ValueError(f"cannot import module {module_name!r} for {spec!r}: {one_line(exc)}") from None
        finally:
            if added:
                try:
                    sys.path.remove(cwd)
                except ValueError:
                    pass

    obj: Any = module
    for i, name in enumerate(attrs):
        if not hasattr(obj, name):
            where = module_name if i == 0 else f"{module_name}:{'.'.join(attrs[:i])}"
            raise ValueError(f"{where!r} has no attribute {name!r} (from {spec!r})")
        obj = getattr(obj, name)
    if not callable(obj):
        raise ValueError(f"{spec!r} is not callable (it is a {type(obj).__name__})")
    return obj


def _load_file(path: str, spec: str):
    if not os.path.isfile(path):
        raise ValueError(f"cannot import {spec!r}: no such file {path!r}")
    name = "_splitproof_audit_" + os.path.splitext(os.path.basename(path))[0]
    try:
        file_spec = importlib.util.spec_from_file_location(name, path)
        if file_spec is None or file_spec.loader is None:
            raise ImportError(f"cannot load {path}")
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"cannot import {path!r} for {spec!r}: {one_line(exc)}") from None
    return module


def verl_importable() -> bool:
    """Whether a ``verl`` package can be imported here."""
    try:
        return importlib.util.find_spec("verl") is not None
    except (ImportError, ValueError):
        return False


def function_name(fn: Callable) -> str:
    """``module:qualname`` of a callable (how a report names it by default)."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return f"{module}:{name}"
