"""The rollout process of a pipelined run: its own copy of the policy, generating batch after batch.

It receives, in order, one message per batch: ``(step, slot, version, requests, params)``. When ``slot``
is set, it first copies the weights of policy ``version`` out of the shared-memory buffer ``slot`` into
its own model and answers ``("loaded", step)`` (from then on the trainer may overwrite that buffer);
then it generates the requests with the ``hf`` backend, keyed by ``step`` exactly as the synchronous
step keys them, and answers ``("done", step, version, samples)`` — or ``("error", step, message)``.
``None`` stops it; so does the death of the training process that started it.

Test hooks: ``SPLITPROOF_PIPELINE_DELAY`` (seconds) sleeps a random time up to that before each load and
each generation, drawn from the OS's entropy (the results must not depend on it);
``SPLITPROOF_ROLLOUT_DIE_AT=<step>`` makes the rollout process of rank ``SPLITPROOF_ROLLOUT_DIE_RANK``
(default 0) kill itself with SIGKILL when it is asked for that step's batch.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import time
import traceback
from dataclasses import dataclass

import torch

DELAY_ENV = "SPLITPROOF_PIPELINE_DELAY"
DIE_AT_ENV, DIE_RANK_ENV = "SPLITPROOF_ROLLOUT_DIE_AT", "SPLITPROOF_ROLLOUT_DIE_RANK"


def random_delay() -> None:
    """Sleep a random time in [0, $SPLITPROOF_PIPELINE_DELAY] seconds (nothing when unset)."""
    most = float(os.environ.get(DELAY_ENV) or 0)
    if most > 0:
        time.sleep(random.Random(os.urandom(8)).uniform(0, most))


@dataclass(frozen=True)
class WorkerSpec:
    """What the rollout process builds its model and backend from (picklable)."""

    model_config: object  # actor_rollout_ref.model
    dtype: torch.dtype
    vocab_size: int
    eos_token_ids: list
    pad_token_id: int
    max_num_seqs: int
    threads: int
    parent_pid: int
    rank: int
    tied: dict  # alias name -> the name it repeats (tied weights, sent once)


def rollout_process(spec: WorkerSpec, buffers: list, requests, results) -> None:
    """The rollout process's main loop (``torch.multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's to act on (rl/stop.py)
    torch.set_num_threads(spec.threads)
    from ..models.policy import load_policy  # the architecture; every weight is then copied from ``buffers``
    from .handover import copy_weights, tie
    from .hf import HFRollout

    model = load_policy(spec.model_config, dtype=spec.dtype, vocab_size=spec.vocab_size).eval()
    tie(model, spec.tied)  # the trainer's ties, whatever the loaded model had
    params = model.state_dict()
    rollout = HFRollout(model, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id,
                        max_num_seqs=spec.max_num_seqs)
    version = None
    while True:
        try:
            message = requests.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != spec.parent_pid:  # the training process is gone
                return
            continue
        if message is None:
            return
        step, slot, new_version, batch, sampling = message
        if os.environ.get(DIE_AT_ENV) == str(step) and os.environ.get(DIE_RANK_ENV, "0") == str(spec.rank):
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            if slot is not None:
                random_delay()
                copy_weights(params, buffers[slot])
                version = new_version
                results.put(("loaded", step))
            random_delay()
            samples = rollout.generate(batch, sampling, step=step, stream=0)
            results.put(("done", step, version, samples))
        except Exception as e:  # reported to the trainer, which stops the run naming it
            results.put(("error", step, f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))
