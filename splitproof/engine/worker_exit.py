"""How a data-parallel worker ended, in one line: the error to raise when a rank dies instead of reporting.

A rank killed by the kernel (out of memory: SIGKILL) leaves nothing behind but its exit status; the
ranks that survive it fail in their next collective with a connection error that names no one. Whoever
launched the ranks knows their exit statuses — the in-process launcher here, ``torchrun``'s agent for
training — and reports the dead rank instead: ``WorkerDied(rank, exitcode)``.
"""

from __future__ import annotations

import signal


def exit_description(exitcode: int) -> str:
    """``exited with status 3`` / ``was killed by signal SIGKILL (likely out of memory)`` (exitcode < 0:
    the negated signal number, as ``multiprocessing`` and ``torchrun`` report it)."""
    if exitcode >= 0:
        return f"exited with status {exitcode} before reporting a result"
    number = -exitcode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    hint = " (likely out of memory)" if number == signal.SIGKILL else ""
    return f"was killed by signal {name}{hint}"


class WorkerDied(RuntimeError):
    """A data-parallel rank ended without reporting. The message is one line naming the rank."""

    def __init__(self, rank: int, exitcode: int):
        super().__init__(f"data-parallel rank {rank} {exit_description(exitcode)}")
        self.rank = rank
        self.exitcode = exitcode


def first_death(exitcodes: dict[int, int | None]) -> WorkerDied | None:
    """The death to report among ranks that ended without reporting (``exitcodes``: rank -> exit status,
    None while running): one killed by a signal first, then one with a non-zero status, lowest rank first."""
    ended = {rank: code for rank, code in exitcodes.items() if code is not None and code != 0}
    if not ended:
        return None
    rank = min(ended, key=lambda r: (ended[r] >= 0, r))
    return WorkerDied(rank, ended[rank])
