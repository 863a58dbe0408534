"""``--plot PATH``: the picture for a bug report — what each verdict is based on. Per scenario, two panels:
the relative difference of the accumulated gradient and of the parameter update, per split, on a log
scale, for splitproof, the legacy (per-microbatch) variant and the floating-point control, with the pass
bound of each. The format follows the file's extension (.png, .pdf, .svg). matplotlib is an optional extra.
"""

from __future__ import annotations

import math
import os


class PlotUnavailable(RuntimeError):
    pass


FORMATS = ("png", "pdf", "svg")
TINY = 1e-20  # where an exact zero is drawn on the log axis
QUANTITIES = (("grad_rel_diff", "gradient (before clipping)"), ("update_rel_diff", "update (after clipping)"))
SERIES = {"splitproof": "#1f77b4", "legacy (per-microbatch)": "#d62728", "control (floating-point floor)": "#7f7f7f"}


def require_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'splitproof[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_format(path: str) -> str:
    """The file format named by ``path``'s extension; ValueError for anything but .png, .pdf, .svg."""
    suffix = os.path.splitext(path)[1].lower().lstrip(".")
    if suffix not in FORMATS:
        raise ValueError(f"{path}: unsupported plot format {suffix or '(no extension)'!r}; use .png, .pdf or .svg")
    return suffix


def _v(x) -> float:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return float("nan")
    return max(float(x), TINY)


def _series(splits: list[dict], key: str) -> dict[str, list[float]]:
    """The bars of one panel (``key`` = grad_rel_diff or update_rel_diff) and the bound of each split."""
    return {
        "splitproof": [_v(s[key]) for s in splits],
        "legacy (per-microbatch)": [_v(s["legacy"][key]) if "legacy" in s else float("nan") for s in splits],
        "control (floating-point floor)": [_v(s["control"][key]) for s in splits],
        "bound": [_v(s["tolerance"][key]) for s in splits],
    }


def _worst(records: list[dict], key: str) -> dict[str, list[float]]:
    """The sweep: per mode, the largest value of each series over its splits."""
    worst: dict[str, list[float]] = {name: [] for name in list(SERIES) + ["bound"]}
    for r in records:
        for name, values in _series(r["splits"], key).items():
            finite = [v for v in values if not math.isnan(v)]
            worst[name].append(max(finite) if finite else float("nan"))
    return worst


def _draw(ax, labels: list[str], series: dict[str, list[float]], title: str, ylabel: str) -> None:
    bars = [k for k in SERIES if any(not math.isnan(v) for v in series[k])]
    width = 0.8 / max(1, len(bars))
    xs = list(range(len(labels)))
    for i, name in enumerate(bars):
        offset = (i - (len(bars) - 1) / 2) * width
        ax.bar([x + offset for x in xs], series[name], width=width, label=name, color=SERIES[name])
    ax.plot(xs, series["bound"], "k_", markersize=18, mew=2, label="pass bound", linestyle="none")
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels(labels, rotation=30 if len(labels) <= 12 else 90, ha="right", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)


def write_plot(report: dict, path: str) -> None:
    """One row per scenario (the sweep: one row of modes, worst split), gradient left, update right."""
    fmt = plot_format(path)
    plt = require_matplotlib()
    records = report["scenarios"]
    rows = [
        (r["name"], [s["split"] for s in r["splits"]], {k: _series(r["splits"], k) for k, _ in QUANTITIES})
        for r in records
        if r.get("group") != "sweep"
    ]
    sweep = [r for r in records if r.get("group") == "sweep"]
    if sweep:
        rows.append(
            (
                "sweep (worst split per mode)",
                [r["title"].replace(" x ", "/") for r in sweep],
                {k: _worst(sweep, k) for k, _ in QUANTITIES},
            )
        )
    widest = max(len(labels) for _, labels, _ in rows)
    fig_w = max(12.0, min(36.0, 0.5 * widest + 8))
    heights = [6.0 if len(labels) > 12 else 3.6 for _, labels, _ in rows]  # room for rotated mode names
    fig, axes = plt.subplots(
        len(rows), 2, figsize=(fig_w, sum(heights)), squeeze=False, gridspec_kw={"height_ratios": heights}
    )
    for (name, labels, by_key), panel in zip(rows, axes):
        for ax, (key, what) in zip(panel, QUANTITIES):
            _draw(ax, labels, by_key[key], f"{name}: {what}", f"relative {what.split()[0]} difference")
    axes[0, 1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.suptitle(
        f"splitproof diagnose — {'PASS' if report['passed'] else 'FAIL'} "
        "(a split passes when both its gradient and its update bar stay under their bound)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, format=fmt, dpi=110)
    plt.close(fig)
