"""Run a function on D local CPU processes joined by gloo — for tests and the diagnosis's `dp:D`.

Real training launches with ``torchrun``; this is the in-process equivalent: fork D workers, initialise
``torch.distributed`` over TCP on the loopback, call ``fn(*args)`` on each, return the results by rank.
A worker that dies without reporting (killed for memory, a crash) is reported as itself —
:class:`~splitproof.engine.worker_exit.WorkerDied`, one line naming the rank and its signal — never as
the connection error its peers then see in their next collective.

Memory: before forking, the parent hands the memory its allocator holds free back to the system, so
the workers neither count nor copy those pages; workers take buffers of 1 MiB and more straight from
the system and return them when freed (glibc's default keeps freed buffers of up to 32 MiB: measured
up to 2× a model's size retained in an FSDP2 worker).
"""

from __future__ import annotations

import ctypes
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .worker_exit import first_death

POLL_S = 0.05  # how often the parent looks at its workers while it waits
DEATH_GRACE_S = 2.0  # after a worker's error, how long to look for a peer whose death caused it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
LARGE_BUFFER = 1 << 20


def _glibc():
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: leave the allocator alone
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


def release_free_memory() -> None:
    """Return the allocator's free pages to the system (glibc ``malloc_trim``; microseconds)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def _map_large_buffers() -> None:
    """Buffers of ``LARGE_BUFFER`` bytes and more come from mmap and go back to the system when freed."""
    libc = _glibc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, LARGE_BUFFER)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    try:
        _map_large_buffers()
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # bytes, not shared-memory tensors: the worker exits right after
        dist.barrier()  # every rank is past its collectives: tearing the group down cannot strand one
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # report, never hang the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass
        results.close()
        results.join_thread()  # flush the queue's feeder thread before the hard exit
        os._exit(0)  # skip interpreter teardown: gloo/DDP finalisers can deadlock at exit


def run_data_parallel(fn: Callable[..., Any], world_size: int, *args, timeout: float = 300.0) -> list[Any]:
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank a forked process in one gloo group.

    Raises :class:`WorkerDied` when a rank dies without reporting, ``RuntimeError`` with the rank's
    traceback when ``fn`` raises, ``TimeoutError`` when no rank reports for ``timeout`` seconds.
    """
    release_free_memory()
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    failed = True
    try:
        outputs = _collect(procs, results, timeout)
        failed = False
    finally:
        for p in procs:
            p.join(timeout=5 if not failed else 0.5)
            if p.is_alive():
                p.kill()
    return [outputs[r] for r in range(world_size)]


def _unreported_exits(procs, reported) -> dict[int, int | None]:
    return {rank: p.exitcode for rank, p in enumerate(procs) if rank not in reported}


def _collect(procs, results, timeout: float) -> dict[int, Any]:
    """Every rank's result; the first failure (a death before an error it caused) raises."""
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < len(procs):
        try:
            rank, status, value = results.get(timeout=POLL_S)
        except queue.Empty:
            death = first_death(_unreported_exits(procs, outputs))
            if death is not None:
                raise death from None
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"data-parallel workers: no result for {timeout:.0f} s "
                    f"(ranks {sorted(set(range(len(procs))) - set(outputs))} still running)"
                ) from None
            continue
        if status == "ok":
            outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            deadline = time.monotonic() + timeout
            continue
        _raise_death_behind(procs, set(outputs) | {rank})
        raise RuntimeError(f"data-parallel worker failed\nrank {rank}:\n{value}")
    return outputs


def _raise_death_behind(procs, reported: set[int]) -> None:
    """A rank's error is often its peer's death seen through a collective: report the death if there is one."""
    until = time.monotonic() + DEATH_GRACE_S
    while True:
        exits = _unreported_exits(procs, reported)
        death = first_death(exits)
        if death is not None:
            raise death
        if time.monotonic() > until or all(code is not None for code in exits.values()):
            return
        time.sleep(POLL_S / 2)
