"""Where a step of `splitproof train`'s embedded default goes: the stages, and the trainer's own overhead.

Runs the embedded default (the built-in model on the built-in task, its recipe) through `splitproof
train`'s own entry for a few steps, one torch thread, and reads:

- `timing_s/*` of metrics.jsonl (wall time per stage: gen, reward, old_log_prob, ref, adv,
  update_actor, step; testing on evaluation steps);
- around the loop (wrappers, wall and process CPU time): every loop iteration, the same stages, the
  held-out evaluation, the record (console line + metrics.jsonl), a checkpoint when one is due.

Trainer overhead = the loop iteration minus generation, the log-prob passes (old, ref), the update and
the held-out evaluation, as a share of the iteration minus the evaluation. Goal: ≤ 5 %.

    python benchmarks/train_stages.py [--quick] [--steps N]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl
import stage_clock

NAME = "train_stages"
GOAL = 0.05
STEPS = 20
QUICK_OVERRIDES = [
    "data.train_batch_size=16",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "data.val_files=builtin://addition/test?size=40",
    "trainer.test_freq=2",
]
MODEL_STAGES = ("gen", "old_log_prob", "ref", "update")  # what the overhead leaves out, with "testing"
ROWS = (
    ("gen", "timing_s/gen", "generation"),
    ("reward", "timing_s/reward", "reward"),
    ("old_log_prob", "timing_s/old_log_prob", "old log-probs"),
    ("ref", "timing_s/ref", "reference log-probs"),
    ("adv", "timing_s/adv", "advantages"),
    ("update", "timing_s/update_actor", "update (actor)"),
    ("step_rest", None, "rest of the step (batching, metrics)"),
    ("testing", "timing_s/testing", "held-out evaluation"),
    ("logging", None, "record (console line + metrics.jsonl)"),
    ("checkpoint", None, "checkpoint"),
    ("loop_rest", None, "rest of the loop iteration"),
    ("total", None, "loop iteration"),
)


def run(env: bl.Env) -> dict:
    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl import train as train_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.models import learner as learner_mod
    from splitproof.rl.tracking import loggers as tracking

    steps = env.args.steps or (2 if env.quick else STEPS)
    work = Path(tempfile.mkdtemp(prefix="splitproof-train-stages-"))
    overrides = [
        f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={work / 'run'}",
        "trainer.resume_mode=disable",
    ] + (QUICK_OVERRIDES if env.quick else [])
    cfg = load_train_config(None, overrides)
    clock, built = stage_clock.Clock(), {}
    patches = [
        (step_mod, "generate", stage_clock.timed_call(clock, "gen")),
        (step_mod, "score_samples", stage_clock.timed_call(clock, "reward")),
        (learner_mod, "update_policy", stage_clock.timed_call(clock, "update")),
        (loop_mod, "evaluate_held_out", stage_clock.timed_call(clock, "testing")),
        (loop_mod, "save_run", stage_clock.timed_call(clock, "checkpoint")),
        (tracking.Tracker, "log", stage_clock.timed_call(clock, "logging")),
        (step_mod, "no_grad_log_probs", stage_clock.log_prob_passes(clock, built)),
        (loop_mod, "train_step", stage_clock.starts_step(clock, "step")),
        (train_mod, "fit", stage_clock.finishes(clock)),
        (train_mod, "build_parts", stage_clock.records_parts(built)),
    ]
    with stage_clock.patched(patches), open(os.devnull, "w") as console:
        train_mod.train(cfg, console=console)
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shutil.rmtree(work, ignore_errors=True)
    records = [r for r in records if r.get("step", 0) >= 1]
    report = clock.report(steps)
    per_step = {"wall": stage_table(report, "wall", records), "cpu": stage_table(report, "cpu", None)}
    return dict(
        steps=steps,
        per_step=per_step,
        overhead={c: overhead(per_step[c]) for c in per_step},
        config=dict(
            prompts=cfg.data.train_batch_size,
            n=cfg.actor_rollout_ref.rollout.n,
            mini=cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
            test_freq=cfg.trainer.test_freq,
            save_freq=cfg.trainer.save_freq,
            logger=list(cfg.trainer.logger),
            val=cfg.data.val_files,
        ),
    )


def stage_table(report: dict, clock: str, records: list[dict] | None) -> dict[str, list[float]]:
    """Seconds per step of every row of ``ROWS``: the stages from metrics.jsonl (wall) or the wrappers
    (CPU), the loop's parts from the wrappers."""
    steps = len(report["total"][clock])
    wrapped = {
        stage: report[stage][clock] if stage in report else [0.0] * steps
        for stage in ("gen", "reward", "old_log_prob", "ref", "update", "step", "testing", "logging", "checkpoint")
    }
    table = {"total": report["total"][clock]}
    for key, metric, _ in ROWS:
        if key in ("step_rest", "loop_rest", "total"):
            continue
        if records is not None and metric is not None:
            table[key] = [float(r.get(metric, 0.0)) for r in records]
        else:
            table[key] = wrapped.get(key, [0.0] * steps)
    step_time = [float(r["timing_s/step"]) for r in records] if records is not None else wrapped["step"]
    in_step = ("gen", "reward", "old_log_prob", "ref", "adv", "update")
    if records is None:  # the wrappers do not see the advantage stage alone: it stays in the step's rest
        table["adv"] = [0.0] * steps
    table["step_rest"] = [s - sum(table[k][i] for k in in_step) for i, s in enumerate(step_time)]
    table["loop_rest"] = [
        t - s - sum(table[k][i] for k in ("testing", "logging", "checkpoint"))
        for i, (t, s) in enumerate(zip(table["total"], step_time))
    ]
    return table


def overhead(table: dict[str, list[float]]) -> dict:
    """The trainer's share of the training time: (iteration − model stages − evaluation) / (iteration −
    evaluation), over the whole run and per step (median over steps 2..)."""

    def share(i: int) -> tuple[float, float]:
        base = table["total"][i] - table["testing"][i]
        return base - sum(table[k][i] for k in MODEL_STAGES), base

    pairs = [share(i) for i in range(len(table["total"]))]
    whole = sum(p[0] for p in pairs) / max(sum(p[1] for p in pairs), 1e-12)
    per_step = [a / b for a, b in pairs if b > 0]
    return dict(run=whole, median=bl.median(per_step[1:] if len(per_step) > 1 else per_step))


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    c = result["config"]
    steps = result["steps"]
    quick = " (quick: a smaller batch and held-out split)" if env.quick else ""
    evaluations = sum(1 for i in range(1, steps + 1) if bl_is_due(i, steps, c["test_freq"]))
    checkpoints = f"every {c['save_freq']} steps" if c["save_freq"] > 0 else "off (save_freq -1)"
    intro = (
        f"Setup: `splitproof train`'s embedded default{quick} — the built-in model on builtin://addition, "
        f"{c['prompts']} prompts × {c['n']} samples per step, {c['prompts'] // c['mini']} optimizer steps per "
        f"step, held-out evaluation every {c['test_freq']} steps ({c['val']}), checkpoints {checkpoints}, "
        f"loggers {', '.join(c['logger'])} (console to /dev/null) — for {steps} steps, one torch thread. "
        "Wall times of the stages are `timing_s/*` from metrics.jsonl; the loop's parts (record, checkpoint, "
        "the iteration) and every CPU time come from wrappers around the same functions. Per step: the median "
        f"over steps 2–{steps} (step 1 holds warm-up); per run: the sum over all steps. The held-out evaluation "
        f"runs on {evaluations} of the {steps} steps; the per-run columns carry its whole cost. The machine is "
        "shared (2 cores): the wall column includes waiting for a core, the CPU column does not."
    )
    wall, cpu = result["per_step"]["wall"], result["per_step"]["cpu"]
    total_wall, total_cpu = sum(wall["total"]), sum(cpu["total"])
    rows = []
    for key, _, label in ROWS:
        w, k = wall[key], cpu[key]
        rows.append(
            [
                label,
                bl.ms(bl.median(sides_steady(w))),
                bl.ms(bl.median(sides_steady(k))),
                f"{sum(w):.2f}",
                f"{100 * sum(w) / total_wall:.1f} %",
                f"{sum(k):.2f}",
                f"{100 * sum(k) / total_cpu:.1f} %",
            ]
        )
    table = bl.table(
        [
            "stage",
            "wall ms / step (median)",
            "CPU ms / step (median)",
            "wall s (run)",
            "share of wall",
            "CPU s (run)",
            "share of CPU",
        ],
        rows,
    )
    o = result["overhead"]
    goals = bl.table(
        ["goal", "clock", "measured (run)", "median per step", "verdict"],
        [
            [
                f"trainer overhead ≤ {GOAL:.0%} of a training step",
                clock,
                f"{100 * o[clock]['run']:.1f} %",
                f"{100 * o[clock]['median']:.1f} %",
                bl.verdict(o[clock]["run"], GOAL, digits=1, scale=100, unit=" points"),
            ]
            for clock in ("cpu", "wall")
        ],
    )
    note = (
        "Trainer overhead = loop iteration − (generation + old log-probs + reference log-probs + update + "
        "held-out evaluation), as a share of (loop iteration − held-out evaluation): the reward, the "
        "advantages, batching, metrics, the record and checkpoints. The advantage stage is timed only by "
        "`timing_s/adv` (wall); in the CPU column it is part of the step's rest."
    )
    return bl.section(
        NAME, "`splitproof train`: stages and trainer overhead", command, env, load_before, [intro, table, note, goals]
    )


def bl_is_due(step: int, total: int, freq: int) -> bool:
    from splitproof.rl.loop import is_due

    return is_due(step, total, freq)


def sides_steady(values: list[float]) -> list[float]:
    return values[1:] if len(values) > 1 else values


def main(argv: list[str] | None = None) -> dict:
    return bl.steps_script(__doc__, NAME, STEPS, argv, run, render)


if __name__ == "__main__":
    main()
