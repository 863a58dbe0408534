"""The audit's report: one row per split, the settings, and the plain-text table the CLI prints."""

from __future__ import annotations

import json
import math
import textwrap
from dataclasses import dataclass
from typing import Any

from torch import Tensor

TOLERANCE_FACTOR = 16.0
TOLERANCE_FLOOR = 1e-12

CONTRACT = (
    "a split-invariant loss in verl's convention divides by the minibatch's figures in "
    "config.global_batch_info\n(batch_num_tokens for token means, global_batch_size for sequence means, "
    "loss_scale_factor), never by the\nmicrobatch's own counts or a torch.mean over its rows, and multiplies "
    "by global_batch_info['dp_size'] (DDP/FSDP\naverage the ranks' gradients); see docs/audit-verl.md"
)


@dataclass
class AuditReport:
    passed: bool
    rows: list[dict]
    settings: dict

    def to_dict(self) -> dict:
        return {"passed": self.passed, "rows": self.rows, "settings": self.settings}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=_json_default)

    def format_table(self) -> str:
        """A plain-text table, one line per split; per failing split its kind and the likely cause; the
        verdict; and what a split-invariant loss in verl's convention does."""
        head = f"{'split':<14}{'microbatches':>13}{'grad_rel_diff':>15}{'control':>11}  verdict"
        lines = [head, "-" * len(head)]
        for r in self.rows:
            lines.append(
                f"{r['split']:<14}{r['microbatches']:>13}{_fmt(r['grad_rel_diff']):>15}"
                f"{_fmt(r['control_rel_diff']):>11}  {r['verdict']}" + (f" ({r['error']})" if r.get("error") else "")
            )
        fn = self.settings.get("loss_fn", "loss function")
        failed = [r for r in self.rows if r["verdict"] != "pass"]
        by_cause: dict[str, list[dict]] = {}
        for r in failed:  # one explanation per cause, naming every split it explains
            by_cause.setdefault(r["cause"], []).append(r)
        for cause, rows in by_cause.items():
            splits = "; ".join(f"{r['split']} ({r['description']})" for r in rows)
            lines.append(textwrap.fill(f"FAIL {splits}: {cause}", width=110, subsequent_indent="  "))
        where = f" on {', '.join(r['split'] for r in failed)}" if failed else " on every split"
        lines.append(
            f"{fn}: {'PASS' if self.passed else 'FAIL'}{where} "
            f"(pass: grad_rel_diff <= max({TOLERANCE_FACTOR:g} x control, {TOLERANCE_FLOOR:g}))"
        )
        lines.append(CONTRACT)
        return "\n".join(lines)


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return f"{x:.2e}"


def _json_default(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.tolist()
    return str(obj)
