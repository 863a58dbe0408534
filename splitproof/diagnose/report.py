"""The diagnosis record (JSON) and its terminal tables."""

from __future__ import annotations

import json
import math
import platform
import sys
import textwrap

from .compare import FACTOR, FLOOR_EPS

RULE = (
    f"pass iff grad_rel_diff and update_rel_diff <= max({FACTOR:g} x the control's, {FLOOR_EPS:g} x eps(dtype)) "
    "and |objective - objective_reference| <= the reference's precision floor (objective_tolerance)"
)


def versions() -> dict[str, str]:
    import torch

    import splitproof

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = None
    return {
        "splitproof": splitproof.__version__,
        "torch": torch.__version__,
        "transformers": tf,
        "python": platform.python_version(),
    }


def build(records: list[dict], settings: dict) -> dict:
    return {
        "passed": all(r["passed"] for r in records),
        "versions": versions(),
        "settings": settings,
        "verdict_rule": RULE,
        "scenarios": records,
    }


def _clean(value):
    """JSON without NaN/Infinity: non-finite floats become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dump_json(report: dict, stream) -> None:
    """The record as JSON (no NaN/Infinity literals) on an open text stream."""
    json.dump(_clean(report), stream, indent=2, allow_nan=False)
    stream.write("\n")


# ------------------------------------------------------------------------------------------- text
def _e(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.1e}"


WIDTH = 100  # the console report fits this many columns (--json holds every figure)


def _wrap(text: str, indent: str = "  ", more: str = "    ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=more, break_on_hyphens=False)


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _sel(block: dict | None) -> str:
    if not block or "selected_tokens" not in block:
        return "-"
    s = block["selected_tokens"]
    agree = block.get("mask_agreement")
    return f"{s['baseline']}/{s['split']}" + ("" if agree is None else f" ({agree:.2f})")


def _upstream(record: dict) -> str:
    up = record.get("upstream")
    return up["ref"] if up else "the per-microbatch bug"


def _header(record: dict) -> list[str]:
    base = record["baseline"]
    lines = _wrap(f"{record['name']}: {record['title']}", indent="", more="  ")
    up = record.get("upstream")
    if up:
        lines += _wrap(f"reruns {up['ref']}: {up['summary']}") + [f"    {up['url']}"]
    line = (
        f"objective, one microbatch: {base['objective']:.10g}   float64 reference: "
        f"{base['objective_reference']:.10g}   (tolerance {_e(base['objective_tolerance'])})"
    )
    if "selected_tokens" in base:
        line += f"   selected tokens: {base['selected_tokens']} ({base.get('cov_strategy')})"
    return lines + _wrap(line)


def _verdict_table(record: dict) -> list[str]:
    """splitproof's verdict: the three checked figures of each split and their bounds."""
    header = ["split", "mb x ranks", "grad rel", "bound", "update rel", "bound", "|J - ref|", "bound", "verdict"]
    rows = []
    for s in record["splits"]:
        bound = s["tolerance"]
        rows.append(
            [
                s["split"],
                f"{s['microbatches']} x {s['ranks']}",
                _e(s["grad_rel_diff"]),
                _e(bound["grad_rel_diff"]),
                _e(s["update_rel_diff"]),
                _e(bound["update_rel_diff"]),
                _e(s["objective_abs_diff"]),
                _e(bound["objective_abs_diff"]),
                "pass" if s["verdict"] == "pass" else "FAIL",
            ]
        )
    return _wrap(
        "splitproof's verdict: each split against one microbatch on one rank (relative differences "
        "of the gradient and the update; |J - ref|: the objective against the float64 reference)"
    ) + _table(header, rows)


def _floor_table(record: dict, cov: bool) -> list[str]:
    """The control's figures (the floor the bounds come from) and the objective each split reported."""
    header = ["split", "control grad", "control upd", "objective J"] + (["selected (mask)"] if cov else [])
    rows = [
        [s["split"], _e(s["control"]["grad_rel_diff"]), _e(s["control"]["update_rel_diff"]), f"{s['objective']:.10g}"]
        + ([_sel(s)] if cov else [])
        for s in record["splits"]
    ]
    what = "objective J and selected tokens (baseline/split, mask agreement)" if cov else "objective J"
    return _wrap(
        f"the floor, from the control — {record['control']} — on the same split: its differences "
        f"make the bounds above; {what}: what the split reported"
    ) + _table(header, rows)


def _legacy_table(record: dict, cov: bool) -> list[str]:
    """What verl's per-microbatch convention gives on the same splits: the reported bug, rerun."""
    bug = _upstream(record)
    header = ["split", "grad rel", "update rel"] + (["selected (mask)"] if cov else []) + ["verl convention"]
    rows = []
    for s in record["splits"]:
        leg = s.get("legacy")
        result = (
            "-"
            if not leg
            else (f"DIFFERS: {bug} reproduced" if leg["verdict"] != "pass" else "same (within the floor)")
        )
        rows.append(
            [s["split"], _e(leg and leg["grad_rel_diff"]), _e(leg and leg["update_rel_diff"])]
            + ([_sel(leg)] if cov else [])
            + [result]
        )
    intro = (
        f"verl convention (legacy, not splitproof): the same splits with {record['legacy']}; DIFFERS = the "
        f"difference {bug} reports, reproduced (expected; it does not enter the verdict)"
    )
    return _wrap(intro) + _table(header, rows) + scale_note(record)


SCALE_GAP = 100.0  # grad rel this many times update rel: the difference is mostly a change of the gradient's scale


def scale_note(record: dict) -> list[str]:
    """A word where verl's gradient differs far more than its update: a rescaled gradient that the update
    (gradient clipping, then AdamW's per-weight normalisation) largely hides."""
    gaps = [
        s["split"]
        for s in record["splits"]
        if s.get("legacy")
        and s["legacy"]["update_rel_diff"] is not None
        and s["legacy"]["grad_rel_diff"] > SCALE_GAP * max(s["legacy"]["update_rel_diff"], 1e-300)
    ]
    if not gaps:
        return []
    return _wrap(
        f"on {', '.join(gaps)} verl's grad rel is over {SCALE_GAP:g}x its update rel: its gradient there "
        "is mostly the right one at another scale, which the update hides (the gradient is clipped to "
        "actor.grad_clip before the step, and AdamW divides by its running scale), so the weights move "
        "almost as they should; a smaller grad_clip or another optimizer would not hide it"
    )


def scenario_text(record: dict) -> list[str]:
    cov = any("selected_tokens" in s for s in record["splits"])
    legacy = any("legacy" in s for s in record["splits"])
    lines = _header(record) + _verdict_table(record) + _floor_table(record, cov)
    if legacy:
        lines += _legacy_table(record, cov)
    for note in record.get("notes", ()):
        lines += _wrap(f"note: {note}")
    n = len(record["splits"])
    passed = sum(s["verdict"] == "pass" for s in record["splits"])
    summary = f"=> {'PASS' if record['passed'] else 'FAIL'} ({passed}/{n} splits within the floating-point floor)"
    if legacy:
        differs = sum(s.get("legacy", {}).get("verdict") == "fail" for s in record["splits"])
        summary += f"; verl convention differs on {differs}/{n} ({_upstream(record)})"
    return lines + _wrap(summary)


def sweep_text(records: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(s.get("kind", s["split"]) for r in records for s in r["splits"]))
    header = ["loss mode / aggregation"] + columns + ["verl convention"]
    rows = []
    for r in records:
        by_kind = {s.get("kind", s["split"]): s for s in r["splits"]}
        row = [r["title"].replace(" x ", " / ")]
        for kind in columns:
            s = by_kind.get(kind)
            row.append(
                "-" if s is None else f"{'pass' if s['verdict'] == 'pass' else 'FAIL'} {_e(s['update_rel_diff'])}"
            )
        legs = [s["legacy"] for s in r["splits"] if "legacy" in s]
        if legs:
            worst = max(max(leg["grad_rel_diff"], leg["update_rel_diff"]) for leg in legs)
            differs = sum(leg["verdict"] != "pass" for leg in legs)
            row.append(f"{'DIFFERS' if differs else 'same'} {_e(worst)}")
        else:
            row.append("-")
        rows.append(row)
    splits = ", ".join(f"{s.get('kind')}={s['split']}" for s in records[0]["splits"]) if records else ""
    lines = _wrap(
        "sweep: every loss mode x aggregation mode; cells = splitproof's verdict and the relative "
        "update difference vs one microbatch on one rank",
        indent="",
        more="  ",
    )
    lines += _wrap(f"splits: {splits}")
    lines += _wrap(
        "geo_mean, gspo and sapo fix their policy term's aggregation; the aggregation mode still "
        "applies to their KL and entropy terms (both on in the sweep)"
    )
    lines += _table(header, rows)
    passed = sum(r["passed"] for r in records)
    legacy_differs = sum(any(s.get("legacy", {}).get("verdict") == "fail" for s in r["splits"]) for r in records)
    lines += _wrap(
        "verl convention (legacy, not splitproof) = the same splits with every statistic per "
        "microbatch (worst of grad/update relative difference); DIFFERS = outside the floor: the "
        "per-microbatch bug, reproduced (it does not enter the verdict)"
    )
    lines += _wrap(
        f"=> {'PASS' if passed == len(records) else 'FAIL'} ({passed}/{len(records)} modes pass every "
        f"split); verl convention differs for {legacy_differs}/{len(records)} modes"
    )
    failures = [(r, s) for r in records for s in r["splits"] if s["verdict"] != "pass"]
    for r, s in failures[:20]:
        lines += _wrap(
            f"FAIL {r['name']} {s['split']}: grad rel {_e(s['grad_rel_diff'])} (bound "
            f"{_e(s['tolerance']['grad_rel_diff'])}), update rel "
            f"{_e(s['update_rel_diff'])} (bound {_e(s['tolerance']['update_rel_diff'])}), objective diff "
            f"{_e(s['objective_abs_diff'])} (bound {_e(s['tolerance']['objective_abs_diff'])})"
        )
    return lines


def text(report: dict) -> str:
    records = report["scenarios"]
    settings = report["settings"]
    lines = _wrap(f"splitproof diagnose — {settings.get('model')}", indent="", more="  ")
    lines += _wrap(f"verdict rule: {report['verdict_rule']}", indent="", more="  ") + [""]
    grouped = [r for r in records if r.get("group") == "sweep"]
    for r in records:
        if r.get("group") != "sweep":
            lines += scenario_text(r) + [""]
    if grouped:
        lines += sweep_text(grouped) + [""]
    lines.append(f"overall: {'PASS' if report['passed'] else 'FAIL'}")
    return "\n".join(lines)


def print_text(report: dict, stream=None) -> None:
    print(text(report), file=stream or sys.stdout)
