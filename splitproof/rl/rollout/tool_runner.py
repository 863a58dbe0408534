"""The tool calls of multi-turn episodes: a pool of worker threads, deadlines, and quick calls run in place.

Calls run on up to ``workers`` daemon threads, started as calls need them, so slow tools run while the
model generates. A call of a tool
that has answered quickly (its last :data:`QUICK_CALLS` calls each within :data:`QUICK_S` seconds, timed
around the call) runs on the caller's thread instead, at ``submit``, when the runner may do so
(``quick_inline``: no ``tool_timeout``, since a call on the caller's thread cannot be abandoned), the tool is
a plain function (``Tool.sync``) of the runner's own tools, and the call waits for no other (``after``). A
thread handover costs more than such a call: on the multi-turn benchmark's rollout (255 calls of the
built-in calculator, ``docs/benchmarks.md``) the pool's threads took 10 ms of CPU time and, contending for
the interpreter's lock, slowed the forwards by about 6 ms; with the calls in place the rollout took 128 ms
of CPU time against 151 ms (measured on a 2-core Intel Xeon, before later changes to the forward). A quick
tool's call that then takes longer sends the tool back to the pool until it has answered quickly
:data:`QUICK_CALLS` times again; the generating thread waited for that one call. The episode engine keeps
each tool's streak from one rollout to the next (``quick_calls``). Where a call runs never changes what an
episode reads: results are read in the episode's order. A ``KeyboardInterrupt`` raised during a call in
place is the tool's failure, as on a worker, so a tool cannot end the run; a user's Ctrl-C that lands
inside such a call (microseconds) is lost with it, and ``splitproof train``'s first Ctrl-C is a request
that the next stop point acts on anyway (``splitproof.rl.stop``).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .tools import ERROR_PREFIX, Tool, ToolCall, ToolResult, call_tool, truncate

QUICK_S = 0.002  # a call that answers within this many seconds (wall time) is quick
QUICK_CALLS = 4  # quick calls in a row after which a tool's calls run on the caller's thread


@dataclass(eq=False)
class Pending:
    """A submitted call: ``started`` when a worker took it (monotonic seconds), ``outcome`` once known."""

    call: ToolCall
    tools: dict[str, Tool] | None = None  # the episode's own tools (an environment's methods); None: the runner's
    after: Pending | None = None  # a call of the same episode that must finish first (a stateful environment)
    started: float | None = None
    outcome: ToolResult | None = None


def _answered(handles: list[Pending]) -> bool:
    return all(p.outcome is not None for p in handles)


class ToolRunner:
    """Tool calls on up to ``workers`` daemon threads. ``submit`` queues a call; ``result`` waits for it and cuts
    its text to ``max_length``. Each call gets ``timeout`` seconds from the moment a worker starts it;
    a call past that is abandoned (its thread runs on in the background, never keeping the process alive,
    and its result is dropped) and a fresh worker takes its place, so the calls queued behind it start.
    Any wait enforces every running call's deadline, so a hung call ends on time whatever the pool size
    and whichever result is awaited. Which call finishes first never matters: the episode reads results
    in its own order. ``quick_inline`` (without a ``timeout`` only): quick tools' calls run at ``submit``,
    on the caller's thread (module docstring); ``quick_calls`` carries each tool's quick calls in a row from
    an earlier runner (updated in place)."""

    def __init__(
        self,
        tools: dict[str, Tool],
        *,
        workers: int,
        timeout: float | None = None,
        max_length: int = 256,
        truncate_side: str = "middle",
        quick_inline: bool = False,
        quick_calls: dict[str, int] | None = None,
    ):
        self.tools, self.timeout = tools, timeout
        self.quick_inline = quick_inline and timeout is None
        self._quick = {} if quick_calls is None else quick_calls  # a tool of the runner's own -> quick calls in a row
        self.max_length, self.truncate_side = max_length, truncate_side
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)  # workers wait here for a call to run
        self._done = threading.Condition(self._lock)  # waiters wait here for outcomes (and deadlines)
        self._queue: deque[Pending] = deque()
        self._running: set[Pending] = set()
        self._closed = False
        self._size, self._started, self._idle = workers, 0, 0  # workers: at most, started, waiting for a call

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="splitproof-tool", daemon=True).start()

    def _wake(self) -> None:
        """A call was queued: wake a waiting worker, else start one while the pool has room (workers start
        when calls need them: none for a rollout whose calls all run in place)."""
        if self._idle:
            self._idle -= 1
            self._queued.notify()
        elif self._started < self._size:
            self._started += 1
            self._spawn()

    def _work(self) -> None:
        while True:
            with self._lock:
                while (pending := self._next_ready()) is None and not self._closed:
                    self._idle += 1
                    self._queued.wait()
                if self._closed:
                    return
                pending.started = time.monotonic()
                self._running.add(pending)
                if self.timeout is not None:
                    self._done.notify_all()  # a waiter now has a deadline to keep
            outcome = call_tool(pending.tools if pending.tools is not None else self.tools, pending.call)
            with self._lock:
                if pending.outcome is not None:  # abandoned: a fresh worker has taken this one's place
                    return
                if pending.tools is None:
                    self._timed(pending.call.name, time.monotonic() - pending.started)
                self._running.discard(pending)
                late = self.timeout is not None and time.monotonic() - pending.started > self.timeout
                pending.outcome = self._timed_out() if late else outcome
                self._done.notify_all()
                if self._queue:  # a call queued after this one may run now (an idle worker woken for nothing costs)
                    self._wake()

    def _next_ready(self) -> Pending | None:
        """The first queued call whose ``after`` has finished, taken off the queue (None: none is ready)."""
        for pending in self._queue:
            if pending.after is None or pending.after.outcome is not None:
                self._queue.remove(pending)
                return pending
        return None

    def _timed_out(self) -> ToolResult:
        return ToolResult(f"{ERROR_PREFIX}timed out after {self.timeout:g} s", "timeout")

    def _expire(self) -> float | None:
        """Abandon the running calls past their deadline; the seconds until the next deadline (None: none)."""
        now = time.monotonic()
        for pending in [p for p in self._running if now - p.started >= self.timeout]:
            self._running.discard(pending)
            pending.outcome = self._timed_out()
            self._spawn()
        return min((p.started + self.timeout - now for p in self._running), default=None)

    def _timed(self, name: str, seconds: float) -> None:
        self._quick[name] = self._quick.get(name, 0) + 1 if seconds < QUICK_S else 0

    def _in_place(self, call: ToolCall, tools, after) -> bool:
        """Whether ``call`` runs at ``submit``: a quick tool of the runner's own, plain, waiting for no call."""
        if not self.quick_inline or tools is not None or after is not None:
            return False
        tool = self.tools.get(call.name)
        return tool is not None and tool.sync and self._quick.get(call.name, 0) >= QUICK_CALLS

    def submit(self, call: ToolCall, tools: dict[str, Tool] | None = None, after: Pending | None = None) -> Pending:
        """Queue ``call`` (run with ``tools`` when given; after ``after`` has finished when given), or run it
        now when its tool is quick (``quick_inline``)."""
        pending = Pending(call, tools, after)
        if self._in_place(call, tools, after):
            pending.started = time.monotonic()
            try:
                pending.outcome = call_tool(self.tools, call)
            except KeyboardInterrupt as e:  # the tool's own, as on a worker (a Ctrl-C landing here: see below)
                pending.outcome = ToolResult(f"{ERROR_PREFIX}{e!r}", "error")
            with self._lock:
                self._timed(call.name, time.monotonic() - pending.started)
            return pending
        with self._lock:
            self._queue.append(pending)
            self._wake()
        return pending

    def wait(self, pending: Pending) -> ToolResult:
        """Block until ``pending`` has an outcome (keeping every running call's deadline); its full text."""
        with self._lock:
            while pending.outcome is None:
                wait = self._expire() if self.timeout is not None else None
                if pending.outcome is None:
                    self._done.wait(wait)
            return pending.outcome

    def ready(self, handles: list[Pending]) -> bool:
        """Whether every call of ``handles`` has an outcome (keeping every running call's deadline)."""
        if self.timeout is None:  # no deadline to keep: reading the outcomes needs no lock
            return _answered(handles)
        with self._lock:
            if self.timeout is not None:
                self._expire()
            return _answered(handles)

    def wait_any(self, groups: list[list[Pending]]) -> None:
        """Block until every call of one of ``groups`` has an outcome (keeping every running call's deadline)."""
        with self._lock:
            while not any(map(_answered, groups)):
                wait = self._expire() if self.timeout is not None else None
                if not any(map(_answered, groups)):
                    self._done.wait(wait)

    def settle(self, groups: list[list[Pending]], quiet: float, most: float) -> None:
        """Block while the calls of ``groups`` keep answering: until all have an outcome, until ``quiet`` seconds
        pass without an answer, or ``most`` seconds in all (quick calls then answer before the caller goes on;
        slow ones cost it ``quiet``)."""
        end = time.monotonic() + most
        with self._lock:
            while not all(map(_answered, groups)):
                if self.timeout is not None:
                    self._expire()
                left = end - time.monotonic()
                if left <= 0 or not self._done.wait(min(quiet, left)):
                    return

    def result(self, pending: Pending) -> ToolResult:
        outcome = self.wait(pending)
        return ToolResult(truncate(outcome.text, self.max_length, self.truncate_side), outcome.status)

    def close(self) -> None:
        """Stop the workers (calls still queued never run; running ones finish in the background)."""
        with self._lock:
            self._closed = True
            self._queued.notify_all()
