"""`benchmarks/vs_trl.py --model DIR`: each part of one GRPO step on a Hugging Face model (e.g.
SmolLM2-135M-Instruct), splitproof's variants against TRL's `GRPOTrainer` on the same work, in one run.

The work: the built-in addition task's prompts as chat messages (each side's tokenizer renders them with
the model's chat template), 8 prompts × 4 samples, at most 32 new tokens at temperature 1, one AdamW step on
the whole batch in 4 micro-batches (TRL: gradient accumulation 4, so it skips the old-log-prob pass),
float32, one torch thread per process. The variants, each a process of its own, interleaved over the
repeats (the order reversed on odd repeats):

- ``recompute``: verl's default, the old log-probs recomputed by a no-grad pass before the update;
- ``bypass``: ``algorithm.rollout_correction.bypass_mode=true``, the rollout's log-probs as the old ones;
- ``grouped``, ``grouped_bypass``: those two with ``actor_rollout_ref.actor.use_prefix_grouper=true``, each
  distinct prompt computed once in the update and the old-log-prob pass (``engine.shared_prefix``);
- ``vllm``: ``actor_rollout_ref.rollout.name=vllm`` (with ``--vllm-python``, an environment with vLLM), the
  engine's threads bound to one core (``VLLM_CPU_OMP_THREADS_BIND=0`` unless set);
- ``trl``: TRL's `GRPOTrainer`.

``--variants a,b`` runs only those. Reported per step (the first step, warm-up, left out): generation, old
log-probs, update, the whole step, in process CPU and wall seconds, and each variant's ratio to TRL's.
"""

from __future__ import annotations

import os
from pathlib import Path

import benchlib as bl
from vs_trl_summary import paired, side_summary

WORK = dict(prompts_per_step=8, n=4, mini_batch_prompts=8, micro_split=4, max_response_length=32, steps=3, lr=1e-6)
WORK_QUICK = dict(prompts_per_step=2, n=2, mini_batch_prompts=2, micro_split=2, max_response_length=4, steps=2)
VARIANTS = {
    "recompute": ("ours", {}, "splitproof, verl's old-log-prob recompute"),
    "bypass": ("ours", {"bypass": True}, "splitproof, `bypass_mode=true`"),
    "grouped": ("ours", {"prefix_grouper": True}, "splitproof, `use_prefix_grouper=true`"),
    "grouped_bypass": (
        "ours",
        {"prefix_grouper": True, "bypass": True},
        "splitproof, `use_prefix_grouper=true`, `bypass_mode=true`",
    ),
    "vllm": ("vllm", {"rollout": "vllm"}, "splitproof, `rollout.name=vllm`"),
    "trl": ("trl", {}, "TRL `GRPOTrainer`"),
}
PARTS = (
    ("gen", "generation"),
    ("old_log_prob", "old log-probs (no-grad pass)"),
    ("update", "update (4 micro-batches, clip, AdamW)"),
    ("total", "whole step"),
)


def sizes(quick: bool) -> dict:
    return dict(WORK_QUICK if quick else WORK, split_steps=0, generation_repeats=0)


def chosen_variants(spec: str | None) -> list[str]:
    """``--variants a,b`` (None: all), each a name of ``VARIANTS`` (else ValueError)."""
    chosen = spec.split(",") if spec else list(VARIANTS)
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise ValueError(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    return chosen


def run_model(env: bl.Env, pythons: dict, make_spec, run_side, work: Path) -> dict:
    """Every variant whose interpreter is known, once per repeat, interleaved; their step summaries."""
    chosen = chosen_variants(env.args.variants)
    variants = [name for name, (python, _, _) in VARIANTS.items() if name in chosen and pythons.get(python)]
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    loads = [bl.load_average()]
    for r in range(env.repeats):
        spec = make_spec(env, r + 1)
        for name in variants if r % 2 == 0 else variants[::-1]:
            python, extra, _ = VARIANTS[name]
            side = "trl" if python == "trl" else "ours"
            result = run_side(pythons[python], side, dict(spec, **extra), work, f"{name}-r{r}")[side]
            runs[name].append(result)
            loads.append(bl.load_average())
    summaries = {name: [side_summary(res) for res in results] for name, results in runs.items()}
    return dict(
        spec={k: v for k, v in make_spec(env, 1).items() if k != "uids"},
        variants=variants,
        loads=loads,
        summaries=summaries,
        runs=runs,
        rows=part_rows(summaries),
    )


def part_rows(summaries: dict[str, list[dict]]) -> list[dict]:
    """Per part of the step: each variant's median seconds (CPU, wall) and its paired ratio to TRL's."""
    rows = []
    for key, label in PARTS + (("tokens_per_s", "tokens per second (whole step)"),):
        row = dict(key=key, label=label)
        for name, values in summaries.items():
            for clock in ("cpu", "wall"):
                row[f"{name}_{clock}"] = bl.median([v[clock][key] for v in values])
                if name != "trl" and summaries.get("trl"):
                    row[f"{name}_{clock}_ratio"] = paired(values, summaries["trl"], clock, key)["median"]
        rows.append(row)
    return rows


def _cell(x) -> str:
    return "—" if x is None or x != x else (f"{x:.2f}" if x < 100 else f"{x:.0f}")


def _ratio(x) -> str:
    return "" if x is None or x != x else f" ({x:.2f}×)"


def part_table(result: dict, clock: str) -> list[str]:
    names = result["variants"]
    head = "| part of the step | " + " | ".join(VARIANTS[n][2] for n in names) + " |"
    lines = [head, "|---" * (len(names) + 1) + "|"]
    for row in result["rows"]:
        cells = [_cell(row.get(f"{n}_{clock}")) + _ratio(row.get(f"{n}_{clock}_ratio")) for n in names]
        lines.append(f"| {row['label']} | " + " | ".join(cells) + " |")
    return lines


def render_model(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    spec, model = result["spec"], Path(env.args.model).name
    summaries = result["summaries"]
    tokens = {n: bl.median([s["tokens_per_step"] for s in summaries[n]]) for n in result["variants"]}
    loads = "; ".join(result["loads"])
    cores = os.cpu_count()
    lines = [
        f"## Side by side with TRL on {model} (`vs_trl.py --model`): each part of the step",
        "",
        f"`{command}` — {env.repeats} repeat(s), every variant a fresh process, interleaved. The work: "
        f"{spec['prompts_per_step']} chat prompts (the built-in addition task) × {spec['n']} samples × ≤ "
        f"{spec['max_response_length']} new tokens at temperature {spec['temperature']}, one AdamW step (lr "
        f"{spec['lr']}) on the whole batch in {spec['micro_split']} micro-batches (TRL: gradient accumulation "
        f"{spec['micro_split']}, so no old-log-prob pass), float32, one torch thread per process, "
        f"{spec['steps']} steps per run, the first (warm-up) left out. Seconds per step, median over the "
        "repeats; in brackets the ratio to TRL's (below 1: faster than TRL).",
        "",
        f"Load average (1, 5, 15 min) before the run and after each variant: {loads}, on {cores} cores"
        + (
            " — **taken on a loaded machine** (other work ran beside it), so absolute times are noisy and the "
            "ratios of variants run minutes apart carry that noise."
            # the benchmark's own process is one of the load average's running tasks
            if max(float(x.split("/")[0]) for x in [load_before, *result["loads"]] if x) > 1 + 0.25 * (cores or 1)
            else "."
        ),
        "",
        "Process CPU seconds per step:",
        "",
        *part_table(result, "cpu"),
        "",
        "Wall seconds per step:",
        "",
        *part_table(result, "wall"),
        "",
        "Tokens (prompt + response) per step: "
        + ", ".join(f"{VARIANTS[n][2]} {tokens[n]:.0f}" for n in result["variants"])
        + " (each side samples its own responses, so lengths differ; tokens per second normalises that).",
    ]
    return "\n".join(lines)
