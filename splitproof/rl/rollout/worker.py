"""The rollout process of a pipelined run: its own copy of the policy, generating batch after batch.

It receives, in order, one message per batch: ``(step, slot, version, requests, params)``. When ``slot``
is set, it first copies the weights of policy ``version`` out of the shared-memory buffer ``slot`` into
its own model and answers ``("loaded", step)`` (from then on the trainer may overwrite that buffer);
then it generates the requests with the run's backend (``hf``, or ``vllm``: an engine of its own), keyed
by ``step`` exactly as the synchronous step keys them, and answers ``("done", step, version, samples)``
— or ``("error", step, message)``.
``None`` stops it; so does the death of the training process that started it. With LoRA the process
holds the trainer's PEFT model (the same adapter layers, unmerged); every weight of it, the adapter's
included, comes from the buffers.

Test hooks: ``SPLITPROOF_PIPELINE_DELAY`` (seconds) sleeps a random time up to that before each load and
each generation, drawn from the OS's entropy (the results must not depend on it);
``SPLITPROOF_ROLLOUT_DIE_AT=<step>`` makes the rollout process of rank ``SPLITPROOF_ROLLOUT_DIE_RANK``
(default 0) kill itself with SIGKILL when it is asked for that step's batch.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import signal
import time
import traceback

import torch

DELAY_ENV = "SPLITPROOF_PIPELINE_DELAY"
DIE_AT_ENV, DIE_RANK_ENV = "SPLITPROOF_ROLLOUT_DIE_AT", "SPLITPROOF_ROLLOUT_DIE_RANK"


def random_delay() -> None:
    """Sleep a random time in [0, $SPLITPROOF_PIPELINE_DELAY] seconds (nothing when unset)."""
    most = float(os.environ.get(DELAY_ENV) or 0)
    if most > 0:
        time.sleep(random.Random(os.urandom(8)).uniform(0, most))


def no_progress_bars() -> None:
    """No ``transformers`` progress bar in this process: a bar would print between the trainer's lines,
    and tqdm's bar lock is a semaphore that a killed process leaves behind (Python's resource tracker
    then warns of a leaked semaphore after the trainer's error line)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


@dataclasses.dataclass(frozen=True)
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
    lora: object = None  # LoraSettings when the policy trains a LoRA adapter: this process holds one too
    device: str = "cpu"  # the trainer's device: this process has its own model (and CUDA context) there
    vllm: object = None  # VLLMSettings with rollout.name=vllm: this process runs a vLLM engine on its model
    compute_dtype: object = None  # the trainer's policy computes in it (engine.precision); None: in ``dtype``


def rollout_process(spec: WorkerSpec, buffers: list, requests, results) -> None:
    """The rollout process's main loop (``torch.multiprocessing`` spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's to act on (rl/stop.py)
    from ...engine.precision import compute_in
    from ..models.policy import load_policy  # the architecture; every weight is then copied from ``buffers``
    from .handover import copy_weights, tie
    from .hf import HFRollout

    torch.set_num_threads(spec.threads)
    no_progress_bars()
    from ...devices import deterministic

    deterministic(spec.device)  # the trainer's settings (its notice said which), in this process too
    model = load_policy(spec.model_config, dtype=spec.dtype, vocab_size=spec.vocab_size, device=spec.device)
    if spec.lora is not None:  # the same PEFT model as the trainer's; the adapter's values come with version 0
        from ...lora import apply_lora

        model = apply_lora(model, dataclasses.replace(spec.lora, lora_adapter_path=None))
    model = compute_in(model, spec.compute_dtype).eval()
    tie(model, spec.tied)  # the trainer's ties, whatever the loaded model had
    params = model.state_dict()
    if spec.vllm is not None:  # the engine serves this model: each load below is synced before generating
        from .vllm_engine import VLLMRollout

        settings = dataclasses.replace(spec.vllm, in_process=True)  # this process is daemonic: no children
        rollout = VLLMRollout(model, settings, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id)
    else:
        rollout = HFRollout(
            model, eos_token_ids=spec.eos_token_ids, pad_token_id=spec.pad_token_id, max_num_seqs=spec.max_num_seqs
        )
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
