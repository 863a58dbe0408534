"""`trainer.cpu_keep_freed_memory` (`rl/host_memory.py`): update steps on SmolLM2-135M's shapes with glibc's
malloc keeping freed memory for the run, against glibc's defaults; each a fresh process, interleaved.

A step: one `update_policy` call (the engine's update: token-mean, clip 0.2, grad clip 1, one AdamW step)
over 32 sequences in 4 micro-batches of 8, with prompts of 20–41 and responses of 1–32 tokens. These are the
shapes of the SmolLM2 side-by-side run with TRL. The model is a randomly initialised SmolLM2-135M-shaped
Llama (width 576, 30 layers, tied embeddings, vocabulary 49,152). Every process builds its model and batch
and runs ``--steps`` steps under the context manager `splitproof train` uses. Reported per variant:
- CPU seconds and page faults per step from step 3 on (the heap grows to the run's peak in steps 1–2;
  AdamW's state is made in step 1), with the first two steps apart;
- the peak RSS.
The ratio kept / defaults is paired per repeat.

    python benchmarks/host_memory.py [--repeats 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl
from row_invariant import SMOLLM2

NAME = "host_memory"
QUICK = dict(SMOLLM2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
WORK = dict(micro_batches=4, sequences=8, prompt=41, response=32)
WORK_QUICK = dict(micro_batches=2, sequences=2, prompt=8, response=4)
VARIANTS = {"kept": True, "defaults": False}
SETTLED = 2  # steps left out of the steady figures


def child(keep: bool, steps: int, quick: bool) -> dict:
    """``steps`` updates in this process, the model and batch made inside the context as in a run; per step
    its CPU seconds and page faults, and the peak RSS."""
    import torch

    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine.update import update_policy
    from splitproof.engine.update_config import UpdateConfig
    from splitproof.hf_models import tiny_causal_lm
    from splitproof.loss_config import LossConfig
    from splitproof.rl.host_memory import kept_freed_memory

    torch.set_num_threads(1)
    work = WORK_QUICK if quick else WORK
    sequences = work["sequences"] * work["micro_batches"]
    config = UpdateConfig(
        loss=LossConfig(loss_agg_mode="token-mean"),
        ppo_mini_batch_size=sequences,
        ppo_micro_batch_size_per_gpu=work["sequences"],
    )
    cpu, faults = [], []
    with kept_freed_memory(keep, print) as kept:
        model = tiny_causal_lm("llama", seed=0, **(QUICK if quick else SMOLLM2)).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        batch = synthetic_rollout(model, sequences, work["prompt"], work["response"], seed=1, with_ref=False)
        for _ in range(steps):
            c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            update_policy(model, optimizer, batch, config)
            cpu.append(time.process_time() - c0)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return dict(kept=kept, cpu=cpu, faults=faults, peak=peak, params=sum(p.numel() for p in model.parameters()))


def run(env: bl.Env) -> dict:
    steps = env.args.steps or 5
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    loads = [bl.load_average()]
    for r in range(env.repeats):
        names = list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            command = [sys.executable, os.path.abspath(__file__), "--child", name, "--steps", str(steps)]
            done = subprocess.run(command + (["--quick"] if env.quick else []), capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{name} (repeat {r}) failed:\n{done.stderr[-3000:]}")
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
            loads.append(bl.load_average())
    if not all(x["kept"] for x in runs["kept"]):
        raise RuntimeError("the kept variant did not keep freed memory: not glibc, or the environment sets malloc")
    steady = {name: [bl.median(x["cpu"][SETTLED:]) for x in results] for name, results in runs.items()}
    ratio = bl.Ratio.paired(steady["kept"], steady["defaults"])
    return dict(runs=runs, steady=steady, ratio=ratio, steps=steps, loads=loads, work=WORK_QUICK if env.quick else WORK)


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    runs, steps, work = result["runs"], result["steps"], result["work"]
    rows = []
    for name, results in runs.items():
        steady_faults = bl.median([f for x in results for f in x["faults"][SETTLED:]])
        first = " / ".join(f"{bl.median([x['cpu'][i] for x in results]):.2f}" for i in range(min(SETTLED, steps)))
        rows.append(
            [
                f"`{VARIANTS[name]}`".lower(),
                f"{bl.median(result['steady'][name]):.2f}",
                f"{steady_faults:,.0f}",
                first,
                f"{bl.median([x['peak'] for x in results]) / 2**30:.2f}",
            ]
        )
    params = runs["kept"][0]["params"]
    setup = (
        f"Setup: a randomly initialised Llama of {params / 1e6:.1f} M parameters"
        f"{' (quick: tiny)' if env.quick else ' (SmolLM2-135M-Instruct shapes)'}, float32, one torch thread; a step "
        f"is one `update_policy` call (token-mean, clip 0.2, grad clip 1, AdamW) over {work['micro_batches']} "
        f"micro-batches of {work['sequences']} sequences: prompts of {work['prompt'] // 2}–{work['prompt']} and "
        f"responses of 1–{work['response']} tokens (`diagnose.synthetic.synthetic_rollout`); "
        f"{steps} steps per process, {env.repeats} repeat(s) of each variant, each a fresh process, interleaved. "
        f"Load average (1, 5, 15 min) before the run and after each process: {'; '.join(result['loads'])}."
    )
    table = bl.table(
        [
            "`trainer.cpu_keep_freed_memory`",
            f"CPU s per step from step {SETTLED + 1} (median)",
            "page faults per step from there",
            f"CPU s of steps 1 / {SETTLED}",
            "peak RSS GiB",
        ],
        rows,
    )
    ratio = result["ratio"]
    line = f"Steady step, kept / defaults (paired per repeat): {ratio.cell()} {ratio.spread()}."
    body = [setup, table, line]
    return bl.section(
        NAME, "glibc's malloc keeping freed memory: update steps on SmolLM2's shapes", command, env, load_before, body
    )


def main(argv: list[str] | None = None) -> dict | None:
    parser = bl.parser(__doc__.splitlines()[0], repeats=2, quick_repeats=1)
    parser.add_argument("--steps", type=int, default=None, help="steps per process (default 5)")
    parser.add_argument("--child", choices=tuple(VARIANTS), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(VARIANTS[args.child], args.steps, args.quick)))
        return None
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
