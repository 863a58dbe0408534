"""PPO with a critic in `splitproof train`: verl's explained variance, the critic built from the built-in
model, the actor waiting for `trainer.critic_warmup`."""

from __future__ import annotations

import math

import torch

from splitproof.value_objective import explained_variance


def _verl_explained_variance(values, returns, mask):
    """verl's compute_data_metrics: 1 - var(R - V) / (var(R) + 1e-5) over the valid tokens (torch.var)."""
    r, v = returns[mask.bool()], values[mask.bool()]
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


def test_explained_variance_is_verls_and_ignores_row_order():
    g = torch.Generator().manual_seed(0)
    returns = torch.randn(6, 5, generator=g, dtype=torch.float64)
    values = returns + 0.3 * torch.randn(6, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) < 0.7
    mask[:, 0] = True
    got = explained_variance(values, returns, mask)
    assert math.isclose(got, _verl_explained_variance(values, returns, mask), rel_tol=1e-12)
    order = torch.randperm(6, generator=g)
    assert explained_variance(values[order], returns[order], mask[order]) == got  # exactly rounded sums
    assert explained_variance(returns, returns, mask) == 1.0
    one_token = torch.zeros(6, 5, dtype=torch.bool)
    one_token[2, 1] = True
    assert math.isnan(explained_variance(values, returns, one_token))  # as torch.var of one value


def test_builtin_model_trains_with_a_critic_and_the_actor_waits_for_the_warmup():
    """The embedded default with algorithm.adv_estimator=gae (small batches): the critic is the built-in
    model with a scalar head; with critic_warmup=2 the actor stays as it was at step 1."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    from .rl_helpers import final_weights

    cfg = load_train_config(
        None,
        [
            "algorithm.adv_estimator=gae",
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            "trainer.total_training_steps=2",
            "trainer.critic_warmup=2",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[]",
        ],
    )
    run = build_parts(cfg)
    head = type(run.critic.model).__name__
    assert head == "LlamaForTokenClassification" and run.critic.model.config.num_labels == 1
    initial = final_weights(run.actor.model)
    after_first = {}
    records = fit(
        run, on_step=lambda step, out: after_first.update(final_weights(run.actor.model)) if step == 1 else None
    )
    assert all(torch.equal(after_first[k], initial[k]) for k in initial)
    assert "actor/pg_loss" not in records[0] and "actor/pg_loss" in records[1]
    assert records[0]["critic/vf_loss"] > 0 and math.isfinite(records[1]["critic/vf_explained_var"])
    assert not all(torch.equal(final_weights(run.actor.model)[k], initial[k]) for k in initial)


def test_a_critic_beside_grpo_is_trained_and_changes_nothing_else():
    """critic.enable=true with grpo (verl allows it): the critic is trained on grpo's returns and reported,
    the actor's trajectory is the one without a critic."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    from .rl_helpers import final_weights

    base = [
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "trainer.total_training_steps=2",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.logger=[]",
    ]
    runs = [build_parts(load_train_config(None, base + extra)) for extra in ([], ["critic.enable=true"])]
    records = [fit(run) for run in runs]
    assert runs[0].critic is None and runs[1].critic is not None
    plain, with_critic = final_weights(runs[0].actor.model), final_weights(runs[1].actor.model)
    assert all(torch.equal(plain[k], with_critic[k]) for k in plain)
    for a, b in zip(*records):
        assert "critic/vf_loss" in b and "critic/vf_loss" not in a
        assert a["actor/pg_loss"] == b["actor/pg_loss"]
