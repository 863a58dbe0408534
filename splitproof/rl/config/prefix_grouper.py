"""verl's ``actor_rollout_ref.actor.use_prefix_grouper``: its check and its notices.

On, the actor's update and its no-grad log-prob passes (old and reference log-probs, the KL-Cov prepass)
compute each distinct prompt of a microbatch once (``engine.shared_prefix``). Refused with activation
checkpointing (its recomputation turns the KV cache the response pass reads off). Notices: the critic's
passes compute whole sequences, and ``use_remove_padding`` packs none of the passes it runs.
"""

from __future__ import annotations

from .check_rules import require
from .derive import ACTOR, ARR, critic_enabled
from .schema import TrainConfig

KEY = f"{ACTOR}.use_prefix_grouper"


def check_prefix_grouper(cfg: TrainConfig) -> None:
    """A boolean, and not with activation checkpointing (ConfigError)."""
    arr = cfg.actor_rollout_ref
    on = arr.actor.use_prefix_grouper
    require(isinstance(on, bool), KEY, f"must be true or false, got {on!r}")
    require(
        not (on and arr.model.enable_gradient_checkpointing),
        KEY,
        f"=true cannot be combined with {ARR}.model.enable_gradient_checkpointing=true: the recomputed "
        "forward turns off the prompt's KV cache that the response tokens read; set one of them to false",
    )


def prefix_grouper_notices(cfg: TrainConfig) -> list[str]:
    """What ``use_prefix_grouper=true`` leaves as it is."""
    arr = cfg.actor_rollout_ref
    if not arr.actor.use_prefix_grouper:
        return []
    notices = []
    if critic_enabled(cfg):
        notices.append(
            f"{KEY}=true applies to the actor's update and log-prob passes; the critic computes its values "
            "and its update on whole sequences"
        )
    if arr.actor.use_remove_padding:
        notices.append(
            f"{KEY}=true: the actor's update and log-prob passes run the shared prompts and the responses "
            f"padded: {ARR}.model.use_remove_padding=true does not pack them"
        )
    return notices
