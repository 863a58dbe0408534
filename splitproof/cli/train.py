"""``splitproof train``: RL post-training from verl's config keys (see docs/train.md).

Exit status: 0 the run finished; 1 a step failed (a reward function raised, a rank failed) — the last
complete checkpoint is intact and nothing of the failed step was written; 2 a user mistake (one line
on stderr, before any model is loaded or any file written); 130 stopped by Ctrl-C within seconds (the
step under way discarded; the run after the last finished step saved when that is exact: rl/stop.py),
with where and how it resumes. Under torchrun every rank stops the same way; only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from contextlib import contextmanager
from datetime import timedelta

from .arguments import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, quiet_loading

EXIT_INTERRUPTED = 130
LEAVE_TIMEOUT_S = 60  # how long a rank waits for the others before it exits
ALREADY_COMPLETE = "done: the run was already complete at step {step}; nothing written"

TRAIN_DESCRIPTION = """\
Train a causal LM with RL (GRPO, RLOO, REINFORCE++, ... with verl's losses), configured by verl's key
names: a YAML file (--config) and key=value overrides, merged as Hydra merges verl's config. With no
arguments: the embedded default, a small built-in model learning the built-in addition task on CPU.

examples:
  splitproof train
  splitproof train trainer.total_training_steps=20 trainer.save_freq=5
  splitproof train data.train_files=train.parquet data.val_files=test.parquet \\
      actor_rollout_ref.model.path=/models/SmolLM2-135M-Instruct custom_reward_function.path=reward.py \\
      data.train_batch_size=16 actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
      algorithm.adv_estimator=grpo trainer.total_training_steps=20
  splitproof train --config run.yaml --print-config
  torchrun --standalone --nproc_per_node 2 -m splitproof train actor_rollout_ref.actor.strategy=fsdp2

Outputs under trainer.default_local_dir: metrics.jsonl (verl's metric names), curve.png,
global_step_N/ checkpoints (trainer.save_freq). A stopped run resumes from its newest checkpoint
(trainer.resume_mode=auto, the default). See docs/train.md.
exit status: 0 done, 1 a step failed, 2 bad usage (nothing loaded or written), 130 interrupted."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``splitproof train`` on the top-level parser's subparsers."""
    t = subparsers.add_parser(
        "train",
        help="RL post-training with verl's config keys",
        description=TRAIN_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    t.add_argument("--config", metavar="FILE.yaml", help="a YAML config (verl's tree); overrides apply on top")
    t.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    t.add_argument(
        "overrides", nargs="*", metavar="key=value", help="verl-style overrides, e.g. data.train_batch_size=16"
    )
    t.set_defaults(run=run)
    return t


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _say(message: str) -> None:
    if _rank() == 0:
        print(f"splitproof: {message}", file=sys.stderr, flush=True)


def _error(message: str) -> None:
    _say(f"error: {message}")


class StopRequest:
    """Ctrl-C asks the run to stop at the next stop point (between stages, decode steps, optimizer steps:
    ``splitproof.rl.stop``); a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False

    def __call__(self) -> bool:
        return self.requested

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if _rank() == 0:  # os.write: a handler may interrupt a print in progress
            os.write(
                2,
                b"\nsplitproof: stopping within seconds; the step under way is discarded "
                b"(Ctrl-C again to stop at once; the newest checkpoint stays intact)\n",
            )

    @contextmanager
    def installed(self):
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def resume_command(argv: list[str], resume_mode: str) -> str:
    """The command that continues this run: the same arguments, ``trainer.resume_mode=auto``."""
    kept = [a for a in argv if not a.lstrip("+").startswith(("trainer.resume_mode=", "trainer.resume_from_path="))]
    if resume_mode != "auto" or len(kept) != len(argv):
        kept.append("trainer.resume_mode=auto")
    launcher = (
        "splitproof train"
        if _world() == 1
        else f"torchrun --standalone --nproc_per_node {_world()} -m splitproof train"
    )
    return " ".join([launcher, shlex.join(kept)]).strip()


def init_distributed(timeout_s: int, device: str = "cpu") -> None:
    """The process group under torchrun: gloo on the CPU; NCCL for the GPU's tensors with ``device``
    (``devices.process_group_backend``), plus a gloo group for the barrier at exit."""
    if _world() == 1:  # no torch import for one process: a rerun of a finished run needs none
        return
    import torch.distributed as dist

    from ..devices import process_group_backend, this_process_device

    global LEAVE_GROUP
    if not dist.is_initialized():
        where = this_process_device(device)
        backend = process_group_backend(where)
        if where.type == "cuda":  # NCCL's communicator on this rank's GPU
            import torch

            torch.cuda.set_device(where)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        if backend != "gloo":  # monitored_barrier runs on gloo alone
            LEAVE_GROUP = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


LEAVE_GROUP = None  # the gloo group of the exit barrier when the default group is not gloo


def _distributed():
    """``torch.distributed`` when this process has imported it (else None: nothing to wait for or close)."""
    return sys.modules.get("torch.distributed")


def _leave_together() -> None:
    """Under torchrun, every rank waits here for the others (rank 0 has printed by then), so that no
    rank's exit makes torchrun stop rank 0 before it has said why the run ended."""
    dist = _distributed()
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        try:
            dist.monitored_barrier(group=LEAVE_GROUP, timeout=timedelta(seconds=LEAVE_TIMEOUT_S))
        except RuntimeError:
            pass  # a rank is gone: leaving is all that is left to do


def _close_distributed() -> None:
    dist = _distributed()
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _stopped_message(cfg, argv: list[str], stopped: str) -> str:
    from ..rl.train import newest_checkpoint

    newest = newest_checkpoint(cfg)
    if newest is None:
        where = (
            "no checkpoint was saved (trainer.save_freq<=0), so rerunning starts over"
            if cfg.trainer.save_freq <= 0
            else "no checkpoint yet, so rerunning starts over"
        )
        return f"{stopped}; {where}"
    step = newest.name.rsplit("_", 1)[-1]
    return (
        f"{stopped}; the newest checkpoint is {newest}, so the run resumes after step {step}. "
        f"To resume: {resume_command(argv, cfg.trainer.resume_mode)}"
    )


def run(args) -> int:
    """Run the parsed ``splitproof train`` command; returns the exit status."""
    from ..loss_config import ConfigError
    from ..rl.config.load import dump_config, load_train_config
    from ..rl.config.schema import ActorRolloutRefConfig

    argv = list(getattr(args, "argv", None) or [])
    try:
        cfg = load_train_config(
            args.config, args.overrides, on_notice=lambda m: _say(f"notice: {m}"), check_paths=not args.print_config
        )
    except ConfigError as e:
        cfg, code = None, EXIT_USAGE
        init_distributed(ActorRolloutRefConfig.nccl_timeout)
        _error(str(e))
    else:
        if args.print_config:
            if _rank() == 0:
                print(dump_config(cfg), end="")
            return EXIT_PASS
        init_distributed(cfg.actor_rollout_ref.nccl_timeout, cfg.trainer.device)
        code = _train(cfg, argv, lambda message: _with_origins(message, args))
    try:
        _leave_together()
        return code
    finally:
        _close_distributed()


def _with_origins(message: str, args) -> str:
    """``message`` with the origin (the recipe, verl's default) of each config value it names that the user
    did not set."""
    from ..rl.config.load import setting_origins

    return setting_origins(args.config, args.overrides).annotate(message)


def _train(cfg, argv: list[str], annotate) -> int:
    """The run, and the exit status with its message (rank 0). An unexpected error propagates."""
    from ..loss_config import ConfigError
    from ..rl.checkpoint.resume import finished_message, finished_run

    try:
        finished = finished_run(cfg)  # answered from the checkpoint's files, before torch is imported
    except ConfigError as e:
        _error(annotate(str(e)))
        return EXIT_USAGE
    if finished is not None:
        _say(finished_message(cfg, *finished))
        _say(ALREADY_COMPLETE.format(step=finished[1]))
        return EXIT_PASS
    from ..rl.loop import Interrupted, StepFailed
    from ..rl.train import SetupError, newest_checkpoint, train

    stop = StopRequest()
    try:
        with stop.installed(), quiet_loading():
            result = train(cfg, stop_requested=stop, on_message=_say)
    except SetupError as e:
        _error(annotate(str(e)))
        return EXIT_USAGE
    except StepFailed as e:
        newest = newest_checkpoint(cfg)
        kept = f"the newest checkpoint ({newest}) is intact" if newest else "no checkpoint was saved"
        done = (
            f"Step {e.step}'s record was logged, its checkpoint not saved"
            if e.logged
            else f"Nothing of step {e.step} was logged or saved"
        )
        _error(f"{e}. {done}; {kept}.")
        return EXIT_FAIL
    except Interrupted as e:
        _say(_stopped_message(cfg, argv, str(e)))
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        _say(_stopped_message(cfg, argv, "stopped"))
        return EXIT_INTERRUPTED
    _say(done_message(cfg, result))
    return EXIT_PASS


def done_message(cfg, result) -> str:
    """The last line of a finished run: the step reached and the files that were written, only those."""
    if cfg.trainer.val_only:
        return f"done: evaluated the weights of step {result.start_step} (trainer.val_only; nothing written)"
    if result.parts is None:
        return ALREADY_COMPLETE.format(step=result.start_step)
    written = ", ".join(str(path) for path in result.outputs) or "no metrics file (trainer.logger has no file logger)"
    return f"done: step {result.total_steps}; wrote {written}"
