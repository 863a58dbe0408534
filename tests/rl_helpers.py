"""Shared pieces of the RL-layer tests: a tiny model saved with the built-in tokenizer, a config with a
reward that varies between samples, and a runner that keeps the rollouts and the final weights."""

from __future__ import annotations

from pathlib import Path

import torch

HERE = Path(__file__).parent

# memory and speed settings that must not change a training run: one piece, all ones, a packed token budget
# (the critic's keys apply when the run has a critic; its token budgets and packing follow the actor's)
LAYOUTS = {
    "one-piece": [],
    "ones": [
        "actor_rollout_ref.rollout.max_num_seqs=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "critic.forward_micro_batch_size_per_gpu=1",
    ],
    "budget-packed": [
        "actor_rollout_ref.rollout.max_num_seqs=5",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40",
        "critic.ppo_max_token_len_per_gpu=30",
        "critic.forward_max_token_len_per_gpu=50",
        "actor_rollout_ref.model.use_remove_padding=true",
    ],
}

# PPO with a critic: GAE with a discount and lambda below 1, a critic that learns fast enough to matter,
# a value clip that binds, and one step of critic warm-up (the actor waits at step 1)
PPO = [
    "algorithm.adv_estimator=gae",
    "algorithm.gamma=0.9",
    "algorithm.lam=0.8",
    "critic.optim.lr=0.02",
    "critic.cliprange_value=0.05",
    "trainer.critic_warmup=2",
]


def save_tiny_char_model(
    folder, *, dtype=torch.float32, arch: str = "llama", seed: int = 0, tied: bool = False, heads: int = 4, width=32
) -> str:
    """A random tiny causal LM over the built-in character tokenizer, saved as a Hugging Face directory
    (``tied``: its output layer is its input embedding; ``width`` hidden units in ``heads`` heads)."""
    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.hf_models import tiny_causal_lm

    tokenizer = char_tokenizer()
    model = tiny_causal_lm(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=width,
        num_layers=2,
        num_heads=heads,
        num_kv_heads=2,
        intermediate_size=2 * width,
        seed=seed,
        dtype=dtype,
        tie_word_embeddings=tied,
    )
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def small_grpo(model_dir: str, dtype: str) -> list[str]:
    """GRPO with a KL loss on 4 prompts x 4 samples per step, two minibatches, short sequences."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.actor.fsdp_config.model_dtype={dtype}",
        "data.train_batch_size=4",
        "data.max_prompt_length=16",
        "data.max_response_length=6",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=0.05",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.01",
        "algorithm.adv_estimator=grpo",
    ]


def trajectory_config(model_dir: str, steps: int, overrides: list[str], *, dtype: str = "fp64"):
    """GRPO on the built-in addition task with a reward that spreads (so advantages are non-zero)."""
    from splitproof.rl.config.load import load_train_config

    base = small_grpo(model_dir, dtype) + [
        "data.train_files=builtin://addition/train",
        "data.val_files=null",
        "actor_rollout_ref.actor.entropy_coeff=0.001",
        f"custom_reward_function.path={HERE / 'spread_reward.py'}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
    ]
    return load_train_config(None, base + list(overrides))


def final_weights(model) -> dict[str, torch.Tensor]:
    """A full (unsharded) float64 copy of the model's parameters."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from splitproof.engine.distributed import is_fsdp2

    if is_fsdp2(model):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    else:
        from splitproof.hf_models import unwrap

        state = unwrap(model).state_dict()
    return {k: v.detach().double().clone() for k, v in state.items()}


def run_trajectory(cfg, *, versions: bool = False) -> dict:
    """Train ``cfg`` to the end; the records, every step's rollouts, the initial and final weights (the
    critic's too, when the run has one); with ``versions``, the policy's weights after every step
    (``versions[v]``: after step v, 0 the initial ones) and the run itself."""
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    run = build_parts(cfg)
    initial = final_weights(run.actor.model)
    critic_initial = final_weights(run.critic.model) if run.critic is not None else None
    samples, after = [], [initial]

    def on_step(step, out):
        samples.append(out.scored.samples)
        if versions:
            after.append(final_weights(run.actor.model))

    records = fit(run, on_step=on_step)
    out = {"records": records, "samples": samples, "initial": initial, "weights": final_weights(run.actor.model)}
    if versions:
        out.update(versions=after, run=run)
    if run.critic is not None:
        out.update(critic_initial=critic_initial, critic_weights=final_weights(run.critic.model))
    return out


def relative_update_difference(a: dict, b: dict, initial: dict) -> float:
    """‖a − b‖ / ‖b − initial‖ over all parameters: a difference relative to the size of the update."""
    diff = sum(float(((a[k] - b[k]) ** 2).sum()) for k in b)
    update = sum(float(((b[k] - initial[k]) ** 2).sum()) for k in b)
    return (diff / update) ** 0.5 if update > 0 else float("inf")


def assert_same_trajectory(got, want):
    """Identical rollouts, weights (the critic's too) within 1e-10 of the update, every non-timing metric
    within 1e-9 relative."""
    import math

    from splitproof.rl.tracking.metrics import is_machine_dependent

    for step, (a, b) in enumerate(zip(got["samples"], want["samples"]), start=1):
        assert [(s.uid, s.sample_index, s.response_ids) for s in a] == [
            (s.uid, s.sample_index, s.response_ids) for s in b
        ], step
    assert relative_update_difference(got["weights"], want["weights"], want["initial"]) <= 1e-10
    if "critic_weights" in want:
        difference = relative_update_difference(got["critic_weights"], want["critic_weights"], want["critic_initial"])
        assert difference <= 1e-10, difference
    assert len(got["records"]) == len(want["records"])
    for a, b in zip(got["records"], want["records"]):
        keys = {k for k in b if not is_machine_dependent(k)}
        assert keys == {k for k in a if not is_machine_dependent(k)}
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), (k, a[k], b[k])


def train_overrides(
    model_dir: str, out_dir, steps: int, *, dtype: str = "fp32", reward: str = "graded", extra=()
) -> list[str]:
    """A small `splitproof train` command line (key=value overrides): GRPO on the built-in addition task
    with a tiny saved model and a graded reward, checkpoints and metrics under ``out_dir``."""
    return small_grpo(model_dir, dtype) + [
        "data.val_max_samples=8",
        f"custom_reward_function.path={HERE / 'step_reward.py'}",
        f"custom_reward_function.name={reward}",
        f"trainer.total_training_steps={steps}",
        "trainer.test_freq=2",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={out_dir}",
        *extra,
    ]


def assert_usage_error(code: int, err: str, words, out) -> None:
    """A user mistake as `splitproof train` reports it: exit 2, one error line (notices aside) holding
    each of ``words``, and no output directory ``out`` written."""
    lines = [line for line in err.splitlines() if not line.startswith("splitproof: notice:")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("splitproof: error: "), err
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert not out.exists()
