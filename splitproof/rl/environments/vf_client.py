"""The model as a verifiers environment sees it: an in-process, AsyncOpenAI-shaped client per episode,
backed by splitproof's rollout engine.

verifiers' ``OpenAIChatCompletionsClient`` wraps it unchanged; it posts ``/chat/completions`` bodies
(``client.post(path, body=..., cast_to=httpx.Response)``) and reads back an OpenAI chat completion with
vLLM's token fields (``prompt_token_ids``, ``choices[0].token_ids``, ``logprobs.content``).
``chat.completions.create(**body)`` answers the same for code that calls it directly.

Token in, token out: the episode's ids are kept here, never re-tokenized. Turn 0 is the messages rendered
with the chat template (with the environment's tools); at a later turn the messages must extend the
previous turn's (its prompt, then the assistant message returned), and only the new messages (the
environment's response) are rendered, as the template puts them after the model's EOS
(``tool_format.render_after_turn``); the next turn is generated from the kept ids plus those.

Generation is batched across episodes: ``Batcher`` holds each episode's request until every live episode
is waiting on the model, then generates them all (canonical order, ``HFRollout`` rows are computed
layout-independently, so the batch never changes a token). Token i of an episode draws the uniform of
position i of its stream (seed, stream, step, uid, sample index), environment tokens included.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from ..pause import pause_point
from ..rollout.hf import HFRollout, Sample, SamplingParams
from ..rollout.tool_format import HermesFormat, render_after_turn


class Batcher:
    """Every live episode's pending generation, run once all of them wait (or are done)."""

    def __init__(self, engine: HFRollout, params: SamplingParams, *, step: int, stream: int, live: int):
        self.engine, self.params, self.step, self.stream, self.live = engine, params, step, stream, live
        self.pending: list[tuple[tuple[int, int], list[int], int, int, asyncio.Future]] = []
        self.batches = 0

    async def generate(self, key: tuple[int, int], ids: list[int], position: int, budget: int) -> Sample:
        future = asyncio.get_running_loop().create_future()
        self.pending.append((key, ids, position, budget, future))
        self._flush_when_all_wait()
        return await future

    def done(self) -> None:
        """An episode finished: it will not ask again."""
        self.live -= 1
        self._flush_when_all_wait()

    def _flush_when_all_wait(self) -> None:
        if not self.pending or len(self.pending) < self.live:
            return
        batch, self.pending = sorted(self.pending, key=lambda p: p[0]), []
        self.batches += 1
        pause_point(f"step{self.step}:stream{self.stream}:vf{self.batches}")  # a kill test stops here mid-episode
        try:
            samples = self.engine.generate(
                [(uid, j, ids) for (uid, j), ids, _, _, _ in batch],
                self.params,
                step=self.step,
                stream=self.stream,
                positions=[p for _, _, p, _, _ in batch],
                budgets=[b for _, _, _, b, _ in batch],
            )
        except Exception as e:  # every waiting episode sees it
            for *_, future in batch:
                future.set_exception(e)
            return
        for (*_, future), sample in zip(batch, samples):
            future.set_result(sample)


@dataclass
class EpisodeTokens:
    """An episode's ids as generated and appended: ``token_mask`` 1 on the model's tokens."""

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    token_mask: list[int] = field(default_factory=list)
    finished: bool = False
    model_turns: int = 0
    environment_turns: int = 0
    messages: list[dict] = field(default_factory=list)  # the last turn's prompt + the assistant message


class NonLinearConversation(ValueError):
    """A turn's messages do not extend the previous turn's: there are no generated ids to continue."""


class _Completions:
    def __init__(self, client: EpisodeClient):
        self.client = client

    async def create(self, **body):
        from openai.types.chat import ChatCompletion

        return ChatCompletion.model_validate(await self.client.complete(body))


class _Chat:
    def __init__(self, client: EpisodeClient):
        self.completions = _Completions(client)


class EpisodeClient:
    """One episode's AsyncOpenAI-shaped client (``post``, ``chat.completions.create``, ``base_url``)."""

    base_url = "inprocess://splitproof/v1"

    def __init__(self, key: tuple[int, int], batcher: Batcher, tokenizer, budget: int, template_kwargs: dict):
        self.key, self.batcher, self.tokenizer, self.budget = key, batcher, tokenizer, budget
        self.template_kwargs = template_kwargs
        self.tokens = EpisodeTokens()
        self.chat = _Chat(self)
        self.format = HermesFormat(tokenizer, {})

    async def post(self, path: str, *, body: dict, cast_to=None, options=None, **kwargs):
        import httpx

        if not path.rstrip("/").endswith("chat/completions"):
            raise ValueError(f"the in-process client answers /chat/completions only, not {path}")
        return httpx.Response(200, content=json.dumps(await self.complete(body)).encode())

    async def close(self) -> None:
        return None

    def next_prompt(self, messages: list[dict], tools) -> list[int]:
        """The ids of this turn's prompt: the kept ids plus the new messages' (raises ``OverlongPromptError``
        when they would reach the response budget)."""
        t = self.tokens
        kwargs = dict(self.template_kwargs, **({"tools": tools} if tools else {}))
        if t.model_turns == 0:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
            t.prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
            return list(t.prompt_ids)
        if [_plain(m) for m in messages[: len(t.messages)]] != [_plain(m) for m in t.messages]:
            raise NonLinearConversation("this turn's messages do not extend the previous turn's")
        new = messages[len(t.messages) :]
        tail = render_after_turn(self.tokenizer, new, **kwargs) if new else []
        if len(t.response_ids) + len(tail) >= self.budget:
            from verifiers.errors import OverlongPromptError

            raise OverlongPromptError("the environment's response reaches data.max_response_length")
        t.response_ids += tail
        t.log_probs += [0.0] * len(tail)
        t.token_mask += [0] * len(tail)
        t.environment_turns += bool(tail)
        return t.prompt_ids + t.response_ids

    async def complete(self, body: dict) -> dict:
        """An OpenAI chat completion (with vLLM's token fields) for a ``/chat/completions`` body."""
        t, messages = self.tokens, [dict(m) for m in body["messages"]]
        ids = self.next_prompt(messages, body.get("tools"))
        left = self.budget - len(t.response_ids)
        sample = await self.batcher.generate(self.key, ids, len(t.response_ids), left)
        t.response_ids += sample.response_ids
        t.log_probs += sample.log_probs
        t.token_mask += [1] * len(sample.response_ids)
        t.finished, t.model_turns = sample.finished, t.model_turns + 1
        message = self.message(sample, bool(body.get("tools")))
        t.messages = messages + [message]
        finish = "tool_calls" if message.get("tool_calls") else ("stop" if sample.finished else "length")
        return {
            "id": f"splitproof-{self.key[0]}-{self.key[1]}-{t.model_turns - 1}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", ""),
            "prompt_token_ids": ids,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": finish,
                    "token_ids": list(sample.response_ids),
                    "logprobs": {"content": self.logprobs(sample)},
                }
            ],
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": len(sample.response_ids),
                "total_tokens": len(ids) + len(sample.response_ids),
            },
        }

    def message(self, sample: Sample, with_tools: bool) -> dict:
        """The assistant message: the text without special tokens; with tools, hermes ``<tool_call>``
        blocks become ``tool_calls`` and the content is the text before the first."""
        text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        calls = self.format.parse(sample.response_ids)[0] if with_tools else []
        if not calls:
            return {"role": "assistant", "content": text}
        turn = self.tokens.model_turns - 1
        return {
            "role": "assistant",
            "content": text.split("<tool_call>", 1)[0] or None,
            "tool_calls": [
                {"id": f"call_{turn}_{k}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for k, c in enumerate(calls)
            ],
        }

    def logprobs(self, sample: Sample) -> list[dict]:
        pieces = self.tokenizer.convert_ids_to_tokens(list(sample.response_ids))
        return [
            {"token": str(p), "logprob": float(lp), "bytes": None, "top_logprobs": []}
            for p, lp in zip(pieces, sample.log_probs)
        ]


def _plain(message) -> tuple:
    """A message as compared across turns: role, content and tool calls (pydantic or dict)."""
    m = message.model_dump() if hasattr(message, "model_dump") else dict(message)
    calls = m.get("tool_calls") or []
    names = [(c["function"]["name"], c["function"]["arguments"]) if "function" in c else c for c in calls]
    return m.get("role"), m.get("content") or "", json.dumps(names, sort_keys=True, default=str)
