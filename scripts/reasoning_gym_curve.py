"""A reasoning-gym task the built-in model learns: GRPO on ``basic_arithmetic`` (two 2-digit terms, ``+``).

    python scripts/reasoning_gym_curve.py --out runs/rg_curve --seeds 0 1 2 3

The task is reasoning-gym's own (``reasoning-gym://basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&
max_digits=2&operators=["+"]&allow_parentheses=false``, the question as text with ``=`` appended,
``"Calculate 32 + 15.="``, the whole response as the answer, scored by the task's ``score_answer``). The
built-in model was trained on ``37+45=`` only and scores 0 on it, so, as ``scripts/tool_curve.py`` does:

1. Warm-up (supervised): from ``builtin://charlm``, prompt -> answer + ``<eos>`` of the train items (1,000,
   seed 0), stopped when the probability that sampling at T = 1 writes the answer, averaged over 256 fixed
   train items, reaches ``--warmup-target`` (``tool_curve.sampled_success``).
2. ``splitproof train`` from the warmed model for ``--steps`` GRPO steps; held-out success
   ``val-core/reasoning_gym/basic_arithmetic/acc/mean@4``: 4 samples at T = 1 per held-out item (200 items
   of ``seed=100000``: reasoning-gym draws item i of seed s from ``Random(s + i)``, so the held-out seed
   starts past the train indices), every ``--test-freq`` steps. Writes ``curve.json`` with the number of
   held-out questions that also occur among the train items. ``--task`` runs another task.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_charlm import examples
from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.rl.data.reasoning_gym import task_rows
from tool_curve import curve_run_keys, run_train, warm_up

TASK = (
    "reasoning-gym://basic_arithmetic?min_terms=2&max_terms=2&min_digits=2&max_digits=2&operators=[%22%2B%22]"
    "&allow_parentheses=false&prompt=text&suffix==&answer=raw"
)


def splits(task: str) -> tuple[str, str]:
    """(train, held-out) names of a ``reasoning-gym://`` task without size and seed."""
    return f"{task}&size=1000&seed=0", f"{task}&size=200&seed=100000"


def held_out_metric(task: str) -> str:
    """The held-out success's name, up to ``@n`` (``rollout.val_kwargs.n``)."""
    name = task.removeprefix("reasoning-gym://").split("?")[0]
    return f"val-core/reasoning_gym/{name}/acc/mean@"


def recipe(task: str, model_dir: Path, out: Path, seed: int, steps: int, test_freq: int) -> list[str]:
    """The run's overrides (the recipe documented in docs/train.md)."""
    train, test = splits(task)
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=128",
        "data.max_prompt_length=80",
        "data.max_response_length=5",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1024",
        "actor_rollout_ref.actor.optim.lr=5e-4",
        "algorithm.adv_estimator=grpo",
        *curve_run_keys(seed, steps, test_freq, out),
    ]


def table(results: dict) -> str:
    """docs/train.md's table: one row per seed."""
    lines = [
        "| seed | warm-up steps | held-out success per evaluation | gain | RL CPU time (wall) |",
        "|---|---|---|---|---|",
    ]
    for seed, r in results.items():
        values = [v for _, v in r["curve"]]
        lines.append(
            f"| {seed} | {r['warm_up']['steps']} | {' '.join(f'{v:.3f}' for v in values)} | "
            f"{100 * (values[-1] - values[0]):+.1f} points | {r['cpu_s']:.0f} s ({r['wall_s']:.0f} s) |"
        )
    gains = [100 * (r["curve"][-1][1] - r["curve"][0][1]) for r in results.values()]
    return "\n".join([*lines, "", f"mean gain {statistics.mean(gains):+.1f} points"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--task", default=TASK, help="a reasoning-gym:// name without size and seed")
    parser.add_argument("--warmup-target", type=float, default=0.2)
    parser.add_argument("--check-every", type=int, default=10)
    parser.add_argument("--warmup-steps", type=int, default=1500, help="at most this many warm-up steps")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--test-freq", type=int, default=10)
    parser.add_argument("extra", nargs="*", help="more key=value overrides")
    args = parser.parse_args()
    tokenizer = char_tokenizer()
    train, test = splits(args.task)
    train_rows = task_rows(train)
    pairs = [(p + a, [-100] * len(p) + a) for p, a in examples(tokenizer, train_rows)]
    overlap = len({r["prompt"] for r in task_rows(test)} & {r["prompt"] for r in train_rows})
    results = {}
    for seed in args.seeds:
        model_dir = args.out / f"warm_{seed}"
        start, cpu = time.perf_counter(), time.process_time()
        steps, success = warm_up(model_dir, pairs, args.warmup_steps, seed, args.warmup_target, args.check_every)
        warm = {"steps": steps, "train_sampled_success": success, "cpu_s": time.process_time() - cpu}
        print(f"seed {seed}: warm-up {steps} steps, train T=1 success {success:.3f}, {warm['cpu_s']:.0f} s CPU")
        out = args.out / f"run_{seed}"
        start, cpu = time.perf_counter(), time.process_time()
        overrides = recipe(args.task, model_dir, out, seed, args.steps, args.test_freq) + args.extra
        curve = run_train(out, overrides, held_out_metric(args.task))
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu  # one thread: CPU ≈ idle wall
        results[seed] = {"curve": curve, "wall_s": seconds, "cpu_s": cpu, "warm_up": warm}
        print(f"seed {seed}: {' '.join(f'{s}:{v:.3f}' for s, v in curve)}  ({seconds:.0f} s wall, {cpu:.0f} s CPU)")
    (args.out / "curve.json").write_text(json.dumps({"held_out_in_train": overlap, "runs": results}, indent=1))
    print(f"held-out questions also in the train items: {overlap} of 200")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
