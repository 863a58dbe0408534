"""Compare the built-in DAPO recipe with the GRPO recipe from runs of ``scripts/embedded_curve.py``.

    python scripts/embedded_curve.py --runs runs/grpo --seeds 2
    python scripts/embedded_curve.py --runs runs/dapo --seeds 2 -- --config=builtin://charlm-dapo
    python scripts/dapo_vs_grpo.py runs/grpo runs/dapo

Prints a markdown table of the held-out score per evaluation step for each seed of both, and, at equal
compute, DAPO's score at the step where its CPU time (process CPU over the run, spread evenly over its
steps) reaches the GRPO run's whole CPU time; and DAPO's generation rounds and consumed prompts per step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def held_out(folder: Path) -> dict[int, float]:
    points = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith("val-core/") and key.endswith("/mean@1"):
                points[record["step"]] = value
    return points


def records(folder: Path) -> list[dict]:
    return [r for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines()) if r["step"] >= 1]


def main(grpo: Path, dapo: Path) -> None:
    seeds = sorted(
        p.name for p in dapo.iterdir() if (p / "timing.json").exists() and (grpo / p.name / "timing.json").exists()
    )
    curves = {(name, s): held_out(root / s) for name, root in (("GRPO", grpo), ("DAPO", dapo)) for s in seeds}
    steps = sorted(curves["GRPO", seeds[0]])
    print("| step | " + " | ".join(f"{name} {s}" for s in seeds for name in ("GRPO", "DAPO")) + " |")
    print("|---|" + "---|" * (2 * len(seeds)))
    for step in steps:
        print(
            f"| {step} | "
            + " | ".join(f"{curves[name, s][step]:.3f}" for s in seeds for name in ("GRPO", "DAPO"))
            + " |"
        )
    print()
    for s in seeds:
        cpu = {
            name: json.loads((root / s / "timing.json").read_text())["cpu_s"]
            for name, root in (("GRPO", grpo), ("DAPO", dapo))
        }
        runs = records(dapo / s)
        per_step = cpu["DAPO"] / len(runs)
        at = max(step for step in curves["DAPO", s] if step * per_step <= cpu["GRPO"])
        rounds = [r["train/num_gen_batches"] for r in runs]
        consumed = [r["training/filter_groups/consumed_prompts"] for r in runs]
        print(
            f"- {s}: CPU time GRPO {cpu['GRPO']:.0f} s, DAPO {cpu['DAPO']:.0f} s; at GRPO's CPU time DAPO is at "
            f"step {at} with {curves['DAPO', s][at]:.3f} (GRPO's last: {curves['GRPO', s][max(steps)]:.3f}); "
            f"DAPO rounds per step: mean {sum(rounds) / len(rounds):.2f}, max {max(rounds):.0f}; consumed prompts "
            f"per step: mean {sum(consumed) / len(consumed):.1f}, {min(consumed):.0f}–{max(consumed):.0f}"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
