"""Measure the embedded default (`splitproof train` with no arguments) over several seeds and write the
held-out curves into docs/train.md (between its `embedded-default curve` markers) and docs/embedded-default.png.

    python scripts/embedded_curve.py --runs runs/embedded --seeds 4 [--write] [key=value ...]

Seed 0 is the default run itself; seed k > 0 sets ``data.seed=k+1`` (the prompt order) and
``actor_rollout_ref.rollout.seed=42+k`` (every sampled token). Each run is a separate
``python -m splitproof train`` process: its wall time includes start-up, its CPU time is the process's
user + system time. A run folder that already holds a finished run (``timing.json``) is reused.
Extra ``key=value`` arguments go to every run (e.g. ``algorithm.adv_estimator=gae``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- BEGIN embedded-default curve", "<!-- END embedded-default curve -->"


def seed_overrides(seed: int) -> list[str]:
    return [] if seed == 0 else [f"data.seed={seed + 1}", f"actor_rollout_ref.rollout.seed={42 + seed}"]


def run_seed(folder: Path, seed: int, extra: list[str]) -> dict:
    """One finished run's timing (reused when ``folder`` holds one)."""
    timing_file = folder / "timing.json"
    if timing_file.exists():
        return json.loads(timing_file.read_text())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "splitproof",
            "train",
            f"trainer.default_local_dir={folder}",
            "trainer.resume_mode=disable",
            *seed_overrides(seed),
            *extra,
        ],
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    timing = {
        "wall_s": time.perf_counter() - start,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "load_before": os.getloadavg()[0],
    }
    timing_file.write_text(json.dumps(timing))
    return timing


def held_out_curve(folder: Path) -> tuple[str, list[tuple[int, float]]]:
    """(metric name, [(step, held-out score)]) from the run's metrics.jsonl."""
    points, name = [], None
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith("val-core/") and key.endswith("/mean@1"):
                name = key
                points.append((record["step"], value))
    return name, points


def section(curves: dict[int, list], timings: dict[int, dict], metric: str, extra: list[str]) -> str:
    steps = [s for s, _ in curves[0]]
    header = "| step | " + " | ".join(f"seed {k}" for k in curves) + " | mean |"
    lines = [header, "|" + "---|" * (len(curves) + 2)]
    for i, step in enumerate(steps):
        values = [curves[k][i][1] for k in curves]
        lines.append(f"| {step} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {statistics.mean(values):.3f} |")
    gains = [100 * (c[-1][1] - c[0][1]) for c in curves.values()]
    walls = [t["wall_s"] for t in timings.values()]
    cpus = [t["cpu_s"] for t in timings.values()]
    command = " ".join(["splitproof train", *extra]).strip()
    loads = [t["load_before"] for t in timings.values() if "load_before" in t]
    load = f" (load average {min(loads):.1f}–{max(loads):.1f} when each run started)" if loads else ""
    return "\n".join(
        [
            f"Held-out score `{metric}` (greedy, 500 held-out problems) of `{command}` over {len(curves)} seeds "
            "(seed 0 is the default; seed k sets `data.seed=k+1 actor_rollout_ref.rollout.seed=42+k`), "
            "measured with `scripts/embedded_curve.py`:",
            "",
            *lines,
            "",
            f"Gain from the first evaluation to the last: {min(gains):+.1f} to {max(gains):+.1f} points "
            f"(mean {statistics.mean(gains):+.1f}). Per run: {min(cpus):.0f}–{max(cpus):.0f} s of CPU time "
            f"(one thread, start-up included) and {min(walls):.0f}–{max(walls):.0f} s of wall time on the "
            f"2-core build machine{load}.",
            "",
            "![held-out score per step, one line per seed](embedded-default.png)",
        ]
    )


def plot(curves: dict[int, list], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, points in curves.items():
        ax.plot([s for s, _ in points], [v for _, v in points], marker="o", ms=3, label=f"seed {seed}")
    save_figure(fig, ax, "training step", metric, path)


def save_figure(fig, ax, xlabel: str, metric: str, path: Path) -> None:
    """Label the axes (the score's name from ``metric``), add a grid and the legend, write ``path``."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(metric.split("/", 1)[1])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_section(text: str, docs: Path, begin: str = BEGIN, end: str = END) -> None:
    """Replace what lies between the ``begin`` and ``end`` markers of ``docs`` with ``text``."""
    doc = docs.read_text()
    pattern = re.compile(re.escape(begin) + r"[^\n]*\n.*?" + re.escape(end), re.S)
    if not pattern.search(doc):
        raise SystemExit(f"{docs}: no {begin!r} ... {end!r} markers")
    doc = pattern.sub(lambda m: m.group(0).split("\n", 1)[0] + "\n" + text + "\n" + end, doc)
    docs.write_text(doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True, help="a folder for the runs (seedK/ each)")
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="write docs/train.md and docs/embedded-default.png")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    curves, timings, metric = {}, {}, None
    for seed in range(args.seeds):
        folder = args.runs / f"seed{seed}"
        timings[seed] = run_seed(folder, seed, args.overrides)
        metric, curves[seed] = held_out_curve(folder)
        print(
            f"seed {seed}: {curves[seed][0][1]:.3f} -> {curves[seed][-1][1]:.3f}, "
            f"{timings[seed]['wall_s']:.0f} s wall, {timings[seed]['cpu_s']:.0f} s CPU",
            flush=True,
        )
    text = section(curves, timings, metric, args.overrides)
    print(text)
    if args.write:
        write_section(text, ROOT / "docs" / "train.md")
        plot(curves, metric, ROOT / "docs" / "embedded-default.png")


if __name__ == "__main__":
    main()
