"""Multi-turn episodes: generate → parse tool calls → run the tools → append their responses → generate
again, until a turn calls no tool, a turn limit is reached or the response budget is spent.

Token in, token out: an episode's response is the generated ids and the tool-response ids exactly as
appended (the next turn is generated from those ids, never from re-tokenized text), with
``token_mask`` 1 on the model's tokens and 0 on the tools' (``response_mask`` 0: in the attention, out of
the loss). ``log_probs`` are the rollout's per model token, 0.0 on tool tokens.

Determinism: token i of sample j of prompt uid draws the uniform of position i of the stream (seed,
stream, step, uid, j), i counting every response token of the episode, tool tokens included — a turn
continues the stream where the last left it. An episode's tool results are read in its own order (call by
call), so completion order, pool size and batching never change the trajectory. Only a ``tool_timeout``
depends on the wall clock.

Two schedules, the same promise:

- out of lockstep (``rl/rollout/continuous.py``), on the ``hf`` engine with a model that takes packed
  forwards (``rl/rollout/packed.py``): an episode whose turn ends waits for its tools alone and rejoins the
  running batch when they answer;
- in lockstep, for any other engine or model: each turn of the live episodes runs in chunks of
  ``max_num_seqs``, and the tool calls of a chunk start on the pool as soon as it is generated. An engine
  with ``new_turn_cache()`` (``hf``) keeps each episode's KV cache from one turn to the next, so a turn
  prefills only what was appended (``rl/rollout/prefill.py``); any other engine gets each episode so far
  as a fresh prompt.

Termination follows verl's tool agent loop, with ``B = data.max_response_length`` counting every token
after the prompt: a model turn gets at most the tokens left; after it the episode ends when B is
reached, when ``max_assistant_turns`` or ``max_user_turns`` are reached, or when it calls no tool; of a
turn's calls the first ``max_parallel_calls`` run; when their responses would reach B, the episode ends
without them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..pause import pause_point
from .continuous import generate_episodes
from .hf import HFRollout, Request, Sample, SamplingParams
from .packed import supports_packed
from .tool_format import FORMATS
from .tool_runner import ToolRunner
from .tools import Tool


@dataclass
class Episode(Sample):
    """A :class:`Sample` of several turns. ``token_mask[t]``: 1 when response token t is the model's."""

    token_mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    malformed_calls: int = 0
    dropped_calls: int = 0
    environment: str = ""  # the environment's class name (environment_factory), else ""
    environment_reward: float | None = None  # its get_reward(), when it has one
    environment_errors: int = 0  # its reset, tools or get_reward raised
    environment_instance: object = field(default=None, compare=False, repr=False)  # for environments= (TRL)

    @property
    def num_turns(self) -> int:
        """verl's count: user (tool) turns + assistant turns + 1 (the prompt)."""
        return self.user_turns + self.assistant_turns + 1


@dataclass(frozen=True)
class MultiTurnSettings:
    """``actor_rollout_ref.rollout.multi_turn.*`` as the episode reads them."""

    format: str = "hermes"
    max_assistant_turns: int | None = None
    max_user_turns: int | None = None
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout: float | None = None
    num_workers: int = 8


class EpisodeRollout:
    """Multi-turn generation over an :class:`HFRollout`, with the same ``generate`` signature."""

    def __init__(
        self, rollout: HFRollout, tokenizer, tools: dict[str, Tool], settings: MultiTurnSettings, environments=None
    ):
        self.rollout, self.tools, self.settings = rollout, tools, settings
        self.tokenizer, self.environments = tokenizer, environments  # an EnvironmentSet (rl/environments), or None
        self.format = FORMATS[settings.format](tokenizer, tools)
        # out of lockstep (rl/rollout/continuous.py) on an hf engine whose model takes packed forwards
        self.continuous = isinstance(rollout, HFRollout) and supports_packed(rollout.model)
        self.quick_calls: dict[str, int] = {}  # each tool's quick calls in a row, across rollouts (tool_runner.py)

    @property
    def takes_records(self) -> bool:
        """Whether ``generate`` needs each request's prompt record (environments reset from the row)."""
        return self.environments is not None

    @property
    def max_num_seqs(self) -> int:
        return self.rollout.max_num_seqs

    def generate(
        self, requests: Sequence[Request], params: SamplingParams, *, step: int, stream: int = 0, records=None
    ) -> list[Episode]:
        s = self.settings
        budget = params.max_response_length
        episodes = [
            Episode(
                uid=int(uid),
                sample_index=int(j),
                prompt_ids=[int(t) for t in ids],
                response_ids=[],
                log_probs=[],
                finished=False,
            )
            for uid, j, ids in requests
        ]
        session, formats = None, [self.format] * len(episodes)
        if self.environments is not None:  # reset in canonical order; each episode its prompt and tools
            session = self.environments.begin(episodes, records, step=step, stream=stream, seed=params.seed)
            for i, (episode, start) in enumerate(zip(episodes, session.starts)):
                episode.prompt_ids = start.prompt_ids
                if start.tools is not None:
                    formats[i] = FORMATS[s.format](self.tokenizer, start.tools)
        runner = ToolRunner(
            self.tools,
            workers=s.num_workers,
            timeout=s.tool_timeout,
            max_length=s.max_tool_response_length,
            truncate_side=s.tool_response_truncate_side,
            quick_inline=True,
            quick_calls=self.quick_calls,
        )
        try:
            if self.continuous:
                generate_episodes(
                    self.rollout,
                    episodes,
                    params,
                    step=step,
                    stream=stream,
                    runner=runner,
                    on_turn=lambda i, turn: self._submit(
                        runner, self._model_turn(episodes[i], turn, budget, formats[i]), session, i
                    ),
                    on_tools=lambda i, handles: self._after_tools(episodes[i], handles, runner, session, i, budget),
                )
            else:
                self._lockstep(episodes, params, step, stream, runner, session, formats)
        finally:
            runner.close()
        if session is not None:
            session.finish(episodes)
        return episodes

    def _lockstep(self, episodes, params, step, stream, runner, session, formats) -> None:
        """Turns in lockstep: each turn of the live episodes in chunks of ``max_num_seqs``, then their tools."""
        budget = params.max_response_length
        new_turn_cache = getattr(self.rollout, "new_turn_cache", None)  # an engine that keeps KV caches
        kept = {"turn_cache": new_turn_cache()} if new_turn_cache is not None else {}
        live, rounds = list(range(len(episodes))), 0
        while live:
            pending: dict[int, list] = {}  # episode -> its running calls (episodes that go on)
            for start in range(0, len(live), self.max_num_seqs):
                chunk = [episodes[i] for i in live[start : start + self.max_num_seqs]]
                turns = self.rollout.generate(
                    [(e.uid, e.sample_index, e.prompt_ids + e.response_ids) for e in chunk],
                    params,
                    step=step,
                    stream=stream,
                    positions=[len(e.response_ids) for e in chunk],
                    budgets=[budget - len(e.response_ids) for e in chunk],
                    **kept,
                )
                for i, episode, turn in zip(live[start : start + self.max_num_seqs], chunk, turns):
                    calls = self._model_turn(episode, turn, budget, formats[i])
                    if calls:
                        pending[i] = self._submit(runner, calls, session, i)
            live = [
                i
                for i in live
                if i in pending and self._after_tools(episodes[i], pending[i], runner, session, i, budget)
            ]
            rounds += 1
            pause_point(f"step{step}:stream{stream}:tools{rounds}")  # a kill test stops here mid-episode

    @staticmethod
    def _submit(runner: ToolRunner, calls: list, session, i: int) -> list:
        """Start a turn's calls: with an environment on its instance's methods, each after the one before."""
        if not calls:
            return []
        if session is None:
            return [runner.submit(c) for c in calls]
        handles, tools = [], session.starts[i].tools
        for call in calls:
            handles.append(runner.submit(call, tools, after=handles[-1] if handles else None))
        return handles

    def _after_tools(self, episode: Episode, handles: list, runner: ToolRunner, session, i: int, budget: int) -> bool:
        """The turn's results in canonical order (episode, then call) appended; whether the episode goes on."""
        results = [runner.result(h) for h in handles]
        environment_ok = session is None or session.goes_on(i, [h.call for h in handles], results)
        return self._tool_turn(episode, results, budget) and environment_ok

    def _model_turn(self, episode: Episode, turn: Sample, budget: int, format) -> list:
        """Append a generated turn; the calls to run (none when the episode ends here)."""
        s = self.settings
        episode.response_ids += turn.response_ids
        episode.log_probs += turn.log_probs
        episode.token_mask += [1] * len(turn.response_ids)
        episode.finished = turn.finished
        episode.assistant_turns += 1
        if len(episode.response_ids) >= budget:
            return []
        if s.max_assistant_turns and episode.assistant_turns >= s.max_assistant_turns:
            return []
        if s.max_user_turns and episode.user_turns >= s.max_user_turns:
            return []
        calls, malformed = format.parse(turn.response_ids)
        episode.malformed_calls += malformed
        episode.dropped_calls += max(len(calls) - s.max_parallel_calls, 0)
        return calls[: s.max_parallel_calls]

    def _tool_turn(self, episode: Episode, results: list, budget: int) -> bool:
        """Append the responses of a turn's calls; whether the episode goes on."""
        episode.tool_calls += len(results)
        episode.tool_errors += sum(r.status == "error" for r in results)
        episode.tool_timeouts += sum(r.status == "timeout" for r in results)
        ids = self.format.render([r.text for r in results])
        if len(episode.response_ids) + len(ids) >= budget:  # verl: the episode ends without them
            return False
        episode.response_ids += ids
        episode.log_probs += [0.0] * len(ids)
        episode.token_mask += [0] * len(ids)
        episode.user_turns += 1
        return True


def episode_metrics(samples: Sequence) -> dict[str, float]:
    """verl's ``num_turns/{min,max,mean}`` and ours under ``multi_turn/``: tool calls per episode, calls
    that failed (raised or timed out), malformed and dropped calls, the response length without tool
    tokens, and with environments ``environment/errors/mean``. Empty for single-turn samples."""
    if not samples or not isinstance(samples[0], Episode):
        return {}
    n = len(samples)
    turns = [e.num_turns for e in samples]
    model_tokens = [sum(e.token_mask) for e in samples]
    calls = sum(e.tool_calls for e in samples)
    failures = sum(e.tool_errors + e.tool_timeouts for e in samples)
    environment = {}
    if any(e.environment for e in samples):  # environment_factory: its reset, tools or get_reward raised
        environment["environment/errors/mean"] = sum(e.environment_errors for e in samples) / n
    return environment | {
        "num_turns/min": float(min(turns)),
        "num_turns/max": float(max(turns)),
        "num_turns/mean": sum(turns) / n,
        "multi_turn/tool_calls/mean": calls / n,
        "multi_turn/tool_failures/mean": failures / n,
        "multi_turn/tool_failure_ratio": failures / calls if calls else 0.0,
        "multi_turn/tool_timeouts/mean": sum(e.tool_timeouts for e in samples) / n,
        "multi_turn/malformed_calls/mean": sum(e.malformed_calls for e in samples) / n,
        "multi_turn/dropped_calls/mean": sum(e.dropped_calls for e in samples) / n,
        "multi_turn/episodes_with_tool_ratio": sum(e.tool_calls > 0 for e in samples) / n,
        "response_length_model/mean": sum(model_tokens) / n,
        "response_length_model/max": float(max(model_tokens)),
        "response_length_model/min": float(min(model_tokens)),
    }
