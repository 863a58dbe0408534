"""Run a function on D local CPU processes joined by gloo — for tests and the diagnosis's `dp:D`.

Real training launches with ``torchrun``; this is the in-process equivalent: fork D workers, initialise
``torch.distributed`` over TCP on the loopback, call ``fn(*args)`` on each, return the results by rank.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        buffer = io.BytesIO()
        torch.save(fn(*args), buffer)  # bytes, not shared-memory tensors: the worker exits right after
        results.put((rank, "ok", buffer.getvalue()))
        dist.barrier()
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
    """``[fn(*args) on rank r for r in range(world_size)]``, each rank a forked process in one gloo group."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                outputs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("data-parallel worker failed\n" + "\n".join(errors))
    return [outputs[r] for r in range(world_size)]
