"""The in-process data-parallel launcher reports a dead worker as itself, in one line."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from splitproof.engine.launch import run_data_parallel
from splitproof.engine.worker_exit import WorkerDied, exit_description, first_death

pytestmark = pytest.mark.dist


def _rank_dies(how: str):
    """Rank 1 dies inside the work; rank 0 carries on into a collective with it (as a real update would)."""
    if dist.get_rank() == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's OOM killer does
        os._exit(3)
    dist.all_reduce(torch.ones(4))
    return "unreachable"


@pytest.mark.parametrize(
    "how,expected",
    [("kill", "rank 1 was killed by signal SIGKILL (likely out of memory)"), ("exit", "rank 1 exited with status 3")],
)
def test_a_dead_worker_is_reported_as_itself(how, expected):
    with pytest.raises(WorkerDied) as info:
        run_data_parallel(_rank_dies, 2, how, timeout=60)
    message = str(info.value)
    assert expected in message and "\n" not in message
    assert "Connection" not in message and "rank 0" not in message
    assert info.value.rank == 1


def _rank_raises():
    if dist.get_rank() == 0:
        raise ValueError("bad thing on rank 0")
    return dist.get_rank()


def test_an_error_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 0.*ValueError: bad thing on rank 0"):
        run_data_parallel(_rank_raises, 2, timeout=60)


def test_results_come_back_by_rank():
    assert run_data_parallel(lambda: dist.get_rank() * 10, 3, timeout=60) == [0, 10, 20]


def test_exit_descriptions():
    assert exit_description(-signal.SIGSEGV) == "was killed by signal SIGSEGV"
    assert exit_description(1) == "exited with status 1 before reporting a result"
    assert first_death({0: None, 1: 0, 2: 1, 3: -9}).rank == 3  # a signal first
    assert first_death({0: None, 1: 0}) is None
