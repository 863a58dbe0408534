"""Rewards for the `splitproof train` tests, graded like spread_reward.py so that advantages are non-zero.

``graded`` (TRL's batched convention, so it knows the step) can be made to misbehave at a step, by
environment variable: ``STEP_REWARD_FAIL_AT=k`` raises, ``STEP_REWARD_INTERRUPT_AT=k`` sends SIGINT to
its own process (a Ctrl-C in the middle of step k; ``STEP_REWARD_FAIL_RANK=r`` fails on data-parallel
rank r only), and the pause point ``step{k}:reward``
(``SPLITPROOF_PAUSE_AT``) waits there to be killed in the middle of step k.
"""

import os
import signal

from splitproof.rl.pause import pause_point


def _score(text, truth):
    digits = sum(ch.isdigit() for ch in text)
    match = sum(a == b for a, b in zip(text, truth))
    return 0.1 * digits + 0.5 * match - 0.05 * len(text)


def _on_failing_rank():
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return os.environ.get("STEP_REWARD_FAIL_RANK", str(rank)) == str(rank)


def graded(prompts, completions, reward_model, trainer_state, **kwargs):
    step = trainer_state.global_step
    pause_point(f"step{step}:reward")
    if os.environ.get("STEP_REWARD_FAIL_AT") == str(step) and _on_failing_rank():
        raise ValueError(f"cannot score step {step}")
    if os.environ.get("STEP_REWARD_INTERRUPT_AT") == str(step):
        os.kill(os.getpid(), signal.SIGINT)
    return [_score(text, row["ground_truth"]) for text, row in zip(completions, reward_model)]
