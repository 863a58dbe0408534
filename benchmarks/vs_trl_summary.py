"""vs_trl's reduction: from the raw results of each side's runs to per-stage medians, paired ratios
splitproof / TRL, the rows of the split comparison and the held-out score summary."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import torch

import benchlib as bl

NAME = "vs_trl"
SPLIT = 4  # the micro-batch split the comparison runs at (TRL: gradient accumulation SPLIT)
UNCHANGED = 1e-5  # relative update difference below which a split "does not change" the update (float32 floor)
STAGE_ROWS = (
    ("total", "step (loop iteration)"),
    ("gen", "generation"),
    ("reward", "reward"),
    ("gen_reward", "generation + reward"),
    ("old_log_prob", "old log-probs (no-grad pass)"),
    ("update", "update (forward + backward, clip, optimizer)"),
    ("rest", "rest (batching, advantages, metrics, trainer loop)"),
)


def stage_series(result: dict, clock: str) -> dict[str, list[float]]:
    """Per RL step, seconds of each stage and of the rest (the step minus the named stages)."""
    c = result["clock"]
    total = c["total"][clock]
    out = {"total": total}
    for stage in ("gen", "reward", "old_log_prob", "update"):
        out[stage] = c[stage][clock] if stage in c else [0.0] * len(total)
    out["rest"] = [t - sum(out[s][i] for s in ("gen", "reward", "old_log_prob", "update")) for i, t in enumerate(total)]
    out["gen_reward"] = [g + r for g, r in zip(out["gen"], out["reward"])]  # TRL decodes inside generation
    return out


def steady(values: list[float]) -> list[float]:
    """Leave out the first step (one-time allocation and warm-up) when there are others."""
    return values[1:] if len(values) > 1 else values


def side_summary(result: dict) -> dict:
    """Medians over the steady steps of every stage (CPU and wall), tokens per second, memory."""
    summary = {}
    for clock in ("cpu", "wall"):
        series = stage_series(result, clock)
        summary[clock] = {stage: bl.median(steady(values)) for stage, values in series.items()}
        tokens = sum(steady(result["tokens"]))
        summary[clock]["tokens_per_s"] = tokens / max(sum(steady(series["total"])), 1e-12)
    if "metrics_timing" in result:  # ours: the wrappers' wall times against timing_s/* of metrics.jsonl
        summary["timing_gap"] = timing_gap(result)
    summary["tokens_per_step"] = statistics.mean(result["tokens"])
    summary["train_score"] = statistics.mean(result["train_score"])
    summary["peak"] = result["peak"]
    summary["growth"] = result["peak"] - result["rss_loaded"]
    return summary


def timing_gap(result: dict) -> float:
    """Largest relative difference, over the steady steps, between a stage's wall time by our wrapper and
    the same stage's ``timing_s/*`` in metrics.jsonl (generation, old log-probs, update)."""
    pairs = (("gen", "timing_s/gen"), ("old_log_prob", "timing_s/old_log_prob"), ("update", "timing_s/update_actor"))
    gaps = [
        abs(w - m) / m
        for stage, metric in pairs
        if stage in result["clock"]  # bypass_mode=true runs no old-log-prob pass
        for w, m in zip(steady(result["clock"][stage]["wall"]), steady(result["metrics_timing"][metric]))
        if m > 0
    ]
    return max(gaps) if gaps else math.nan


def paired(ours: list[dict], trl: list[dict], clock: str, key: str) -> dict:
    """Median (and range) over the repeats of the per-repeat ratio ours / TRL."""
    ratios = [o[clock][key] / t[clock][key] for o, t in zip(ours, trl) if t[clock][key] > 0]
    if not ratios:
        return dict(median=math.nan, low=math.nan, high=math.nan)
    return dict(median=bl.median(ratios), low=min(ratios), high=max(ratios))


def relative_change(a: dict, b: dict) -> dict:
    """How far update ``b`` is from update ``a``: max |b − a| / max |a| and ‖b − a‖ / ‖a‖ over all weights."""
    diff_max = max(float((b[k] - a[k]).abs().max()) for k in a)
    ref_max = max(float(a[k].abs().max()) for k in a)
    diff_norm = math.sqrt(sum(float(((b[k] - a[k]) ** 2).sum()) for k in a))
    ref_norm = math.sqrt(sum(float((a[k] ** 2).sum()) for k in a))
    return dict(
        max_rel=diff_max / ref_max if ref_max else math.nan, norm_rel=diff_norm / ref_norm if ref_norm else math.nan
    )


def split_rows(ours_split: dict | None, trl_split: dict | None, spec: dict) -> list[dict]:
    """One row per (side, loss): the update at split 1 against the update at split ``SPLIT``."""
    rows = []
    if ours_split is not None:
        base = Path(ours_split["dir"])
        a, b = (torch.load(base / f"ours_split{s}.pt") for s in (1, SPLIT))
        info = ours_split["splits"]
        rows.append(
            dict(
                side="splitproof",
                loss=f"{spec['ours_loss_agg_mode']} (PPO-clip)",
                layout=f"micro-batch {info['1']['micro_batch']} → {info[str(SPLIT)]['micro_batch']} rows",
                same_samples=info["1"]["samples"] == info[str(SPLIT)]["samples"],
                **relative_change(a, b),
            )
        )
    if trl_split is not None:
        base = Path(trl_split["dir"])
        info = trl_split["splits"]
        for loss in spec["trl_split_losses"]:
            a, b = (torch.load(base / f"trl_split_{loss}{s}.pt") for s in (1, SPLIT))
            one, many = info[f"{loss}:1"], info[f"{loss}:{SPLIT}"]
            rows.append(
                dict(
                    side="TRL",
                    loss=loss,
                    layout=f"{one['micro_batch']} × GA {one['accumulation']} → "
                    f"{many['micro_batch']} × GA {many['accumulation']}",
                    same_samples=one["samples"] == many["samples"],
                    **relative_change(a, b),
                )
            )
    return rows


def stage_rows(result: dict) -> list[dict]:
    ours, trl = result["summaries"]["ours"], result["summaries"]["trl"]
    rows = []
    for key, label in STAGE_ROWS + (("tokens_per_s", "tokens per second"),):
        row = dict(
            key=key,
            stage=label,
            ours_cpu=bl.median([s["cpu"][key] for s in ours]),
            ours_wall=bl.median([s["wall"][key] for s in ours]),
        )
        if trl:
            row.update(
                trl_cpu=bl.median([s["cpu"][key] for s in trl]),
                trl_wall=bl.median([s["wall"][key] for s in trl]),
                ratio=paired(ours, trl, "cpu", key),
                ratio_wall=paired(ours, trl, "wall", key),
            )
        rows.append(row)
    return rows


def score_summary(result: dict) -> dict:
    scores = result["scores"]
    out = {"initial": scores["initial"]}
    for side in ("ours", "trl", "ours_contiguous"):
        values = [scores[f"{side}-{i}"] for i in range(len(result["summaries"][side]))]
        if values:
            out[side] = dict(
                values=values,
                mean=statistics.mean(values),
                sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                train=statistics.mean(s["train_score"] for s in result["summaries"][side]),
            )
    return out
