"""Hints about a run that works but does not do what its settings were meant for, said once per launch."""

from __future__ import annotations

from collections.abc import Sequence


def budget_hint(samples: Sequence, max_response_length: int, max_tool_response_length: int) -> str | None:
    """When every episode that called a tool ended unfinished on the tool's response (the response budget
    ran out before the model could answer), what to change; else None. Single-turn samples: None."""
    called = [e for e in samples if getattr(e, "tool_calls", 0) > 0]
    cut = [e for e in called if not e.finished and e.token_mask and e.token_mask[-1] == 0]
    if not called or len(cut) < len(called):
        return None
    return (
        f"every episode with a tool call ({len(cut)}) used up its data.max_response_length={max_response_length} "
        "tokens on the tool's response: the model never answered after its call; raise "
        "data.max_response_length, or shorten tool responses (actor_rollout_ref.rollout.multi_turn."
        f"max_tool_response_length={max_tool_response_length} characters)"
    )
