"""Pipelined rollouts (async_training.staleness_steps = 1) against the synchronous step (k = 0).

Runs `splitproof train`'s embedded default (the built-in model on the built-in task, its recipe, one
torch thread per process, evaluation and checkpoints off) for a few steps with k = 0 and k = 1,
interleaved, and reads per step (the median over steps 3..N−2: step 1 starts the rollout process, step 2
still holds warm-up, the last two steps of a pipelined run hand no weights over):

- wall time of the loop iteration (on a shared machine this counts the waits for a core);
- process CPU time of the trainer per iteration, and, for k = 0, of generation alone (a wrapper around
  the step's ``generate``). With two free cores the pipelined step takes
  max(trainer CPU at k = 1, generation CPU at k = 0 + the rollout process's weight load): the CPU-based
  estimate of the ratio, independent of other jobs on the machine;
- the weight transfer: the trainer's copy into the shared buffer (``timing_s/weight_sync``) and, measured
  in this process on the same tensors, the rollout process's copy out (tied weights once, as the
  pipeline sends them) — for the built-in model and, when ``--smollm2 DIR`` names a converted
  SmolLM2-135M directory, for it.

``--model DIR`` runs the same comparison on a Hugging Face model directory instead (e.g. SmolLM2-135M,
docs/train.md) with a tiny batch of docs/train.md's SmolLM2 task — single-digit sums asked as a chat
message, written to a temporary folder — 4 prompts × 4 samples, 12 new tokens at most, one optimizer
step per step, float32, 6 steps, one run of each k; it writes the section ``pipeline-model``.

    python benchmarks/pipeline.py [--quick] [--steps N] [--smollm2 DIR]
    python benchmarks/pipeline.py --model DIR [--steps N] [--repeats R]   (default: 6 steps, 1 repeat)
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl

NAME, MODEL_NAME = "pipeline", "pipeline-model"
GOAL = 0.7
STEPS, MODEL_STEPS = 12, 6
QUICK_OVERRIDES = ["data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
SUM_REWARD = '''import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the sum alone, 0.5 for the sum as the last number of more text, else 0."""
    text = solution_str.strip().rstrip(".")
    if text == ground_truth:
        return 1.0
    numbers = re.findall(r"-?\\d+", text)
    return 0.5 if numbers and numbers[-1] == ground_truth else 0.0
'''


def _cpu() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime + resource.getrusage(resource.RUSAGE_SELF).ru_stime


def sum_task(model_dir: str, folder: Path) -> list[str]:
    """The overrides of a tiny run of ``model_dir`` on single-digit sums asked as a chat message (64
    prompts written to ``folder`` with their reward function): 4 prompts × 4 samples per step, at most 12
    new tokens at temperature 0.7, one optimizer step per step."""
    rng = random.Random(0)
    with open(folder / "sums.jsonl", "w") as f:
        for _ in range(64):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": f"What is {a}+{b}? Reply with the number only."}],
                        "data_source": "add2",
                        "reward_model": {"ground_truth": str(a + b)},
                    }
                )
                + "\n"
            )
    (folder / "sum_reward.py").write_text(SUM_REWARD)
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={folder / 'sums.jsonl'}",
        f"data.val_files={folder / 'sums.jsonl'}",
        f"custom_reward_function.path={folder / 'sum_reward.py'}",
        "data.max_prompt_length=64",
        "data.max_response_length=12",
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.optim.lr=1e-5",
        "actor_rollout_ref.rollout.temperature=0.7",
        "trainer.cpu_threads=1",
    ]


def one_run(k: int, steps: int, overrides: list[str]) -> dict:
    """A run (the embedded default with ``overrides``) with staleness k; per-iteration wall and trainer
    CPU, generation CPU."""
    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts
    from splitproof.rl.train import cpu_threads

    work = Path(tempfile.mkdtemp(prefix="splitproof-pipeline-"))
    cfg = load_train_config(
        None,
        [
            f"trainer.total_training_steps={steps}",
            f"trainer.default_local_dir={work}",
            "trainer.val_before_train=false",
            "trainer.test_freq=-1",
            "trainer.logger=[]",
            f"async_training.staleness_steps={k}",
            *overrides,
        ],
        on_notice=lambda m: None,
    )
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

    def timed_step(*args, **kwargs):
        wall, cpu = time.perf_counter(), _cpu()
        out = original(*args, **kwargs)
        marks.append((time.perf_counter() - wall, _cpu() - cpu))
        return out

    loop_mod.train_step = timed_step
    try:
        with cpu_threads(cfg.trainer.cpu_threads):
            run = build_parts(cfg)
            records = fit(run)
    finally:
        step_mod.generate, loop_mod.train_step = generate, original
    keep = slice(2, steps - 2) if steps >= 5 else slice(0, None)  # as kept() says
    return {
        "wall": bl.median([w for w, _ in marks[keep]]),
        "cpu": bl.median([c for _, c in marks[keep]]),
        "gen_cpu": bl.median(gen_cpu[keep]) if gen_cpu else None,
        "sync": bl.median([r["timing_s/weight_sync"] for r in records[keep]]) if k else None,
        "kl": [r.get("rollout_corr/kl") for r in records],
    }


def kept(steps: int) -> str:
    """Which steps the medians are taken over: 3..N-2 (step 1 starts the rollout process, step 2 still
    holds warm-up, the last two steps of a pipelined run hand no weights over); every step of a short run."""
    if steps >= 5:
        return f"steps 3..{steps - 2} (step 1 starts the rollout process; the last two steps hand no weights over)"
    return f"steps 1..{steps} (a short run: warm-up included)"


def transfer_cost(model, repeats: int) -> dict:
    """Median seconds of the two copies of one weight hand-over, as the pipeline makes them (tied weights
    once): into a shared buffer, out into a copy of the model (tied as the original)."""
    import copy

    from splitproof.rl.rollout.handover import aliases, copy_weights, shared_buffer

    weights = model.state_dict()
    tied = aliases(weights)
    buffer = shared_buffer(weights, tied)
    sent = {n: weights[n] for n in buffer}
    target = copy.deepcopy(model).state_dict()
    into, out = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        copy_weights(buffer, sent)
        into.append(time.perf_counter() - start)
        start = time.perf_counter()
        copy_weights(target, buffer)
        out.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for t in buffer.values())
    return {"bytes": size, "tied": sorted(tied), "into": bl.median(into), "out": bl.median(out)}


def compare(steps: int, repeats: int, overrides: list[str]) -> dict:
    """k = 0 and k = 1 runs, interleaved (the first k alternates), ``repeats`` of each."""
    results = {0: [], 1: []}
    for repeat in range(repeats):
        for k in (0, 1) if repeat % 2 == 0 else (1, 0):
            bl.log(f"[pipeline] repeat {repeat + 1}/{repeats}: k = {k}")
            results[k].append(one_run(k, steps, overrides))
    return results


def run(env: bl.Env) -> dict:
    import torch

    from splitproof.rl.config.schema import ModelConfig
    from splitproof.rl.models.policy import load_policy

    hand_overs = 3 if env.quick else 10
    if env.args.model:
        steps = env.args.steps or MODEL_STEPS
        with tempfile.TemporaryDirectory(prefix="splitproof-pipeline-task-") as folder:
            results = compare(steps, env.repeats, sum_task(env.args.model, Path(folder)))
        model = load_policy(ModelConfig(path=env.args.model), dtype=torch.float32)
        return {
            "steps": steps,
            "runs": results,
            "transfer": {Path(env.args.model).name: transfer_cost(model, hand_overs)},
        }
    steps = env.args.steps or (3 if env.quick else STEPS)
    results = compare(steps, env.repeats, QUICK_OVERRIDES if env.quick else [])
    models = {"built-in charlm": load_policy(ModelConfig(), dtype=torch.float32)}
    if env.args.smollm2:
        models["SmolLM2-135M"] = load_policy(ModelConfig(path=env.args.smollm2), dtype=torch.float32)
    return {
        "steps": steps,
        "runs": results,
        "transfer": {name: transfer_cost(m, hand_overs) for name, m in models.items()},
    }


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    runs = result["runs"]

    def med(k, key):
        return bl.median([r[key] for r in runs[k]])

    wall0, wall1, cpu0, cpu1, gen0 = med(0, "wall"), med(1, "wall"), med(0, "cpu"), med(1, "cpu"), med(0, "gen_cpu")
    load_out = next(iter(result["transfer"].values()))["out"]
    estimate = max(cpu1, gen0 + load_out) / cpu0
    rows = [
        ["wall ms / step (median)", bl.ms(wall0), bl.ms(wall1), f"{wall1 / wall0:.2f}×"],
        ["trainer CPU ms / step", bl.ms(cpu0), bl.ms(cpu1), f"{cpu1 / cpu0:.2f}×"],
        ["generation CPU ms / step (k = 0: in the trainer)", bl.ms(gen0), "(rollout process)", ""],
        ["weight hand-over, trainer side (`timing_s/weight_sync`)", "", bl.ms(med(1, "sync")), ""],
    ]
    transfer = [
        [
            name,
            f"{t['bytes'] / 2**20:.1f} MiB",
            ", ".join(f"`{n}`" for n in t["tied"]) or "none",
            bl.ms(t["into"]),
            bl.ms(t["out"]),
        ]
        for name, t in result["transfer"].items()
    ]
    if env.args.model:
        setup = (
            f"Setup: `{Path(env.args.model).name}` (float32) on single-digit sums asked as a chat message "
            "(docs/train.md's SmolLM2 task): 4 prompts × 4 samples per step, at most 12 new tokens, one "
            "optimizer step per step"
        )
    else:
        setup = (
            "Setup: `splitproof train`'s embedded default (its recipe: 128 prompts × 8 samples, 4 optimizer "
            "steps per step)"
        )
    body = [
        f"{setup}, evaluation and checkpoints off, {result['steps']} steps, one torch thread in the trainer and one in "
        f"the rollout process; k = 0 and k = 1 runs interleaved, {env.repeats} of each. Per step: the median over "
        f"{kept(result['steps'])}. Generation is "
        f"{gen0 / cpu0:.0%} of the synchronous step's CPU time.",
        bl.table(["", "k = 0", "k = 1", "k = 1 / k = 0"], rows),
        bl.table(
            ["goal", "clock", "measured", "verdict"],
            [
                [
                    "pipelined step ≤ 0.7× the synchronous one",
                    "CPU estimate: max(trainer, generation + load) / step",
                    f"{estimate:.2f}×",
                    bl.verdict(estimate, GOAL),
                ],
                [
                    "pipelined step ≤ 0.7× the synchronous one",
                    "wall (shared machine)",
                    f"{wall1 / wall0:.2f}×",
                    bl.verdict(wall1 / wall0, GOAL),
                ],
            ],
        ),
        f"Weight transfer per step (median over {3 if env.quick else 10} hand-overs, this process; tied weights "
        "are sent once):",
        bl.table(
            [
                "model",
                "weights sent (float32)",
                "tied names not sent",
                "into shared memory ms",
                "out into the rollout model ms",
            ],
            transfer,
        ),
    ]
    on = f" on {Path(env.args.model).name}" if env.args.model else ""  # the default's title is linked to
    return bl.section(
        NAME, f"Pipelined rollouts{on}: step time at k = 1 against k = 0", command, env, load_before, body
    )


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=2, quick_repeats=1)  # with --model: 1 (a run takes minutes)
    p.add_argument(
        "--steps", type=int, default=None, help=f"steps per run (default {STEPS}; {MODEL_STEPS} with --model)"
    )
    p.add_argument("--smollm2", default=None, help="a converted SmolLM2-135M directory (transfer cost)")
    p.add_argument(
        "--model", default=None, help="a Hugging Face model directory: the comparison on it, with a tiny batch of sums"
    )
    args = p.parse_args(argv)
    if args.model and not args.repeats:
        args.repeats = 1
    if args.model and args.smollm2:
        p.error(
            "--smollm2 adds a transfer row to the embedded default's section; with --model, the model's own "
            "transfer is measured: give one of them"
        )
    return bl.run_script(NAME, args, argv, run, render, section=MODEL_NAME if args.model else NAME)


if __name__ == "__main__":
    main()
