"""The policy loss sits a few calls below the optimizer step (read top to bottom: update → step → share → loss).

Counted in a live update: a profile hook records the interpreter's stack when the loss function is entered,
and the test counts the calls from the engine's functions down to it.
"""

from __future__ import annotations

import sys

import torch

from splitproof.engine import CriticUpdateConfig, UpdateConfig, update_critic, update_policy
from splitproof.engine.optimizer_step import optimizer_step
from splitproof.losses.ppo import vanilla
from splitproof.losses.value import value_loss

from .critic_helpers import critic_rollout, make_models, run_critic
from .engine_helpers import NO_CLIP, loss_config, make_model, make_optimizer, make_rollout


def _stacks_entering(target, run) -> list[list]:
    """The code objects on the stack (innermost first) each time ``target`` is entered while ``run()`` runs."""
    stacks = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is target.__code__:
            codes = []
            while frame is not None:
                codes.append(frame.f_code)
                frame = frame.f_back
            stacks.append(codes)

    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return stacks


def _calls(stack: list, caller) -> int:
    """How many calls lead from ``caller`` (its innermost frame on ``stack``) to the frame on top."""
    return stack.index(caller.__code__)


def test_policy_loss_is_at_most_four_calls_below_the_step():
    model = make_model("llama", torch.float64)
    batch = make_rollout(model)
    config = UpdateConfig(
        loss=loss_config("vanilla", "token-mean"),
        ppo_mini_batch_size=len(batch),
        ppo_micro_batch_size_per_gpu=3,
        grad_clip=NO_CLIP,
    )
    stacks = _stacks_entering(vanilla, lambda: update_policy(model, make_optimizer(model), batch, config))
    assert len(stacks) == 3  # one per microbatch
    for stack in stacks:
        assert _calls(stack, optimizer_step) <= 4, [c.co_name for c in stack]
        assert _calls(stack, update_policy) <= 5, [c.co_name for c in stack]


def test_value_loss_is_as_close_to_the_step():
    policy, critic = make_models()
    batch = critic_rollout(policy, critic)
    config = CriticUpdateConfig(ppo_mini_batch_size=len(batch), ppo_micro_batch_size_per_gpu=3, grad_clip=NO_CLIP)
    stacks = _stacks_entering(value_loss, lambda: run_critic(critic, batch, config))
    assert len(stacks) == 3
    for stack in stacks:
        assert _calls(stack, optimizer_step) <= 4, [c.co_name for c in stack]
        assert _calls(stack, update_critic) <= 5, [c.co_name for c in stack]
