"""What a refill round of dynamic sampling costs, against a plain step, on the built-in DAPO recipe.

Runs the built-in model's DAPO recipe (``--config builtin://charlm-dapo``) with
``data.gen_batch_size = train_batch_size`` (so every round beyond the first is a refill), then the same
settings without dynamic sampling (a plain step), for a few steps each, one torch thread. Wrappers read
the process CPU time of every generation round (generation + scoring of its prompts) and of every step;
``train/num_gen_batches`` of metrics.jsonl gives the rounds per step. CPU time, not wall time: the
machine is shared.

    python benchmarks/refill_round.py [--quick] [--steps N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl
import stage_clock

NAME = "refill_round"
STEPS = 10
QUICK_OVERRIDES = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def measure(overrides: list[str], steps: int) -> dict:
    """CPU seconds per step and per generation round (generate + score), and the rounds of each step."""
    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.run import build_parts

    cfg = load_train_config(
        "builtin://charlm-dapo",
        [f"trainer.total_training_steps={steps}", "data.val_files=null", "trainer.logger=[]", *overrides],
        on_notice=lambda m: None,
    )
    clock = stage_clock.Clock()
    patches = [
        (step_mod, "generate", stage_clock.timed_call(clock, "round")),
        (step_mod, "score_samples", stage_clock.timed_call(clock, "round")),
        (loop_mod, "train_step", stage_clock.starts_step(clock)),
    ]
    with stage_clock.patched(patches):
        run = build_parts(cfg)
        records = loop_mod.fit(run)
        clock.finish()
    rounds = [int(r.get("train/num_gen_batches", 1)) for r in records if r["step"] >= 1]
    per_round = [clock.cpu["round"][s + 1] / r for s, r in enumerate(rounds)]
    return dict(
        step_cpu=clock.totals()["cpu"],
        round_cpu=per_round,
        rounds=rounds,
        prompts=cfg.data.train_batch_size,
        n=cfg.actor_rollout_ref.rollout.n,
    )


def run(env: bl.Env) -> dict:
    steps = env.args.steps or (2 if env.quick else STEPS)
    extra = QUICK_OVERRIDES if env.quick else []
    batch_size = 16 if env.quick else None
    size = [f"data.gen_batch_size={batch_size}"] if batch_size else ["data.gen_batch_size=null"]
    dapo = measure([*extra, *size], steps)
    plain = measure([*extra, "algorithm.filter_groups.enable=false", "data.gen_batch_size=null"], steps)
    return dict(steps=steps, dapo=dapo, plain=plain)


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    dapo, plain = result["dapo"], result["plain"]
    steady = slice(1, None) if result["steps"] > 1 else slice(None)
    round_ms, plain_ms = bl.median(dapo["round_cpu"][steady]), bl.median(plain["step_cpu"][steady])
    dapo_ms = bl.median(dapo["step_cpu"][steady])
    rounds = dapo["rounds"]
    intro = (
        f"Setup: the built-in DAPO recipe (`--config builtin://charlm-dapo`: {dapo['prompts']} prompts × "
        f"{dapo['n']} samples per step, filter on `acc`, overlong buffer) with `data.gen_batch_size` = "
        f"`train_batch_size`, so every round after a step's first is a refill; against the same settings "
        f"without dynamic sampling (a plain step). {result['steps']} steps each, one torch thread, process "
        "CPU time (the machine is shared); medians over steps 2 on (step 1 holds warm-up)."
    )
    table = bl.table(
        ["measure", "CPU ms (median)", "vs a plain step"],
        [
            ["one generation round (generate + score)", bl.ms(round_ms), f"{round_ms / plain_ms:.2f} ×"],
            ["a plain step (one round, log-probs, update)", bl.ms(plain_ms), "1.00 ×"],
            ["a dynamic-sampling step", bl.ms(dapo_ms), f"{dapo_ms / plain_ms:.2f} ×"],
        ],
    )
    counts = ", ".join(f"{r}: {rounds.count(r)}" for r in sorted(set(rounds)))
    note = (
        f"Generation rounds per step over the run: mean {sum(rounds) / len(rounds):.2f}, max {max(rounds)} "
        f"(rounds: steps — {counts}). A refill round costs one round's generation and scoring; the "
        "log-prob passes and the update run once per step on the kept groups."
    )
    return bl.section(
        NAME, "Dynamic sampling: a refill round against a plain step", command, env, load_before, [intro, table, note]
    )


def main(argv: list[str] | None = None) -> dict:
    return bl.steps_script(__doc__, NAME, STEPS, argv, run, render)


if __name__ == "__main__":
    main()
