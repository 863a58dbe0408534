"""The learning curve, ``curve.png``: training reward and held-out score per step, and the keys of those
scores (which the console's progress line shows too)."""

from __future__ import annotations

import math
import os
from pathlib import Path

TRAIN_REWARD = "critic/score/mean"
MIN_SCORE_SPAN = 0.1  # the curve's score axis spans at least this, times max(1, |score|)


def is_held_out(key: str) -> bool:
    """The held-out score the console and curve.png show: a ``val-core/<source>/<var>/mean@<n>``."""
    return key.startswith("val-core/") and "/mean@" in key


def held_out_parts(key: str) -> tuple[str, str]:
    """``(source, "<var>/mean@<n>")`` of a held-out key; the source may itself hold ``/`` (``openai/gsm8k``)."""
    parts = key.split("/")
    return "/".join(parts[1:-2]), "/".join(parts[-2:])


def can_plot() -> bool:
    """matplotlib is installed (without it a run writes no curve.png, and says so)."""
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def write_curve(records: list[dict], path: str | os.PathLike, title: str = "") -> Path | None:
    """Training reward and held-out score per step as a PNG; None when no record has either."""
    figure = curve_figure(records, title)
    if figure is None:
        return None
    path = Path(path)
    figure.savefig(path)
    return path


def curve_figure(records: list[dict], title: str = ""):
    """The curve's matplotlib ``Figure`` (None when no record has a score): steps on integer ticks, and a
    score axis at least ``MIN_SCORE_SPAN`` × max(1, |score|) tall, so that a short run's rounding-level
    wiggles do not fill the plot."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r[TRAIN_REWARD]) for r in records if TRAIN_REWARD in r]
    held_out: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for record in records:
        for key in sorted(k for k in record if is_held_out(k)):
            held_out.setdefault(held_out_parts(key), []).append((record["step"], record[key]))
    if not train and not held_out:
        return None
    figure = Figure(figsize=(7, 4), dpi=110)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    if train:
        axes.plot(
            *zip(*train),
            label="training reward (critic/score/mean)",
            color="tab:blue",
            alpha=0.7,
            linewidth=1,
            marker="o" if len(train) == 1 else None,
        )  # a lone point needs a marker
    colors = ("tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for i, ((source, metric), points) in enumerate(held_out.items()):
        axes.plot(
            *zip(*points),
            marker="o",
            label=f"held-out {source} ({metric})",
            linewidth=1.5,
            color=colors[i % len(colors)],
        )
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    scores = [v for _, v in train] + [v for points in held_out.values() for _, v in points]
    finite = [v for v in scores if math.isfinite(v)]
    if finite:
        low, high = min(finite), max(finite)
        least = MIN_SCORE_SPAN * max(1.0, abs(low), abs(high))
        if high - low < least:
            middle = (low + high) / 2
            axes.set_ylim(middle - least / 2, middle + least / 2)
    axes.set_xlabel("step")
    axes.set_ylabel("score")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    return figure
