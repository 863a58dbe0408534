"""Held-out score against training wall time: compare run groups (e.g. k = 0 and k = 1 over 4 seeds each)
at equal wall time, from their metrics.jsonl alone.

    python scripts/equal_time.py "k = 0=RUNS0" "k = 1=RUNS1" [--plot curve.png] [--at SECONDS ...]

Each ``LABEL=FOLDER`` is a group: every ``FOLDER/*/metrics.jsonl`` (e.g. ``scripts/embedded_curve.py``'s
``seedK/``) is one run. A run's training wall time at step s is the sum of ``timing_s/step`` over steps
1..s — start-up, evaluations (``timing_s/testing``) and checkpoint saving are left out, so that they cost
the groups the same (nothing). A pipelined run's checkpoint waits for the rollouts in flight, time no
step counts: compare pipelined runs made with ``trainer.save_freq=-1``. (Its first batch is generated
during the evaluation at step 0: at most one generation that no step counts.)

The held-out score (``val-core/<source>/<var>/mean@1``) at time t is read off each run's curve by linear
interpolation between its evaluations (the evaluation at step 0 sits at t = 0); a group's score is the
mean over its runs. Printed: each group's steps and time, the scores at equal time — by default at the
end of the shortest group (its mean total time) and at 1/4, 1/2, 3/4 of it — and at equal steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from embedded_curve import save_figure


def timed_curve(path: Path) -> tuple[str, list[tuple[int, float, float]]]:
    """(metric name, [(step, training seconds up to it, held-out score)]) of one run's metrics.jsonl."""
    seconds, points, name = 0.0, [], None
    for number, line in enumerate(path.read_text().splitlines(), 1):
        record = json.loads(line)
        step = record["step"]
        if step > 0:
            if "timing_s/step" not in record:
                raise SystemExit(f"{path}:{number}: step {step} has no timing_s/step")
            seconds += record["timing_s/step"]
        for key, value in record.items():
            if key.startswith("val-core/") and key.endswith("/mean@1"):
                if name not in (None, key):
                    raise SystemExit(f"{path}:{number}: two held-out metrics, {name} and {key}")
                name = key
                points.append((step, seconds, value))
    if not points:
        raise SystemExit(f"{path}: no held-out score (val-core/.../mean@1): run with evaluations")
    return name, points


def score_at(points: list[tuple[int, float, float]], t: float) -> float:
    """The score at training time ``t``, linear between evaluations; past the last one, None."""
    for (_, t0, s0), (_, t1, s1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return s0 if t1 == t0 else s0 + (s1 - s0) * (t - t0) / (t1 - t0)
    return points[0][2] if t == points[0][1] else None


def load_group(folder: Path) -> tuple[str, dict[str, list]]:
    runs = {}
    metric = None
    for path in sorted(folder.glob("*/metrics.jsonl")):
        name, runs[path.parent.name] = timed_curve(path)
        if metric not in (None, name):
            raise SystemExit(f"{path}: held-out metric {name}, another run of {folder} has {metric}")
        metric = name
    if not runs:
        raise SystemExit(f"{folder}: no */metrics.jsonl")
    return metric, runs


def report(groups: dict[str, dict[str, list]], at: list[float] | None) -> str:
    """The comparison as markdown tables: per group its runs' length; scores at equal time and steps."""
    totals = {label: statistics.mean(p[-1][1] for p in runs.values()) for label, runs in groups.items()}
    lines = ["| group | runs | steps | training wall time per run (s) | per step (s) |", "|---|---|---|---|---|"]
    for label, runs in groups.items():
        steps = {p[-1][0] for p in runs.values()}
        times = [p[-1][1] for p in runs.values()]
        lines.append(
            f"| {label} | {len(runs)} | {'/'.join(map(str, sorted(steps)))} | "
            f"{min(times):.1f}–{max(times):.1f} (mean {totals[label]:.1f}) | "
            f"{totals[label] / max(steps):.3f} |"
        )
    budget = min(totals.values())
    times = at or [budget * f for f in (0.25, 0.5, 0.75, 1.0)]
    lines += ["", "| training wall time (s) | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for t in times:
        cells = []
        for runs in groups.values():
            scores = [score_at(p, t) for p in runs.values()]
            cells.append("–" if None in scores else f"{statistics.mean(scores):.3f}")
        lines.append(f"| {t:.1f} | " + " | ".join(cells) + " |")
    steps = sorted(set.intersection(*({s for p in runs.values() for s, _, _ in p} for runs in groups.values())))
    lines += ["", "| step | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for step in steps:
        means = [statistics.mean(v for p in runs.values() for s, _, v in p if s == step) for runs in groups.values()]
        lines.append(f"| {step} | " + " | ".join(f"{m:.3f}" for m in means) + " |")
    return "\n".join(lines)


def plot(groups: dict[str, dict[str, list]], metric: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for color, (label, runs) in zip(plt.rcParams["axes.prop_cycle"].by_key()["color"], groups.items()):
        for i, points in enumerate(runs.values()):
            ax.plot(
                [t for _, t, _ in points],
                [v for _, _, v in points],
                color=color,
                marker="o",
                ms=2,
                alpha=0.7,
                label=label if i == 0 else None,
            )
    save_figure(fig, ax, "training wall time (s)", metric, path)


def parse_group(text: str) -> tuple[str, Path]:
    label, sep, folder = text.rpartition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=FOLDER")
    return label, Path(folder)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="+", type=parse_group, help="LABEL=FOLDER (FOLDER/*/metrics.jsonl)")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves (score against time) here")
    parser.add_argument("--at", type=float, nargs="*", default=None, help="training wall times (s) to compare at")
    args = parser.parse_args(argv)
    groups, metrics = {}, set()
    for label, folder in args.groups:
        metric, groups[label] = load_group(folder)
        metrics.add(metric)
    if len(metrics) > 1:
        raise SystemExit(f"the groups report different held-out metrics: {sorted(metrics)}")
    metric = metrics.pop()
    text = f"Held-out `{metric}` against training wall time (sum of `timing_s/step`):\n\n" + report(groups, args.at)
    print(text)
    if args.plot:
        plot(groups, metric, args.plot)
    return text


if __name__ == "__main__":
    main()
