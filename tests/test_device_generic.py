"""The RL step is device-generic: every tensor it makes is made on the device of the data or the model it
comes from, or on the host on purpose (``device="cpu"``), never on torch's default device.

Proved on the CPU: the models are built as usual, then the whole run (rollout, rewards, log-probs, values,
advantages, the updates, a checkpoint saved and loaded) runs with torch's default device set to ``meta``.
A tensor made without a device would be a meta tensor, and meta tensors hold no data: reading one, or
mixing it with a CPU tensor, raises. So a run that completes and matches the ordinary run bitwise made
every one of its tensors where the data lives — on a GPU, that is the GPU.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from splitproof.rl.checkpoint.store import Trainable, load_checkpoint, save_checkpoint
from splitproof.rl.tracking.metrics import is_machine_dependent

from .rl_helpers import PPO, final_weights, run_trajectory, save_tiny_char_model, trajectory_config

CASES = {
    "grpo-kl-loss": [],
    "ppo-critic-packed": PPO + ["actor_rollout_ref.model.use_remove_padding=true"],
    "lora-kl-reward-correction": [
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.lora_alpha=8",
        "algorithm.use_kl_in_reward=true",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
    ],
    "remax-kl-cov-budget": [
        "algorithm.adv_estimator=remax",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
    ],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"))


@contextmanager
def default_device(device: str):
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def test_meta_default_device_is_a_real_trap():
    with default_device("meta"):
        made = torch.zeros(3)
        with pytest.raises((RuntimeError, NotImplementedError)):
            float(made.sum() + torch.ones(3, device="cpu").sum())


def meta_run_matches(cfg):
    """The run of ``cfg`` with torch's default device ``meta`` equals the ordinary run, bitwise."""
    want = run_trajectory(cfg)

    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    parts = build_parts(cfg)  # loading a model is not the step: it runs on the real default
    samples = []
    with default_device("meta"):
        records = fit(parts, on_step=lambda step, out: samples.append(out.scored.samples))
    assert [[(s.uid, s.sample_index, s.response_ids, s.log_probs) for s in step] for step in samples] == [
        [(s.uid, s.sample_index, s.response_ids, s.log_probs) for s in step] for step in want["samples"]
    ]
    for got, ref in zip(records, want["records"], strict=True):
        assert {k: v for k, v in got.items() if not is_machine_dependent(k)} == {
            k: v for k, v in ref.items() if not is_machine_dependent(k)
        }
    weights = final_weights(parts.actor.model)
    assert all(torch.equal(weights[k], want["weights"][k]) for k in want["weights"])


@pytest.mark.parametrize("case", list(CASES))
def test_a_run_makes_no_tensor_on_the_default_device(model_dir, case):
    meta_run_matches(trajectory_config(model_dir, 2, CASES[case]))


def test_a_multi_turn_run_makes_no_tensor_on_the_default_device(model_dir, monkeypatch):
    from .multiturn_format import digit_calls
    from .test_multiturn import MULTI_TURN

    digit_calls(monkeypatch)
    meta_run_matches(trajectory_config(model_dir, 2, MULTI_TURN))


def test_a_checkpoint_saves_and_loads_with_no_tensor_on_the_default_device(model_dir, tmp_path):
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    cfg = trajectory_config(model_dir, 1, PPO + ["trainer.critic_warmup=0"])
    parts = build_parts(cfg)
    fit(parts)  # the optimizers hold state
    moments = {k: v.clone() for k, v in parts.actor.optimizer.state[next(iter(parts.actor.optimizer.state))].items()}
    before = final_weights(parts.actor.model)
    critic = Trainable(parts.critic.model, parts.critic.optimizer, parts.critic.scheduler)
    with default_device("meta"):
        save_checkpoint(
            tmp_path,
            1,
            model=parts.actor.model,
            optimizer=parts.actor.optimizer,
            trainer_state={"cursor": torch.tensor([3], device="cpu")},
            lr_scheduler=parts.actor.scheduler,
            critic=critic,
        )
        with torch.no_grad():
            for p in parts.actor.model.parameters():
                p.add_(1.0)
        loaded = load_checkpoint(
            tmp_path / "global_step_1",
            model=parts.actor.model,
            optimizer=parts.actor.optimizer,
            lr_scheduler=parts.actor.scheduler,
            critic=critic,
        )
    assert loaded.step == 1 and loaded.trainer_state["cursor"].tolist() == [3]
    after = final_weights(parts.actor.model)
    assert all(torch.equal(after[k], before[k]) for k in before)
    restored = parts.actor.optimizer.state[next(iter(parts.actor.optimizer.state))]
    assert all(torch.equal(restored[k], moments[k]) for k in moments)
