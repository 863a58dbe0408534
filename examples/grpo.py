"""GRPO on the built-in addition task, in one file, from splitproof's building blocks.

    python examples/grpo.py --steps 100 --dtype fp32 --output runs/grpo

The built-in character model (``builtin://charlm``) learns to add two numbers (``builtin://addition``).
Each step: generate ``N`` responses per prompt → score them with the built-in rule → old log-probs →
GRPO advantages → the policy update → log. The settings are ``splitproof train``'s with the built-in
recipe (``splitproof/recipes/charlm.yaml`` over verl's defaults); in float64 this script reproduces that
run step for step — weights, sampled tokens and metrics (tests/test_example_grpo.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

from splitproof import LossConfig, RolloutBatch
from splitproof.advantages import compute_advantage
from splitproof.builtin import charlm_directory
from splitproof.engine import UpdateConfig, compute_log_probs, update_policy
from splitproof.hf_models import load_causal_lm
from splitproof.rl.data import PromptSampler, load_prompts
from splitproof.rl.rewards import score
from splitproof.rl.rollout import HFRollout, SamplingParams, requests_for, samples_to_tokens

# ---- hyper-parameters: the recipe's values under verl's names ---------------------------------------
TRAIN_FILES = "builtin://addition/train"  # data.train_files
VAL_FILES = "builtin://addition/test"  # data.val_files
TOTAL_STEPS = 100  # trainer.total_training_steps
TRAIN_BATCH_SIZE = 128  # data.train_batch_size: prompts per step
MAX_PROMPT_LENGTH = 16  # data.max_prompt_length
MAX_RESPONSE_LENGTH = 4  # data.max_response_length: generation budget and the responses' padded width
N = 8  # actor_rollout_ref.rollout.n: samples per prompt (the GRPO group)
TEMPERATURE, TOP_P, TOP_K = 1.0, 1.0, -1  # rollout.temperature / top_p / top_k
MAX_NUM_SEQS = 256  # rollout.max_num_seqs: sequences decoded at once (speed only)
LOG_PROB_MICRO_BATCH_SIZE = 1024  # rollout.log_prob_micro_batch_size_per_gpu (speed only)
PPO_MINI_BATCH_SIZE = 32  # actor.ppo_mini_batch_size: prompts per optimizer step (4 per training step)
PPO_MICRO_BATCH_SIZE = 256  # actor.ppo_micro_batch_size_per_gpu: sequences per forward/backward (speed only)
PPO_EPOCHS = 1  # actor.ppo_epochs
CLIP_RATIO = 0.2  # actor.clip_ratio (low and high)
CLIP_RATIO_C = 3.0  # actor.clip_ratio_c: dual-clip bound for negative advantages
LOSS_AGG_MODE = "token-mean"  # actor.loss_agg_mode
ENTROPY_COEFF = 0.0  # actor.entropy_coeff
GRAD_CLIP = 1.0  # actor.grad_clip
LR, WEIGHT_DECAY, BETAS = 5.0e-4, 0.01, (0.9, 0.999)  # actor.optim: AdamW
LR_WARMUP_STEPS = 0  # actor.optim.lr_warmup_steps; then a constant rate
NORM_ADV_BY_STD = True  # algorithm.norm_adv_by_std_in_grpo
TEST_FREQ = 10  # trainer.test_freq: held-out evaluation every k steps and at the last one (0: never)
VAL_BEFORE_TRAIN = True  # trainer.val_before_train
SAVE_FREQ = 10  # trainer.save_freq: the policy under --output every k steps and at the last one
TRAINER_SEED = 0  # trainer.seed: torch's global seed before the model is loaded
DATA_SEED = 1  # data.seed: the prompt order of each epoch
ROLLOUT_SEED = 42  # actor_rollout_ref.rollout.seed: keys every sampling stream (--seed)
DATA_LOADER_SEED = 42  # actor.data_loader_seed
CPU_THREADS = 1  # trainer.cpu_threads
TRAIN_STREAM, VAL_STREAM = 0, 1  # sampling streams: training samples, held-out (greedy) samples
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}  # actor.fsdp_config.model_dtype


def evaluate(rollout, dataset, tokenizer, step: int, total: int) -> dict[str, float]:
    """A greedy response to every held-out prompt (from its own sampling stream), scored by the rule: the
    mean reward per data source, verl's ``val-core/<source>/reward/mean@1``."""
    greedy = SamplingParams(
        n=1, temperature=0.0, do_sample=False, max_response_length=MAX_RESPONSE_LENGTH, seed=ROLLOUT_SEED
    )  # rollout.val_kwargs
    samples = rollout.generate(
        requests_for([(r.uid, r.prompt_ids) for r in dataset], 1), greedy, step=step, stream=VAL_STREAM
    )
    scores = score(None, dataset, samples, tokenizer, step=step, max_steps=total).scores.tolist()
    by_source: dict[str, list[float]] = {}
    for sample, value in zip(samples, scores):
        by_source.setdefault(dataset[sample.uid].data_source, []).append(value)
    return {f"val-core/{source}/reward/mean@1": sum(v) / len(v) for source, v in by_source.items()}


def step_metrics(scores, advantages, entropy, response_mask, results, lr: float) -> dict[str, float]:
    """The step's metrics under verl's names; ``actor/*`` are means over the step's optimizer steps."""
    mask, lengths = response_mask, response_mask.sum(dim=1).double()
    metrics = {
        "critic/score/mean": float(scores.double().mean()),
        "critic/advantages/mean": float(advantages[mask].double().mean()),
        "critic/advantages/max": float(advantages[mask].double().max()),
        "critic/advantages/min": float(advantages[mask].double().min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/clip_ratio": float((lengths >= MAX_RESPONSE_LENGTH).double().mean()),
    }
    for name in ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "grad_norm"):
        metrics[f"actor/{name}"] = sum(r.metrics[name] for r in results) / len(results)
    metrics["actor/lr"] = lr
    metrics["actor/entropy"] = float((mask.double() / mask.sum() * entropy.double()).sum())  # token-mean, as the loss
    return metrics


def log(records: list[dict], metrics: dict, step: int, out: Path | None) -> None:
    """Print the step's record and append it to ``records`` (and to ``out/metrics.jsonl``)."""
    records.append({"step": step, **metrics})
    print(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if not k.startswith("training/")))
    if out:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(records[-1]) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=TOTAL_STEPS, help="training steps")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES, help="the model's dtype")
    parser.add_argument("--seed", type=int, default=ROLLOUT_SEED, help="the sampling seed")
    parser.add_argument("--output", help="write metrics.jsonl and global_step_K/ (the policy) here")
    return parser.parse_args(argv)


def is_due(step: int, freq: int, last: int) -> bool:
    """verl's rule for ``test_freq`` and ``save_freq``: every ``freq`` steps and at the last; never if ``freq`` <= 0."""
    return freq > 0 and (step % freq == 0 or step == last)


def optimizer_and_schedule(model):
    """AdamW, and its rate × min(1, s / warm-up) at training step s (stepped once per training step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)
    warm_up = LR_WARMUP_STEPS
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / warm_up) if warm_up else 1.0)


def update_settings() -> UpdateConfig:
    """The policy update's settings: the loss (PPO clip, token-mean) and how the batch is split."""
    loss = LossConfig(
        loss_mode="vanilla",
        loss_agg_mode=LOSS_AGG_MODE,
        clip_ratio=CLIP_RATIO,
        clip_ratio_c=CLIP_RATIO_C,
        entropy_coeff=ENTROPY_COEFF,
        seed=DATA_LOADER_SEED,
    )
    return UpdateConfig(
        loss=loss,
        ppo_mini_batch_size=PPO_MINI_BATCH_SIZE,
        rollout_n=N,
        ppo_epochs=PPO_EPOCHS,
        data_loader_seed=DATA_LOADER_SEED,
        ppo_micro_batch_size_per_gpu=PPO_MICRO_BATCH_SIZE,
        grad_clip=GRAD_CLIP,
        temperature=TEMPERATURE,
    )


def output_folder(path: str | None) -> Path | None:
    """``path`` as a fresh output folder (an empty metrics.jsonl), or None."""
    if not path:
        return None
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("")
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    # ---- setup: threads, tokenizer, prompts, model, rollout engine, optimizer, the update's settings ----
    torch.set_num_threads(CPU_THREADS)
    float_dtype = torch.float64 if args.dtype == "fp64" else torch.float32  # log-probs, rewards, advantages
    tokenizer = AutoTokenizer.from_pretrained(charlm_directory(), local_files_only=True)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = load_prompts(TRAIN_FILES, tokenizer, max_prompt_length=MAX_PROMPT_LENGTH)
    val = load_prompts(VAL_FILES, tokenizer, max_prompt_length=MAX_PROMPT_LENGTH)
    sampler = PromptSampler(len(train), TRAIN_BATCH_SIZE, seed=DATA_SEED)  # each epoch shuffled by (seed, epoch)
    torch.manual_seed(TRAINER_SEED)
    model = load_causal_lm(charlm_directory(), dtype=DTYPES[args.dtype])
    rollout = HFRollout(model, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=pad_id, max_num_seqs=MAX_NUM_SEQS)
    sampling = SamplingParams(N, TEMPERATURE, TOP_P, TOP_K, max_response_length=MAX_RESPONSE_LENGTH, seed=args.seed)
    optimizer, schedule = optimizer_and_schedule(model)
    update = update_settings()
    out = output_folder(args.output)
    records, optimizer_steps = [], 0

    if VAL_BEFORE_TRAIN and TEST_FREQ > 0:
        log(records, evaluate(rollout, val, tokenizer, 0, args.steps), 0, out)
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        # 1. generate: N samples of each prompt; token t of sample j of prompt uid draws from the counter-based
        #    stream (seed, stream, step, uid, j, t), so no batching or order changes a token
        uids = sampler.next_batch()
        samples = rollout.generate(
            requests_for([(u, train[u].prompt_ids) for u in uids], N), sampling, step=step, stream=TRAIN_STREAM
        )
        # prompts left-padded, responses right-padded to MAX_RESPONSE_LENGTH (a fixed width, as the trainer pads)
        tokens, _ = samples_to_tokens(samples, response_width=MAX_RESPONSE_LENGTH, pad_token_id=pad_id)
        response_mask = tokens.response_mask  # every generated token, EOS included
        group_ids = torch.tensor([s.uid for s in samples])  # the samples of one prompt form a group (verl's uid)

        # 2. score: each row's built-in rule (by its data_source); the reward sits on the response's last token
        scores = score(None, [train[u] for u in uids], samples, tokenizer, step=step, max_steps=args.steps).scores
        rewards = torch.zeros(response_mask.shape, dtype=float_dtype)
        rewards[torch.arange(len(samples)), response_mask.sum(dim=1) - 1] = scores.to(float_dtype)

        # 3. old log-probs: the policy's own, recomputed (no grad, eval mode), and its entropy
        model.eval()
        old_log_probs, entropy = compute_log_probs(
            model, tokens, micro_batch_size=LOG_PROB_MICRO_BATCH_SIZE, temperature=TEMPERATURE, with_entropy=True
        )

        # 4. advantages: GRPO, (reward - group mean) / (group std + eps) on every response token
        advantages, _ = compute_advantage(
            "grpo", rewards, response_mask, group_ids.tolist(), norm_adv_by_std_in_grpo=NORM_ADV_BY_STD
        )

        # 5. update: the clipped policy loss, PPO_MINI_BATCH_SIZE prompts per optimizer step; then the schedule
        model.train()
        batch = RolloutBatch(
            prompts=tokens.prompts,
            responses=tokens.responses,
            attention_mask=tokens.attention_mask,
            response_mask=response_mask,
            old_log_probs=old_log_probs,
            advantages=advantages,
            index=group_ids,
        )
        results = update_policy(model, optimizer, batch, update, first_optimizer_step=optimizer_steps)
        optimizer_steps += len(results)
        lr = optimizer.param_groups[0]["lr"]
        schedule.step()

        # 6. log; held-out evaluation and the policy saved when due
        metrics = {
            "training/global_step": float(step),
            "training/epoch": float(sampler.epoch),
            **step_metrics(scores, advantages, entropy, response_mask, results, lr),
            "timing_s/step": time.perf_counter() - start,
        }
        if is_due(step, TEST_FREQ, args.steps):  # after the update, as verl validates
            metrics.update(evaluate(rollout, val, tokenizer, step, args.steps))
        log(records, metrics, step, out)
        if out and is_due(step, SAVE_FREQ, args.steps):
            model.save_pretrained(out / f"global_step_{step}")
    return records


if __name__ == "__main__":
    main()
