"""`trainer.cpu_keep_freed_memory` (`rl/host_memory.py`): update steps on SmolLM2-135M's shapes with glibc's
malloc keeping freed memory for the run, against glibc's defaults; each a fresh process, interleaved.

A step: 4 micro-batches of 8 sequences × 68 tokens, the shapes of the SmolLM2 side-by-side with TRL. Each
micro-batch runs through a randomly initialised SmolLM2-135M-shaped Llama (width 576, 30 layers, tied
embeddings, vocabulary 49,152). The loss is the mean log-prob of random tokens at the last 33 positions:
the LM head on those alone, the log-softmax, the gather, then the backward. One AdamW step follows the 4
micro-batches. Every process runs ``--steps`` steps under the same context manager `splitproof train`
uses. Reported per variant: CPU seconds and page faults per step from step 3 on (the heap grows to the
run's peak in steps 1–2: AdamW's state is made in step 1), the first two steps apart, and the peak RSS.
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

NAME = "host_memory"
SMOLLM2 = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
QUICK = dict(SMOLLM2, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
WORK = dict(micro_batches=4, sequences=8, tokens=68, kept=33)
WORK_QUICK = dict(micro_batches=2, sequences=2, tokens=12, kept=5)
VARIANTS = {"kept": True, "defaults": False}
SETTLED = 2  # steps left out of the steady figures


def child(keep: bool, steps: int, quick: bool) -> dict:
    """``steps`` update steps in this process; per step its CPU seconds and page faults, and the peak RSS."""
    import torch

    from splitproof.hf_models import tiny_causal_lm
    from splitproof.rl.host_memory import kept_freed_memory

    torch.set_num_threads(1)
    work = WORK_QUICK if quick else WORK
    model = tiny_causal_lm("llama", seed=0, **(QUICK if quick else SMOLLM2)).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    generator = torch.Generator().manual_seed(0)
    shape = (work["sequences"], work["tokens"])
    vocab = model.config.vocab_size
    cpu, faults = [], []
    with kept_freed_memory(keep, print) as kept:
        for _ in range(steps):
            c0, f0 = time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(work["micro_batches"]):
                ids = torch.randint(vocab, shape, generator=generator)
                logits = model(input_ids=ids, logits_to_keep=work["kept"]).logits
                targets = torch.randint(vocab, (*shape[:1], work["kept"], 1), generator=generator)
                loss = -torch.log_softmax(logits, dim=-1).gather(-1, targets).mean()
                (loss / work["micro_batches"]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
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
        f"is {work['micro_batches']} micro-batches of {work['sequences']} × {work['tokens']} tokens (the LM head, "
        f"log-softmax and gather on the last {work['kept']} positions, backward) and one AdamW step; "
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
