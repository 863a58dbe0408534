"""Tool-call formats: how calls are read from a model turn's token ids, and how tool responses become the
token ids appended after it (never a re-tokenization of what the model generated).

- ``hermes`` (verl's): the turn is decoded as is; each ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  is a call (both tags must be present; a block that is not such JSON is skipped and counted as malformed).
  The responses are the messages ``{"role": "tool", "content": text}`` and the generation prompt, as the
  tokenizer's chat template renders them after an assistant turn: the text after that turn's EOS (so the
  template's separator after the EOS is kept; rendering the tool messages alone, as verl does, drops it
  and, for templates that add a default system prompt, needs it cut off again).
- ``simple`` (small models such as the built-in character model): the turn, special tokens dropped and
  whitespace stripped, is a call when it reads ``name(a, b, ...)``; the arguments are matched to the
  tool's parameters in schema order and converted to their JSON types (integer, number, boolean, else
  the text). The response of each call is appended as ``"=" + text + "\\n"``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from ...loss_config import ConfigError
from .tools import KEY, Tool, ToolCall

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MARK = "\x00splitproof-turn\x00"  # a placeholder assistant turn, found again in the rendered text
_SIMPLE = re.compile(r"^([A-Za-z_]\w*)\((.*)\)$", re.DOTALL)


class HermesFormat:
    def __init__(self, tokenizer, tools: dict[str, Tool]):
        self.tokenizer = tokenizer

    def parse(self, ids: list[int]) -> tuple[list[ToolCall], int]:
        """The calls in a turn and the number of malformed ``<tool_call>`` blocks."""
        text = self.tokenizer.decode(ids)
        if "<tool_call>" not in text or "</tool_call>" not in text:
            return [], 0
        calls, malformed = [], 0
        for block in _HERMES.findall(text):
            try:
                call = json.loads(block)
                calls.append(ToolCall(str(call["name"]), json.dumps(call["arguments"], ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                malformed += 1
        return calls, malformed

    def render(self, texts: list[str]) -> list[int]:
        """The ids the chat template puts after an assistant turn's EOS for these tool messages and the
        next generation prompt (the separator after the EOS included)."""
        return render_after_turn(self.tokenizer, [{"role": "tool", "content": t} for t in texts])


def render_after_turn(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """The ids the chat template puts after an assistant turn's EOS for ``messages`` and the next
    generation prompt (the separator after the EOS included): the turn is a placeholder found again in the
    rendered text, so the model's own ids before it are never re-tokenized."""
    before = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
    full = tokenizer.apply_chat_template(
        before + list(messages), add_generation_prompt=True, tokenize=False, **template_kwargs
    )
    end = full.index(_MARK) + len(_MARK)
    eos = tokenizer.eos_token or ""
    if eos and full.startswith(eos, end):
        end += len(eos)
    return tokenizer.encode(full[end:], add_special_tokens=False)


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``tokenizer.encode(text, add_special_tokens=False)`` as a function of ``text``: the Rust tokenizer's own
    ``encode`` for a fast tokenizer whose encoding transformers does not change (no subclass override, no
    truncation or padding set on it, special tokens split as the tokenizer asks), which gives the same ids
    in about a quarter of the time (a tool reply is encoded per call); else ``tokenizer.encode``."""
    from transformers import PreTrainedTokenizerFast

    backend, cls = getattr(tokenizer, "_tokenizer", None), type(tokenizer)
    plain = isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None)
        for name in ("encode", "_encode_plus", "_batch_encode_plus", "tokenize")
    )
    if plain and backend.truncation is None and backend.padding is None:
        split = bool(getattr(tokenizer, "split_special_tokens", False))
        if getattr(backend, "encode_special_tokens", False) == split:
            return lambda text: backend.encode(text, add_special_tokens=False).ids
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


class SimpleFormat:
    def __init__(self, tokenizer, tools: dict[str, Tool]):
        self.tokenizer, self.tools = tokenizer, tools
        self.encode = plain_encoder(tokenizer)

    def parse(self, ids: list[int]) -> tuple[list[ToolCall], int]:
        match = _SIMPLE.match(self.tokenizer.decode(ids, skip_special_tokens=True).strip())
        if not match:
            return [], 0
        name, raw = match.group(1), match.group(2)
        values = [v.strip() for v in raw.split(",")] if raw.strip() else []
        tool = self.tools.get(name)
        if tool is None:  # the runner answers with verl's error text
            return [ToolCall(name, "{}")], 0
        properties = tool.schema["function"].get("parameters", {}).get("properties", {})
        args = {}
        for (param, spec), value in zip(properties.items(), values):
            args[param] = _convert(value, spec.get("type"))
        if len(values) > len(properties):  # too many: the call fails with the tool's own TypeError
            args.update({f"_extra_{i}": v for i, v in enumerate(values[len(properties) :])})
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))], 0

    def render(self, texts: list[str]) -> list[int]:
        return self.encode("".join(f"={t}\n" for t in texts))


def _convert(value: str, kind) -> object:
    try:
        if kind == "integer":
            return int(value)
        if kind == "number":
            return float(value)
        if kind == "boolean" and value.lower() in ("true", "false"):
            return value.lower() == "true"
    except ValueError:
        pass
    return value


FORMATS = {"hermes": HermesFormat, "simple": SimpleFormat}


def check_tool_template(format_name: str, tokenizer, tools: dict[str, Tool], model_cfg) -> None:
    """Render a probe tool turn the way episodes will (``hermes``: the chat template with a ``tool``
    message) once, before any model: ``ConfigError`` naming the template (``model_cfg``:
    ``actor_rollout_ref.model``, where it comes from) and the role when the template refuses it."""
    if format_name != "hermes" or not tools:
        return
    template = (
        "actor_rollout_ref.model.custom_chat_template"
        if model_cfg.custom_chat_template
        else f"the tokenizer of {model_cfg.tokenizer_path or model_cfg.path}"
    )
    try:
        HermesFormat(tokenizer, tools).render(["probe"])
    except Exception as e:  # jinja2's TemplateError, a template without the role, ...
        raise ConfigError(
            f"{KEY}.format",
            f"format=hermes renders tool responses as messages of role 'tool', "
            f"but the chat template ({template}) refuses them "
            f"({type(e).__name__}: {e}); use a template with a 'tool' role "
            f"(actor_rollout_ref.model.custom_chat_template) or format=simple",
        ) from None
