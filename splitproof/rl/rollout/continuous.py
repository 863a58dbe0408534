"""Multi-turn episodes out of lockstep: continuous batching over the ``hf`` engine's model.

Up to ``max_num_seqs`` episodes hold a slot of a :class:`~splitproof.rl.rollout.packed.SlotCache` at once.
Every forward is one packed forward (``rl/rollout/packed.py``) of what each running episode feeds: its
prompt when it has just taken a slot, its last sampled token while it generates, and that token with the
tool's tokens when its tools have answered. An episode whose turn ends submits its calls and sits out
until they answer; the others go on, and a finished episode's slot goes to the next episode in order. After
a forward whose turns started calls, the engine waits while those calls keep answering (until all have, or
:data:`TOOL_QUIET_S` passes without an answer, :data:`TOOL_PAUSE_S` at most): quick tools then answer
before the next forward, which their episodes join, and their threads do not run interleaved with it; slow
tools cost that pause. The samples of a prompt feed it once: an episode whose prompt another one holding a
slot has fed (or feeds in the same forward) copies that slot's prompt columns and last logits.

Why the schedule changes nothing: a token's logits are a function of its episode's tokens (the packed
forward's rule), and token t of an episode draws the uniform of position t of its stream (seed, stream,
step, uid, j), tool tokens counted, as in the lockstep engine. So which episodes share a forward, when a
tool answers, the pool size and ``max_num_seqs`` change the cost only (``tests/test_packed.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitproof.engine.row_invariant import row_invariant
from splitproof.hf_models import unwrap
from splitproof.rl.stop import decode_point

from ..pause import pause_point
from .hf import HFRollout, Sample, SamplingParams, check_requests
from .packed import PackedModel, SlotCache, long_tensor, packed_forward, packed_forwards, packed_model
from .sampling import sample_tokens, stream_keys, stream_uniforms
from .tool_runner import Pending, ToolRunner

TOOL_QUIET_S = 0.0005  # seconds without an answer after which the engine stops waiting for quick tools
TOOL_PAUSE_S = 0.01  # the longest such wait in all (a long burst of quick calls)


@dataclass
class _Running:
    """An episode holding a slot: ``fed`` tokens in the cache, ``feed`` the ones the next forward takes,
    ``turn`` / ``log_probs`` the current model turn, ``handles`` its tool calls while they run."""

    index: int
    slot: int
    budget: int  # model tokens this turn may take
    feed: list[int]
    fed: int = 0
    turn: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    handles: list[Pending] | None = None


class _Slots:
    """Which episodes hold a slot, which wait for one (in order) and which slots are free."""

    def __init__(self, episodes: Sequence, slots: int, budget: int, where: str):
        self.episodes, self.budget, self.where = episodes, budget, where
        self.waiting, self.running, self.free = deque(range(len(episodes))), {}, list(range(slots))[::-1]
        self.tool_turns = 0
        self.prompts: dict[tuple, list] = {}  # prompt ids -> [the episode that feeds them, its logits row once fed]

    def batch(self) -> tuple[list[_Running], list[_Running]]:
        """``(feeding, followers)`` after giving free slots to waiting episodes: the running episodes that feed
        the next forward, and the new ones whose prompt an episode holding a slot feeds or has fed (they take
        its keys, values and last logits instead: :meth:`share`)."""
        followers = []
        while self.waiting and self.free:
            i = self.waiting.popleft()
            prompt = tuple(self.episodes[i].prompt_ids)
            r = _Running(i, self.free.pop(), self.budget, list(prompt))
            self.running[i] = r
            if prompt in self.prompts:
                r.feed = []
                followers.append(r)
            else:
                self.prompts[prompt] = [r, None]
        return [r for r in self.running.values() if r.handles is None and r.feed], followers

    def share(self, feeding: list[_Running], logits, followers: list[_Running], cache: SlotCache) -> torch.Tensor:
        """The logits rows of ``feeding`` then ``followers``: a follower's prompt columns are copied from the
        slot of the episode that fed the prompt (the same bits: a feed's numbers are a function of its
        tokens; the columns up to the longest prompt among them, the rest masked until written), its row is
        that episode's."""
        for k, r in enumerate(feeding):
            if r.fed:  # only a prompt's first feed can be a leader's
                continue
            entry = self.prompts.get(tuple(self.episodes[r.index].prompt_ids))
            if entry is not None and entry[0] is r:
                entry[1] = logits[k]
        if not followers:
            return logits
        rows, sources = [], []
        for r in followers:
            prompt = self.episodes[r.index].prompt_ids
            leader, row = self.prompts[tuple(prompt)]
            sources.append(leader.slot)
            r.fed = len(prompt)
            rows.append(row)
        cache.copy(sources, [r.slot for r in followers], max(r.fed for r in followers))
        return torch.stack(rows) if logits is None else torch.cat([logits, torch.stack(rows)])

    def end(self, r: _Running) -> None:
        del self.running[r.index]
        self.free.append(r.slot)
        prompt = tuple(self.episodes[r.index].prompt_ids)
        if self.prompts.get(prompt, [None])[0] is r:  # its slot goes: later episodes feed the prompt again
            del self.prompts[prompt]

    def rejoin_answered(self, runner: ToolRunner, on_tools) -> None:
        """Append the results of every turn whose calls all answered; those episodes feed in the next forward."""
        for r in [r for r in self.running.values() if r.handles is not None and runner.ready(r.handles)]:
            handles, r.handles = r.handles, None
            if not on_tools(r.index, handles):
                self.end(r)
                continue
            e = self.episodes[r.index]
            r.feed, r.budget = (e.prompt_ids + e.response_ids)[r.fed :], self.budget - len(e.response_ids)
            self.tool_turns += 1
            pause_point(f"{self.where}:tools{self.tool_turns}")  # a kill test stops here mid-episode

    def take(self, batch: list[_Running], tokens: list[int], log_probs: list[float], eos: set, on_turn) -> list:
        """Append each episode's sampled token; a turn that ends (EOS, or its budget) goes to ``on_turn``. The
        calls started, a list per turn."""
        started = []
        for r, token, log_prob in zip(batch, tokens, log_probs):
            r.fed, r.feed = r.fed + len(r.feed), [token]
            r.turn.append(token)
            r.log_probs.append(log_prob)
            if token in eos or len(r.turn) == r.budget:
                e = self.episodes[r.index]
                turn = Sample(e.uid, e.sample_index, e.prompt_ids, r.turn, r.log_probs, token in eos)
                r.turn, r.log_probs = [], []
                r.handles = on_turn(r.index, turn) or None
                if r.handles is None:
                    self.end(r)
                else:
                    started.append(r.handles)
        return started


def generate_episodes(
    rollout: HFRollout,
    episodes: Sequence,
    params: SamplingParams,
    *,
    step: int,
    stream: int,
    runner: ToolRunner,
    on_turn: Callable[[int, Sample], list[Pending]],
    on_tools: Callable[[int, list[Pending]], bool],
) -> None:
    """Generate every episode to its end, in place. ``on_turn(i, turn)`` appends a model turn to episode i
    and returns its submitted calls (none: the episode ends); ``on_tools(i, handles)`` appends their
    results and says whether the episode goes on."""
    params.check()
    check_requests([(e.uid, e.sample_index, e.prompt_ids) for e in episodes], params, rollout.vocab_size)
    model = unwrap(rollout.model)
    device = next(model.parameters()).device
    budget, eos = params.max_response_length, set(rollout.eos_token_ids)
    uids = torch.tensor([e.uid for e in episodes], device=device)
    indices = torch.tensor([e.sample_index for e in episodes], device=device)
    uniforms = stream_uniforms(stream_keys(params.seed, stream, step, uids, indices), budget)  # [episode, t]
    slots = _Slots(episodes, min(rollout.max_num_seqs, len(episodes)), budget, f"step{step}:stream{stream}")
    capacity = max(len(e.prompt_ids) for e in episodes) + budget
    cache = SlotCache(len(slots.free), -(-capacity // rollout.pad_multiple) * rollout.pad_multiple)
    packed = packed_model(model)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), row_invariant(model), packed_forwards(model):
            while slots.waiting or slots.running:
                feeding, followers = slots.batch()
                if not feeding and not followers:  # every running episode waits for its tools
                    runner.wait_any([r.handles for r in slots.running.values()])
                    slots.rejoin_answered(runner, on_tools)
                    continue
                decode_point()  # a Ctrl-C abandons the step here (splitproof.rl.stop)
                logits = _forward(packed, cache, feeding, rollout.pad_multiple) if feeding else None
                logits = slots.share(feeding, logits, followers, cache)
                slots.rejoin_answered(runner, on_tools)  # tools that answered during the forward
                batch = feeding + followers
                at = [r.index * budget + len(episodes[r.index].response_ids) + len(r.turn) for r in batch]
                tokens, log_probs = sample_tokens(
                    logits,
                    uniforms.reshape(-1).index_select(0, long_tensor(at, device)),
                    temperature=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    greedy=params.greedy,
                )
                started = slots.take(batch, tokens.tolist(), log_probs.tolist(), eos, on_turn)
                if started:
                    runner.settle(started, TOOL_QUIET_S, TOOL_PAUSE_S)  # quick tools answer before the next forward
                    slots.rejoin_answered(runner, on_tools)
    finally:
        model.train(was_training)


def _forward(packed: PackedModel, cache: SlotCache, batch: list[_Running], pad_multiple: int) -> torch.Tensor:
    """The logits ``[len(batch), V]`` at each running episode's last fed token."""
    feeds, last, n = [], [], 0
    for r in batch:
        feeds.append((r.slot, r.fed, r.feed))
        n += len(r.feed)
        last.append(n - 1)
    return packed_forward(packed, cache, feeds, last, pad_multiple=pad_multiple)
