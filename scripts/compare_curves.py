"""Held-out curves of several `splitproof train` runs side by side: a Markdown table and a PNG.

    python scripts/compare_curves.py --out curves.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]

Each RUN_DIR is a run's ``trainer.default_local_dir`` (its ``metrics.jsonl`` is read); runs sharing a
label are averaged, step by step, into one line. The held-out score is ``val-core/<source>/reward/mean@n``
(the first such key), which is indexed by step: the machine's load changes the wall time, not the curve.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def held_out_curve(run_dir: str) -> dict[int, float]:
    """{step: held-out score} of one run."""
    curve = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        keys = sorted(k for k in record if k.startswith("val-core/"))
        if keys:
            curve[record["step"]] = record[keys[0]]
    return curve


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=RUN_DIR")
    parser.add_argument("--out", help="write a PNG of the curves here")
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[int, float]]] = defaultdict(list)
    for item in args.runs:
        label, _, folder = item.partition("=")
        runs[label].append(held_out_curve(folder))
    steps = sorted(set.intersection(*(set(c) for curves in runs.values() for c in curves)))
    print("| run | " + " | ".join(str(s) for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    means = {}
    for label, curves in runs.items():
        means[label] = [sum(c[s] for c in curves) / len(curves) for s in steps]
        for curve in curves:
            print(f"| {label} | " + " | ".join(f"{curve[s]:.3f}" for s in steps) + " |")
    if args.out:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, curves in runs.items():
            line, = ax.plot(steps, means[label], marker="o", label=f"{label} (mean of {len(curves)})")
            for curve in curves:
                ax.plot(steps, [curve[s] for s in steps], color=line.get_color(), alpha=0.25, linewidth=1)
        ax.set_xlabel("training step")
        ax.set_ylabel("held-out score (greedy)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
