"""Pipelined rollouts (async_training.staleness_steps = 1) against the synchronous step (k = 0).

Runs `splitproof train`'s embedded default (the built-in model on the built-in task, its recipe, one
torch thread per process, evaluation and checkpoints off) for a few steps with k = 0 and k = 1,
interleaved, and reads per step (the median over steps 3..N: step 1 starts the rollout process, step 2
still holds warm-up):

- wall time of the loop iteration (on a shared machine this counts the waits for a core);
- process CPU time of the trainer per iteration, and, for k = 0, of generation alone (a wrapper around
  the step's ``generate``). With two free cores the pipelined step takes
  max(trainer CPU at k = 1, generation CPU at k = 0 + the rollout process's weight load): the CPU-based
  estimate of the ratio, independent of other jobs on the machine;
- the weight transfer: the trainer's copy into the shared buffer (``timing_s/weight_sync``) and, measured
  in this process on the same tensors, the rollout process's copy out — for the built-in model and, when
  ``--smollm2 DIR`` names a converted SmolLM2-135M directory, for it.

    python benchmarks/pipeline.py [--quick] [--steps N] [--smollm2 DIR]
"""

from __future__ import annotations

import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl  # noqa: E402

NAME = "pipeline"
GOAL = 0.7
STEPS = 12
QUICK_OVERRIDES = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]


def _cpu() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime


def one_run(k: int, steps: int, quick: bool) -> dict:
    """A run of the embedded default with staleness k; per-iteration wall and trainer CPU, generation CPU."""
    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_run
    from splitproof.rl.train import cpu_threads

    work = Path(tempfile.mkdtemp(prefix="splitproof-pipeline-"))
    cfg = load_train_config(None, [f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={work}",
                                   "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.logger=[]",
                                   f"async_training.staleness_steps={k}"] + (QUICK_OVERRIDES if quick else []),
                            on_notice=lambda m: None)
    gen_cpu, marks = [], []
    generate = step_mod.generate

    def timed_generate(*args, **kwargs):
        start = _cpu()
        try:
            return generate(*args, **kwargs)
        finally:
            gen_cpu.append(_cpu() - start)

    step_mod.generate = timed_generate
    original = loop_mod.train_step

    def timed_step(run, step, uids):
        wall, cpu = time.perf_counter(), _cpu()
        out = original(run, step, uids)
        marks.append((time.perf_counter() - wall, _cpu() - cpu))
        return out

    loop_mod.train_step = timed_step
    try:
        with cpu_threads(cfg.trainer.cpu_threads):
            run = build_run(cfg)
            records = fit(run)
    finally:
        step_mod.generate, loop_mod.train_step = generate, original
    keep = slice(2, None) if steps > 3 else slice(0, None)
    return {"wall": bl.median([w for w, _ in marks[keep]]), "cpu": bl.median([c for _, c in marks[keep]]),
            "gen_cpu": bl.median(gen_cpu[keep]) if gen_cpu else None,
            "sync": bl.median([r["timing_s/weight_sync"] for r in records[keep]]) if k else None,
            "kl": [r.get("rollout_corr/kl") for r in records]}


def transfer_cost(model, repeats: int) -> dict:
    """Median seconds of the two copies of one weight hand-over: into a shared buffer, out into a model."""
    import torch

    weights = model.state_dict()
    buffer = {n: t.detach().clone().share_memory_() for n, t in weights.items()}
    target = {n: t.detach().clone() for n, t in weights.items()}
    into, out = [], []
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            for n, t in weights.items():
                buffer[n].copy_(t)
            into.append(time.perf_counter() - start)
            start = time.perf_counter()
            for n, t in buffer.items():
                target[n].copy_(t)
            out.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for t in weights.values())
    return {"bytes": size, "into": bl.median(into), "out": bl.median(out)}


def run(env: bl.Env) -> dict:
    steps = env.args.steps or (3 if env.quick else STEPS)
    results = {0: [], 1: []}
    for repeat in range(env.repeats):
        for k in ((0, 1) if repeat % 2 == 0 else (1, 0)):
            bl.log(f"[pipeline] repeat {repeat + 1}/{env.repeats}: k = {k}")
            results[k].append(one_run(k, steps, env.quick))
    from splitproof.rl.config.schema import ModelConfig
    from splitproof.rl.models.policy import load_policy

    import torch

    models = {"built-in charlm": load_policy(ModelConfig(), dtype=torch.float32)}
    if env.args.smollm2:
        models["SmolLM2-135M"] = load_policy(ModelConfig(path=env.args.smollm2), dtype=torch.float32)
    transfer = {name: transfer_cost(m, 3 if env.quick else 10) for name, m in models.items()}
    return {"steps": steps, "runs": results, "transfer": transfer}


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    runs = result["runs"]

    def med(k, key):
        return bl.median([r[key] for r in runs[k]])

    wall0, wall1, cpu0, cpu1, gen0 = med(0, "wall"), med(1, "wall"), med(0, "cpu"), med(1, "cpu"), med(0, "gen_cpu")
    load_out = next(iter(result["transfer"].values()))["out"]
    estimate = max(cpu1, gen0 + load_out) / cpu0
    rows = [["wall ms / step (median)", bl.ms(wall0), bl.ms(wall1), f"{wall1 / wall0:.2f}×"],
            ["trainer CPU ms / step", bl.ms(cpu0), bl.ms(cpu1), f"{cpu1 / cpu0:.2f}×"],
            ["generation CPU ms / step (k = 0: in the trainer)", bl.ms(gen0), "(rollout process)", ""],
            ["weight hand-over, trainer side (`timing_s/weight_sync`)", "", bl.ms(med(1, "sync")), ""]]
    transfer = [[name, f"{t['bytes'] / 2**20:.1f} MiB", bl.ms(t["into"]), bl.ms(t["out"])]
                for name, t in result["transfer"].items()]
    body = [
        f"Setup: `splitproof train`'s embedded default (its recipe: 128 prompts × 8 samples, 4 optimizer steps per "
        f"step), evaluation and checkpoints off, {result['steps']} steps, one torch thread in the trainer and one in "
        f"the rollout process; k = 0 and k = 1 runs interleaved, {env.repeats} of each. Per step: the median over "
        "steps 3.. (step 1 starts the rollout process). Generation is "
        f"{gen0 / cpu0:.0%} of the synchronous step's CPU time.",
        bl.table(["", "k = 0", "k = 1", "k = 1 / k = 0"], rows),
        bl.table(["goal", "clock", "measured", "verdict"], [
            ["pipelined step ≤ 0.7× the synchronous one", "CPU estimate: max(trainer, generation + load) / step",
             f"{estimate:.2f}×", bl.verdict(estimate, GOAL)],
            ["pipelined step ≤ 0.7× the synchronous one", "wall (shared machine)", f"{wall1 / wall0:.2f}×",
             bl.verdict(wall1 / wall0, GOAL)]]),
        f"Weight transfer per step (median over {3 if env.quick else 10} hand-overs, this process):",
        bl.table(["model", "weights (float32)", "into shared memory ms", "out into the rollout model ms"], transfer),
    ]
    return bl.section(NAME, "Pipelined rollouts: step time at k = 1 against k = 0", command, env, load_before, body)


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=2, quick_repeats=1)
    p.add_argument("--steps", type=int, default=None, help=f"steps per run (default {STEPS})")
    p.add_argument("--smollm2", default=None, help="a converted SmolLM2-135M directory (transfer cost)")
    return bl.run_script(NAME, p.parse_args(argv), argv, run, render)


if __name__ == "__main__":
    main()
