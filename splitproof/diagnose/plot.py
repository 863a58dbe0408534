"""``--plot PATH``: the picture for a bug report — update difference per split, log scale, next to the
legacy (per-microbatch) column and the floating-point control. matplotlib is an optional extra."""

from __future__ import annotations

import math


class PlotUnavailable(RuntimeError):
    pass


TINY = 1e-20  # where an exact zero is drawn on the log axis


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'splitproof[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _v(x) -> float:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return float("nan")
    return max(float(x), TINY)


def _series(splits: list[dict]) -> dict[str, list[float]]:
    return {
        "splitproof": [_v(s["update_rel_diff"]) for s in splits],
        "legacy (per-microbatch)": [_v(s["legacy"]["update_rel_diff"]) if "legacy" in s else float("nan")
                                               for s in splits],
        "control (floating-point floor)": [_v(s["control"]["update_rel_diff"]) for s in splits],
        "bound": [_v(s["tolerance"]["update_rel_diff"]) for s in splits],
    }


def _draw(ax, labels: list[str], series: dict[str, list[float]], title: str) -> None:
    colors = {"splitproof": "#1f77b4", "legacy (per-microbatch)": "#d62728",
              "control (floating-point floor)": "#7f7f7f"}
    bars = [k for k in colors if any(not math.isnan(v) for v in series[k])]
    width = 0.8 / max(1, len(bars))
    xs = list(range(len(labels)))
    for i, name in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        ax.bar([x + offset for x in xs], series[name], width=width, label=name, color=colors[name])
    ax.plot(xs, series["bound"], "k_", markersize=18, mew=2, label="pass bound", linestyle="none")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=30 if len(labels) <= 12 else 90, ha="right", fontsize=8)
    ax.set_ylabel("relative update difference")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)


def write_plot(report: dict, path: str) -> None:
    """One panel per scenario (splits on the x axis); the sweep as one panel of modes (worst split)."""
    plt = require_matplotlib()
    records = report["scenarios"]
    panels = []
    singles = [r for r in records if r.get("group") != "sweep"]
    for r in singles:
        panels.append((r["name"], [s["split"] for s in r["splits"]], _series(r["splits"])))
    sweep = [r for r in records if r.get("group") == "sweep"]
    if sweep:
        worst = {k: [] for k in ("splitproof", "legacy (per-microbatch)", "control (floating-point floor)",
                                 "bound")}
        for r in sweep:
            s = _series(r["splits"])
            for k in worst:
                vals = [v for v in s[k] if not math.isnan(v)]
                worst[k].append(max(vals) if vals else float("nan"))
        panels.append(("sweep (worst split per mode)", [r["title"].replace(" x ", "/") for r in sweep], worst))
    fig_w = max(10.0, min(26.0, 0.35 * max(len(p[1]) for p in panels) + 6))
    heights = [6.0 if len(p[1]) > 12 else 3.6 for p in panels]  # room for rotated mode names
    fig, axes = plt.subplots(len(panels), 1, figsize=(fig_w, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (title, labels, series) in zip(axes[:, 0], panels):
        _draw(ax, labels, series, title)
    axes[0, 0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(f"splitproof diagnose — {'PASS' if report['passed'] else 'FAIL'}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
