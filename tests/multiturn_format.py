"""A tool-call format for tests only: every digit of a turn (in order) is a call ``lookup(key=digit)``, so
that a tiny random model calls tools often. Installed in place of ``simple`` by ``digit_calls()``."""

from __future__ import annotations

import json

from splitproof.rl.rollout import tool_format
from splitproof.rl.rollout.tools import ToolCall


class DigitFormat(tool_format.SimpleFormat):
    def parse(self, ids):
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [ToolCall("lookup", json.dumps({"key": c})) for c in text if c.isdigit()], 0


def digit_calls(monkeypatch) -> None:
    monkeypatch.setitem(tool_format.FORMATS, "simple", DigitFormat)
