"""The built-in tool task's curve: GRPO with a calculator on ``builtin://product`` (3-digit products).

    python scripts/tool_curve.py --out runs/tool_curve --seeds 0 1 2 3

1. Warm-up (supervised, the built-in model's recipe pattern): from ``builtin://charlm``, a few steps of
   tool-use transcripts of the *train* split — prompt, the call ``mul(a,b)<eos>``, the tool response
   ``=a*b\\n`` exactly as the ``simple`` format appends it (no loss there), the answer and ``<eos>`` —
   stopped early so that much is left to learn: every ``--check-every`` steps the warm-up computes, on
   256 fixed *train* transcripts, the probability that sampling at T = 1 writes the transcript's call
   and answer (the product of the model's probabilities of its tokens, the tool's given: no sampling)
   and stops when its mean reaches ``--warmup-target`` (or at ``--warmup-steps``). A criterion in the
   measure RL improves, not a step count: every seed starts RL from the same sampled success. The test
   split is never trained on.
2. ``splitproof train`` from the warmed model, with the calculator (``multi_turn.enable=true``, format
   ``simple``, ``function_tool_path=pkg://splitproof.builtin.calculator``) and without it (same model, same
   settings, single turn), for ``--steps`` steps; held-out success is ``val-core/product/reward/mean@4``
   (4 samples at T = 1 per test problem, every ``--test-freq`` steps). Prints one line per run and
   writes ``curve.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_charlm import sft_loss
from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.rl.data.tasks import task_rows

ROOT = Path(__file__).resolve().parents[1]
TRAIN, TEST = "builtin://product/train", "builtin://product/test?size=200"


def transcript(tokenizer, row) -> tuple[list[int], list[int]]:
    """(input ids, labels): labels are the ids on the model's tokens, -100 on the prompt and the tool's."""
    a, b, answer = row["extra_info"]["a"], row["extra_info"]["b"], row["reward_model"]["ground_truth"]
    eos = tokenizer.eos_token_id
    parts = [
        (row["prompt"], False),
        (f"mul({a},{b})", True),
        (None, True),
        (f"={answer}\n", False),
        (answer, True),
        (None, True),
    ]
    ids, labels = [], []
    for text, trained in parts:
        piece = [eos] if text is None else tokenizer.encode(text, add_special_tokens=False)
        ids += piece
        labels += piece if trained else [-100] * len(piece)
    return ids, labels


def batch_of(pairs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (input ids, labels) of (ids, labels) pairs."""
    width = max(len(ids) for ids, _ in pairs)
    input_ids = torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in pairs])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in pairs])
    return input_ids, labels


@torch.no_grad()
def sampled_success(model, input_ids: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean over transcripts of ∏ p(label | prefix) over the labelled positions: the probability that
    sampling at T = 1 writes this call and this answer (the tool's tokens are given), with no sampling."""
    model.eval()
    log_probs = torch.log_softmax(model(input_ids=input_ids).logits[:, :-1].double(), dim=-1)
    model.train()
    target = labels[:, 1:]
    picked = log_probs.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(target == -100, 0.0).sum(dim=1).exp().mean().item()


def warm_up(
    out: Path,
    pairs: list,
    max_steps: int,
    seed: int,
    target: float,
    check_every: int,
    lr: float = 1e-3,
    batch: int = 64,
) -> tuple[int, float]:
    """SFT of the built-in model on (ids, labels) ``pairs`` until the T = 1 success of the first 256
    (``sampled_success``) reaches ``target``: (steps, success)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    tokenizer = char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(str(ROOT / "splitproof/builtin/charlm"), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed)
    probe = batch_of(pairs[:256], tokenizer.pad_token_id)
    model.train()
    step, success = 0, 0.0
    while step < max_steps and success < target:
        chosen = [pairs[i] for i in torch.randint(len(pairs), (batch,), generator=generator).tolist()]
        loss = sft_loss(model, *batch_of(chosen, tokenizer.pad_token_id))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step % check_every == 0 or step == max_steps:
            success = sampled_success(model, *probe)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return step, success


def curve_run_keys(seed: int, steps: int, test_freq: int, out: Path) -> list[str]:
    """The keys a curve's run shares with the other curves: held-out success under the policy's own sampling
    (T = 1, 4 samples per problem), beside greedy's; one seed for everything; one thread; the metrics file."""
    return [
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        "actor_rollout_ref.rollout.val_kwargs.n=4",
        f"actor_rollout_ref.rollout.seed={seed}",
        f"data.seed={seed}",
        f"trainer.seed={seed}",
        f"trainer.total_training_steps={steps}",
        f"trainer.test_freq={test_freq}",
        "trainer.cpu_threads=1",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={out}",
        "trainer.resume_mode=disable",
    ]


def train(model_dir: Path, out: Path, seed: int, steps: int, test_freq: int, tool: bool, extra: list[str]) -> list:
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={TRAIN}",
        f"data.val_files={TEST}",
        "data.train_batch_size=32",
        "data.max_prompt_length=16",
        "data.max_response_length=32",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        "actor_rollout_ref.actor.optim.lr=2e-4",
        "algorithm.adv_estimator=grpo",
        *curve_run_keys(seed, steps, test_freq, out),
    ]
    if tool:
        overrides += [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.format=simple",
            "actor_rollout_ref.rollout.multi_turn.function_tool_path=pkg://splitproof.builtin.calculator",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        ]
    return run_train(out, [*overrides, *extra], "val-core/product/reward/mean@")  # @n: rollout.val_kwargs.n


def run_train(out: Path, overrides: list[str], held_out: str) -> list[tuple[int, float]]:
    """``splitproof train`` with ``overrides`` (writing to ``out``): [(step, the held-out metric starting
    with ``held_out``)] from its metrics.jsonl."""
    from splitproof.cli import main

    code = main(["train", *overrides])
    if code != 0:
        raise SystemExit(f"splitproof train exited with {code}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(int(r["step"]), v) for r in records for k, v in r.items() if k.startswith(held_out)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument(
        "--warmup-target",
        type=float,
        default=0.45,
        help="stop the warm-up when the T = 1 success of train transcripts reaches this",
    )
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=600, help="at most this many warm-up steps")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without the tool")
    parser.add_argument("extra", nargs="*", help="more key=value overrides for both runs")
    args = parser.parse_args()
    results = {}
    for seed in args.seeds:
        model_dir = args.out / f"warm_{seed}"
        start = time.perf_counter()
        pairs = [transcript(char_tokenizer(), r) for r in task_rows(TRAIN)]
        steps, success = warm_up(model_dir, pairs, args.warmup_steps, seed, args.warmup_target, args.check_every)
        warm = {"steps": steps, "train_sampled_success": success, "wall_s": time.perf_counter() - start}
        print(
            f"seed {seed}: warm-up {steps} steps, train T=1 success {success:.3f}, {warm['wall_s']:.0f} s", flush=True
        )
        for tool in (True, False) if not args.no_baseline else (True,):
            name = f"{'tool' if tool else 'no_tool'}_{seed}"
            start, cpu = time.perf_counter(), time.process_time()
            curve = train(model_dir, args.out / name, seed, args.steps, args.test_freq, tool, args.extra)
            seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # one thread: CPU ≈ idle wall
            results[name] = {"curve": curve, "wall_s": seconds, "cpu_s": cpu, "warm_up": warm}
            print(
                f"{name}: {' '.join(f'{s}:{v:.3f}' for s, v in curve)}  ({seconds:.0f} s wall, {cpu:.0f} s CPU)",
                flush=True,
            )
    (args.out / "curve.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
