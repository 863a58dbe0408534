"""``actor_rollout_ref.actor.use_prefix_grouper``: verl's key reaches the engine, default off, checked, noticed."""

from __future__ import annotations

from splitproof.rl.config.derive import to_update_config

from .config_helpers import USER_MODEL, VERL_LINE, error_of, load

KEY = "actor_rollout_ref.actor.use_prefix_grouper"


def test_default_off_and_reaches_the_update_config():
    cfg, notices = load()
    assert to_update_config(cfg).use_prefix_grouper is False
    assert not any(KEY in n for n in notices)
    cfg, notices = load(f"{KEY}=true")
    assert to_update_config(cfg).use_prefix_grouper is True
    assert not any(KEY in n for n in notices)  # the built-in recipe: GRPO, no critic, no packing


def test_with_activation_checkpointing_is_refused():
    e = error_of(f"{KEY}=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true")
    assert e.field == KEY and "enable_gradient_checkpointing" in str(e)


def test_notices_name_what_it_leaves_as_it_is():
    _, notices = load(*VERL_LINE, USER_MODEL, f"{KEY}=true", "algorithm.adv_estimator=gae")
    assert any(n.startswith(f"{KEY}=true applies to the actor") and "critic" in n for n in notices)
    _, notices = load(*VERL_LINE, USER_MODEL, f"{KEY}=true", "actor_rollout_ref.model.use_remove_padding=true")
    assert any(KEY in n and "use_remove_padding=true does not pack them" in n for n in notices)
