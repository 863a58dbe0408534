"""The diagnosis record (JSON) and its terminal tables."""

from __future__ import annotations

import json
import math
import platform
import sys

from .compare import FACTOR, FLOOR_EPS

RULE = (f"pass iff grad_rel_diff and update_rel_diff <= max({FACTOR:g} x the control's, {FLOOR_EPS:g} x eps(dtype)) "
        "and |objective - objective_reference| <= the reference's precision floor (objective_tolerance)")


def versions() -> dict[str, str]:
    import torch

    import splitproof

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:  # pragma: no cover
        tf = None
    return {"splitproof": splitproof.__version__, "torch": torch.__version__, "transformers": tf,
            "python": platform.python_version()}


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


def scenario_text(record: dict) -> list[str]:
    cov = any("selected_tokens" in s for s in record["splits"])
    legacy = any("legacy" in s for s in record["splits"])
    base = record["baseline"]
    lines = [f"{record['name']}: {record['title']}",
             f"  objective, one microbatch: {base['objective']:.10g}   float64 reference: "
             f"{base['objective_reference']:.10g}   (tolerance {_e(base['objective_tolerance'])})"]
    if cov:
        lines[-1] += f"   selected tokens: {base.get('selected_tokens')} ({base.get('cov_strategy')})"
    header = ["split", "mb x ranks", "grad rel", "grad bound", "update rel", "upd bound", "control grad", "control upd",
              "objective"]
    if cov:
        header += ["selected (mask)"]
    if legacy:
        header += ["legacy grad", "legacy upd"] + (["legacy selected"] if cov else []) + ["legacy"]
    header += ["verdict"]
    rows = []
    for s in record["splits"]:
        bound = s["tolerance"]
        row = [s["split"], f"{s['microbatches']} x {s['ranks']}", _e(s["grad_rel_diff"]), _e(bound["grad_rel_diff"]),
               _e(s["update_rel_diff"]), _e(bound["update_rel_diff"]), _e(s["control"]["grad_rel_diff"]),
               _e(s["control"]["update_rel_diff"]), f"{s['objective']:.10g}"]
        if cov:
            row.append(_sel(s))
        if legacy:
            leg = s.get("legacy")
            row += [_e(leg and leg["grad_rel_diff"]), _e(leg and leg["update_rel_diff"])]
            row += [_sel(leg)] if cov else []
            row.append("-" if not leg else ("within floor" if leg["verdict"] == "pass" else "DIFFERS"))
        row.append("pass" if s["verdict"] == "pass" else "FAIL")
        rows.append(row)
    lines += _table(header, rows)
    lines.append(f"  control: {record['control']}")
    if record.get("legacy"):
        lines.append(f"  legacy: {record['legacy']}")
    for note in record.get("notes", ()):
        lines.append(f"  note: {note}")
    failed = sum(s["verdict"] != "pass" for s in record["splits"])
    lines.append(f"  => {'PASS' if record['passed'] else 'FAIL'} ({len(record['splits']) - failed}/"
                 f"{len(record['splits'])} splits within the floating-point floor)")
    return lines


def sweep_text(records: list[dict]) -> list[str]:
    columns = list(dict.fromkeys(s.get("kind", s["split"]) for r in records for s in r["splits"]))
    header = ["loss mode / aggregation"] + columns + ["legacy"]
    rows = []
    for r in records:
        by_kind = {s.get("kind", s["split"]): s for s in r["splits"]}
        row = [r["title"].replace(" x ", " / ")]
        for kind in columns:
            s = by_kind.get(kind)
            row.append("-" if s is None else f"{'pass' if s['verdict'] == 'pass' else 'FAIL'} {_e(s['update_rel_diff'])}")
        legs = [s["legacy"] for s in r["splits"] if "legacy" in s]
        if legs:
            worst = max(max(leg["grad_rel_diff"], leg["update_rel_diff"]) for leg in legs)
            differs = sum(leg["verdict"] != "pass" for leg in legs)
            row.append(f"{'DIFFERS' if differs else 'same'} {_e(worst)}")
        else:
            row.append("-")
        rows.append(row)
    splits = ", ".join(f"{s.get('kind')}={s['split']}" for s in records[0]["splits"]) if records else ""
    lines = ["sweep: every loss mode x aggregation mode; cells = verdict and relative update difference "
             "vs one microbatch on one rank",
             f"  splits: {splits}",
             "  geo_mean, gspo and sapo fix their policy term's aggregation; the aggregation mode still applies to "
             "their KL and entropy terms (both on in the sweep)"]
    lines += _table(header, rows)
    passed = sum(r["passed"] for r in records)
    legacy_differs = sum(any(s.get("legacy", {}).get("verdict") == "fail" for s in r["splits"]) for r in records)
    lines.append("  legacy = the same splits with every statistic per microbatch (worst of grad/update relative "
                 "difference); DIFFERS = outside the floor")
    lines.append(f"  => {'PASS' if passed == len(records) else 'FAIL'} ({passed}/{len(records)} modes pass every "
                 f"split); legacy differs for {legacy_differs}/{len(records)} modes")
    failures = [(r, s) for r in records for s in r["splits"] if s["verdict"] != "pass"]
    for r, s in failures[:20]:
        lines.append(f"  FAIL {r['name']} {s['split']}: grad rel {_e(s['grad_rel_diff'])} (bound "
                     f"{_e(s['tolerance']['grad_rel_diff'])}), update rel "
                     f"{_e(s['update_rel_diff'])} (bound {_e(s['tolerance']['update_rel_diff'])}), objective diff "
                     f"{_e(s['objective_abs_diff'])} (bound {_e(s['tolerance']['objective_abs_diff'])})")
    return lines


def text(report: dict) -> str:
    records = report["scenarios"]
    settings = report["settings"]
    lines = [f"splitproof diagnose — {settings.get('model')}", f"verdict rule: {report['verdict_rule']}", ""]
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
