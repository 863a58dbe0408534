"""Episodes of a verifiers environment: its own ``rollout`` loop (``SingleTurnEnv``, ``MultiTurnEnv``'s
``env_response``, ``ToolEnv``) run on every request at once in one event loop, each with its own
in-process client (``vf_client``), then its rubric's ``score_group`` over each prompt's samples.

An episode's rollout input is the row's columns (verifiers' ``prompt``, ``answer``, ``info``, ``task``,
``example_id``), its ``info`` with ``seed``: 63 bits from (seed, stream, step, uid, sample index)
(``seeds.episode_seed``), read in the environment as ``state["info"]["seed"]`` (a row's own ``info.seed``
wins). Python's ``random`` and NumPy's global generator are seeded per step around the loop (the
coroutines interleave in the same order at any batch size).

The score is the rubric's reward (the weighted sum of its functions); every function's value (weight 0
metrics included) is reported as ``reward/vf/<function>/mean``. An episode whose rollout stopped on an
error (the model's empty answer, a tool's exception, ...) keeps its tokens and counts in
``environment/errors/mean``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..rollout.episode import Episode
from ..rollout.hf import HFRollout, Request, SamplingParams
from .seeds import episode_seed, seeded_globals
from .vf_client import Batcher, EpisodeClient

LABEL = "vf"


@dataclass
class VerifiersEpisode(Episode):
    """An :class:`Episode` with the rubric's value of each function (``metrics``) and how it stopped."""

    metrics: dict[str, float] = field(default_factory=dict)
    stop_condition: str = ""


class VerifiersRollout:
    """A verifiers environment's episodes over an :class:`HFRollout`, with ``EpisodeRollout``'s signature."""

    takes_records = True

    def __init__(self, rollout: HFRollout, tokenizer, env, template_kwargs: dict | None = None):
        self.rollout, self.tokenizer, self.env = rollout, tokenizer, env
        self.template_kwargs = dict(template_kwargs or {})
        self.batches = 0  # generation batches of the last call (all live episodes waiting at once)

    @property
    def max_num_seqs(self) -> int:
        return self.rollout.max_num_seqs

    def generate(
        self, requests: Sequence[Request], params: SamplingParams, *, step: int, stream: int = 0, records=None
    ) -> list[VerifiersEpisode]:
        if records is None or len(records) != len(requests):
            raise ValueError("a verifiers environment's episodes need each request's row (records)")
        with seeded_globals(episode_seed(params.seed, stream, step, 0, 0, purpose="verifiers-step")):
            return asyncio.run(self._episodes(requests, params, step, stream, records))

    async def _episodes(self, requests, params, step, stream, records) -> list[VerifiersEpisode]:
        batcher = Batcher(self.rollout, params, step=step, stream=stream, live=len(requests))
        clients = [
            EpisodeClient((int(uid), int(j)), batcher, self.tokenizer, params.max_response_length, self.template_kwargs)
            for uid, j, _ in requests
        ]
        states = await asyncio.gather(
            *(
                self._rollout(client, record, episode_seed(params.seed, stream, step, int(uid), int(j)), batcher)
                for client, record, (uid, j, _) in zip(clients, records, requests)
            )
        )
        groups: dict[int, list[int]] = {}
        for i, (uid, _, _) in enumerate(requests):
            groups.setdefault(int(uid), []).append(i)
        for members in groups.values():  # a prompt's samples, scored together (group reward functions)
            await self.env.rubric.score_group([states[i] for i in members])
            for i in members:
                await self.env.rubric.cleanup(states[i])
        self.batches = batcher.batches
        return [self._episode(request, c, s) for request, c, s in zip(requests, clients, states)]

    async def _rollout(self, client: EpisodeClient, record, seed: int, batcher: Batcher):
        from verifiers.clients import OpenAIChatCompletionsClient

        row = dict(record.columns)
        info = row.get("info") or {}
        info = json.loads(info) if isinstance(info, str) else dict(info)
        row["info"] = {"seed": seed, **info}  # a row's own info seed wins
        try:
            return await self.env.rollout(row, OpenAIChatCompletionsClient(client), "splitproof", {})
        finally:
            batcher.done()

    def _episode(self, request: Request, client: EpisodeClient, state) -> VerifiersEpisode:
        uid, j, ids = request
        t = client.tokens
        metrics = {str(k): float(v) for k, v in (state.get("metrics") or {}).items()}
        return VerifiersEpisode(
            uid=int(uid),
            sample_index=int(j),
            prompt_ids=list(t.prompt_ids) if t.prompt_ids else [int(x) for x in ids],
            response_ids=list(t.response_ids),
            log_probs=list(t.log_probs),
            finished=t.finished,
            token_mask=list(t.token_mask),
            assistant_turns=t.model_turns,
            user_turns=t.environment_turns,
            environment=LABEL,
            environment_reward=float(state.get("reward") or 0.0),
            environment_errors=int(state.get("error") is not None),
            metrics=metrics,
            stop_condition=str(state.get("stop_condition") or ""),
        )
