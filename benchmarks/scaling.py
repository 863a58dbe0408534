"""Step time vs minibatch size (linear cost), and the wall time of the default `splitproof diagnose` run.

One optimizer step over minibatches of 4 sizes, microbatches of a fixed size, every sequence the same
length, the sizes interleaved within each repeat. A linear least-squares fit t = a + b·n over the medians
shows whether the cost per sequence stays constant. The diagnose run is a fresh subprocess
(`python -m splitproof diagnose`, its defaults) in a temporary directory; skipped with --quick or
when splitproof.cli does not exist.

    python benchmarks/scaling.py [--quick] [--device cuda] [--repeats N] [--threads N] [--no-diagnose]
"""

from __future__ import annotations

import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl

NAME = "scaling"
LINEAR_TOLERANCE = 0.10  # time per sequence at each size within 10 % of the fit's slope + intercept share
DIAGNOSE_TIMEOUT_S = 600


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b x; returns (a, b, R²)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return a, b, (1 - ss_res / ss_tot) if ss_tot > 0 else 1.0


def run_diagnose(env: bl.Env) -> dict:
    """Wall time of `splitproof diagnose` (defaults) in a fresh process; a skip note when unavailable."""
    if env.quick:
        return dict(status="skipped", note="skipped in --quick mode")
    if env.args.no_diagnose:
        return dict(status="skipped", note="skipped (--no-diagnose)")
    if importlib.util.find_spec("splitproof.cli") is None:
        return dict(status="skipped", note="skipped: splitproof.cli does not exist yet")
    code = "import sys; sys.argv = ['splitproof', 'diagnose']; from splitproof.cli import main; sys.exit(main())"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as cwd:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=DIAGNOSE_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return dict(
                status="timeout", wall_s=time.perf_counter() - start, note=f"did not finish in {DIAGNOSE_TIMEOUT_S} s"
            )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tail = (proc.stdout.strip().splitlines() or [""])[-1][:160]
    if proc.returncode not in (0, 1):  # 1 = a verdict of "fail", still a complete run
        err = (proc.stderr.strip().splitlines() or [""])[-1][:160]
        return dict(status=f"exit {proc.returncode}", wall_s=wall, cpu_s=cpu, note=f"failed: {err}")
    return dict(status=f"exit {proc.returncode}", wall_s=wall, cpu_s=cpu, note=f"last line: {tail}")


def run(env: bl.Env) -> dict:
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine.update import update_policy
    from splitproof.engine.update_config import UpdateConfig
    from splitproof.loss_config import LossConfig

    if env.quick:
        P, T, micro, sizes = 8, 16, 2, (2, 4, 6, 8)
    else:
        P, T, micro, sizes = 32, 128, 8, (16, 32, 64, 128)
    model = bm.bench_model(env)
    batch = synthetic_rollout(model, max(sizes), P, T, seed=1, vary_lengths=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = bm.WeightSnapshot(model)
    parts = {n: batch.select(list(range(n))) for n in sizes}
    configs = {
        n: UpdateConfig(loss=LossConfig(), ppo_mini_batch_size=n, ppo_micro_batch_size_per_gpu=micro) for n in sizes
    }
    variants = {str(n): (lambda n=n: update_policy(model, optimizer, parts[n], configs[n])) for n in sizes}
    bl.log(f"[{NAME}] minibatch sizes {sizes}")
    times = bl.interleaved(variants, repeats=env.repeats, env=env, prepare=snapshot.restore)
    medians = [bl.median(times[str(n)]) for n in sizes]
    a, b, r2 = linear_fit(list(sizes), medians)
    rows = []
    for n, t in zip(sizes, medians):
        rows.append(
            dict(
                sequences=n,
                tokens=int(parts[n].attention_mask.sum()),
                microbatches=-(-n // micro),
                step_s=t,
                wall_s=bl.median(times.wall[str(n)]),
                per_sequence_s=t / n,
                vs_linear=t / (medians[0] * n / sizes[0]),
                fit_s=a + b * n,
            )
        )
    bl.log(f"[{NAME}] splitproof diagnose (default run)")
    diagnose = run_diagnose(env)
    return dict(
        rows=rows,
        intercept=a,
        slope=b,
        r2=r2,
        micro=micro,
        prompt=P,
        response=T,
        model=bm.describe_model(model),
        diagnose=diagnose,
        clock=times.clock,
    )


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    headers = [
        "minibatch (sequences)",
        "tokens",
        "microbatches",
        "step ms",
        "step ms (wall)",
        "ms per sequence",
        "step / (smallest × size ratio)",
        "fit a + b·n (ms)",
    ]
    rows = [
        [
            r["sequences"],
            r["tokens"],
            r["microbatches"],
            bl.ms(r["step_s"]),
            bl.ms(r["wall_s"]),
            f"{r['per_sequence_s'] * 1e3:.2f}",
            f"{r['vs_linear']:.3f}",
            bl.ms(r["fit_s"]),
        ]
        for r in result["rows"]
    ]
    fit = bl.table(
        ["fit", "intercept a (ms)", "slope b (ms / sequence)", "R²", "intercept share at the largest size"],
        [
            [
                "t = a + b·n",
                bl.ms(result["intercept"]),
                f"{result['slope'] * 1e3:.2f}",
                f"{result['r2']:.4f}",
                f"{100 * result['intercept'] / result['rows'][-1]['step_s']:.1f} %",
            ]
        ],
    )
    d = result["diagnose"]
    diag = bl.table(
        ["run", "status", "wall s", "CPU s (child process)", "note"],
        [
            [
                "`splitproof diagnose` (defaults, fresh process incl. imports)",
                d["status"],
                f"{d['wall_s']:.1f}" if "wall_s" in d else "—",
                f"{d['cpu_s']:.1f}" if "cpu_s" in d else "—",
                d["note"].replace("|", "\\|"),
            ]
        ],
    )
    setup = (
        f"Setup: {result['model']}; every sequence {result['prompt']} prompt + {result['response']} response "
        f"tokens; microbatches of {result['micro']}; one optimizer step per call, vanilla loss, SGD; medians over "
        f"the repeats. 'step / (smallest × size ratio)' is 1.000 for perfectly linear cost. "
        f"{bl.clock_note(result['clock'])}"
    )
    return bl.section(
        NAME,
        "Scaling with minibatch size; diagnose wall time",
        command,
        env,
        load_before,
        [setup, bl.table(headers, rows), fit, diag],
    )


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=5)
    p.add_argument("--no-diagnose", action="store_true", help="leave out the `splitproof diagnose` timing")
    args = p.parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
