"""Side by side with TRL: the same GRPO run with `splitproof train` and with TRL's `GRPOTrainer`.

Same model (the built-in charlm), task (builtin://addition) and reward, the same prompts at every step,
samples per prompt, response length, temperature, learning rate, optimizer (our AdamW object on both
sides), clipping, loss (ours `token-mean` ≈ TRL `dapo`), no KL, float32, no gradient checkpointing, HF
generation on TRL's side, one torch thread per side. Every run is a process of its own
(`benchmarks/vs_trl_sides.py`; TRL's with the interpreter that has TRL), the sides interleaved over the
seeds (ours, TRL, TRL, ours, ...). Reported as ratios splitproof / TRL measured in the same run:

- time per step and its parts (generation, reward, old log-probs, update, the rest), tokens per second,
  peak RSS; the held-out score of both final models by our own evaluation (greedy, the same split);
- at a four-way micro-batch split (TRL: gradient accumulation 4): the same times, and how much one
  update (same start, same samples, SGD) moves when only the split changes.

    python benchmarks/vs_trl.py [--quick] [--trl-python PATH] [--repeats N] [--steps N]

TRL is never a dependency of splitproof: install it in its own environment (`pip install -e '.[bench]'`,
which pins torch so that no CUDA build is pulled) and name its interpreter with `--trl-python` (or
SPLITPROOF_TRL_PYTHON); without it a `--quick` run measures splitproof's side only.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import benchlib as bl  # noqa: E402
import vs_trl_sides as sides  # noqa: E402

NAME = "vs_trl"
SIDES_SCRIPT = Path(__file__).resolve().parent / "vs_trl_sides.py"
SEEDS = (1, 2, 3, 4, 5)
SPLIT = 4
UNCHANGED = 1e-5  # relative update difference below which a split "does not change" the update (float32 floor)
VAL_FULL = "builtin://addition/test"
VAL_QUICK = "builtin://addition/test?size=40"

# The built-in model's recipe (splitproof/recipes/charlm.yaml): 128 prompts × 8 samples, four optimizer
# steps of 32 prompts per training step, responses of at most 4 tokens.
FULL = dict(prompts_per_step=128, n=8, mini_batch_prompts=32, steps=20, split_steps=10, generation_repeats=5)
QUICK = dict(prompts_per_step=8, n=8, mini_batch_prompts=4, steps=2, split_steps=2, generation_repeats=2)
COMMON = dict(micro_split=1, data_seed=1, max_response_length=4, temperature=1.0, lr=5e-4, betas=[0.9, 0.999],
              weight_decay=0.01, grad_clip=1.0, ours_loss_agg_mode="token-mean", ours_shuffle=True, trl_loss_type="dapo",
              scale_rewards="group", splits=[1, SPLIT], trl_split_losses=["dapo", "bnpo", "grpo"])

STAGE_ROWS = (("total", "step (loop iteration)"), ("gen", "generation"), ("reward", "reward"),
              ("gen_reward", "generation + reward"), ("old_log_prob", "old log-probs (no-grad pass)"),
              ("update", "update (forward + backward, clip, optimizer)"),
              ("rest", "rest (batching, advantages, metrics, trainer loop)"))


# --------------------------------------------------------------------------------------------- settings

def make_spec(env: bl.Env, seed: int) -> dict:
    """The settings both sides run, with the uids our prompt sampler serves at every step."""
    from splitproof.rl.data.prompts import PromptSampler
    from splitproof.rl.data.tasks import task_rows

    sizes = QUICK if env.quick else FULL
    steps = env.args.steps or sizes["steps"]
    spec = dict(COMMON, **dict(sizes, steps=steps), seed=seed)
    sampler = PromptSampler(len(task_rows(sides.TASK_TRAIN)), spec["prompts_per_step"], seed=spec["data_seed"],
                            shuffle=True)
    spec["uids"] = [sampler.next_batch() for _ in range(max(steps, spec["split_steps"]))]
    return spec


def find_trl_python(requested: str | None) -> tuple[str | None, str]:
    """(interpreter, TRL version) of the environment with TRL, or (None, why not)."""
    candidate = requested or os.environ.get("SPLITPROOF_TRL_PYTHON") or sys.executable
    try:
        done = subprocess.run([candidate, "-c", "import trl; print(trl.__version__)"], capture_output=True,
                              text=True, timeout=300, env=_child_env())
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot run {candidate}: {e}"
    if done.returncode != 0:
        return None, f"{candidate} cannot import trl"
    return candidate, done.stdout.strip()


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(bl.REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               TRL_EXPERIMENTAL_SILENCE="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_OFFLINE="1")
    return env


def run_side(python: str, side: str, spec: dict, work: Path, tag: str) -> dict:
    """Sides (comma-separated) in one fresh process, one after the other; their results by side."""
    out = work / tag
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    bl.log(f"[{NAME}] {tag}: {side} ({Path(python).parent.parent.name})")
    done = subprocess.run([python, str(SIDES_SCRIPT), side, str(spec_path), str(out)], capture_output=True, text=True,
                          env=_child_env())
    if done.returncode != 0:
        raise RuntimeError(f"{tag} ({side}) failed with exit {done.returncode}:\n{done.stderr[-4000:]}")
    results = json.loads((out / "result.json").read_text())
    for result in results.values():
        result["dir"] = str(out)
    return results


# --------------------------------------------------------------------------------------------- reduction

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
    gaps = [abs(w - m) / m for stage, metric in pairs
            for w, m in zip(steady(result["clock"][stage]["wall"]), steady(result["metrics_timing"][metric])) if m > 0]
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
    return dict(max_rel=diff_max / ref_max if ref_max else math.nan, norm_rel=diff_norm / ref_norm if ref_norm else math.nan)


def split_rows(ours_split: dict | None, trl_split: dict | None) -> list[dict]:
    """One row per (side, loss): the update at split 1 against the update at split ``SPLIT``."""
    rows = []
    if ours_split is not None:
        base = Path(ours_split["dir"])
        a, b = (torch.load(base / f"ours_split{s}.pt") for s in (1, SPLIT))
        info = ours_split["splits"]
        rows.append(dict(side="splitproof", loss=f"{COMMON['ours_loss_agg_mode']} (PPO-clip)",
                         layout=f"micro-batch {info['1']['micro_batch']} → {info[str(SPLIT)]['micro_batch']} rows",
                         same_samples=info["1"]["samples"] == info[str(SPLIT)]["samples"], **relative_change(a, b)))
    if trl_split is not None:
        base = Path(trl_split["dir"])
        info = trl_split["splits"]
        for loss in COMMON["trl_split_losses"]:
            a, b = (torch.load(base / f"trl_split_{loss}{s}.pt") for s in (1, SPLIT))
            one, many = info[f"{loss}:1"], info[f"{loss}:{SPLIT}"]
            rows.append(dict(side="TRL", loss=loss,
                             layout=f"{one['micro_batch']} × GA {one['accumulation']} → "
                                    f"{many['micro_batch']} × GA {many['accumulation']}",
                             same_samples=one["samples"] == many["samples"], **relative_change(a, b)))
    return rows


def held_out(spec: dict, weights: dict[str, Path], quick: bool, work: Path) -> dict[str, float]:
    """Greedy held-out score (our validation code, the same split) of the initial model and each final one."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.run import build_parts
    from splitproof.rl.evaluate import evaluate_held_out

    overrides = sides.ours_overrides(spec, work / "eval") + [f"data.val_files={VAL_QUICK if quick else VAL_FULL}"]
    run = build_parts(load_train_config(None, overrides))

    def score() -> float:
        values = list(evaluate_held_out(run, spec["steps"]).values())
        return float(values[0])

    scores = {"initial": score()}
    for name, path in weights.items():
        run.actor.model.load_state_dict(torch.load(path))
        scores[name] = score()
    return scores


# --------------------------------------------------------------------------------------------- run

def run(env: bl.Env) -> dict:
    trl_python, trl_version = find_trl_python(env.args.trl_python)
    if trl_python is None:
        if not env.quick:
            sys.exit(f"error: the TRL side needs an environment with trl ({trl_version}); install it apart from "
                     "splitproof's (pip install -e '.[bench]') and pass --trl-python PATH or SPLITPROOF_TRL_PYTHON")
        bl.log(f"[{NAME}] TRL not available ({trl_version}): this quick run measures splitproof's side only")
    pythons = {"ours": sys.executable, "trl": trl_python}
    seeds = SEEDS[:env.repeats]
    work = Path(tempfile.mkdtemp(prefix="splitproof-vs-trl-"))
    try:
        runs = main_runs(env, seeds, pythons, work)
        split = split_runs(env, seeds[0], pythons, work)
        weights = {f"{side}-{i}": Path(res["dir"]) / "final.pt" for side in runs for i, res in enumerate(runs[side])}
        bl.log(f"[{NAME}] held-out evaluation of {len(weights)} final models")
        scores = held_out(make_spec(env, seeds[0]), weights, env.quick, work)
        update_rows = split_rows(split.get("ours-split"), split.get("trl-split"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = dict(spec={k: v for k, v in make_spec(env, seeds[0]).items() if k != "uids"}, seeds=list(seeds),
                  trl_version=trl_version if trl_python else None, trl_python=trl_python,
                  summaries={side: [side_summary(res) for res in results] for side, results in runs.items()},
                  split_summaries={side: side_summary(split[side]) for side in ("ours", "trl") if side in split},
                  scores=scores, split_rows=update_rows, runs=runs, generation=split.get("ours-generation"))
    result["rows"] = stage_rows(result)
    result["score"] = score_summary(result)
    return result


def main_runs(env: bl.Env, seeds, pythons: dict, work: Path) -> dict[str, list[dict]]:
    """Both sides once per seed, each run a fresh process, the order alternating (ours first on even repeats);
    then (not with --quick), for the held-out table only, our side with contiguous minibatches (verl's default
    ``shuffle: false``)."""
    runs: dict[str, list[dict]] = {"ours": [], "trl": [], "ours_contiguous": []}
    for r, seed in enumerate(seeds):
        spec = make_spec(env, seed)
        for side in (["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]):
            if pythons[side] is not None:
                runs[side].append(run_side(pythons[side], side, spec, work, f"{side}-seed{seed}")[side])
        if not env.quick:
            contiguous = dict(spec, ours_shuffle=False)
            result = run_side(pythons["ours"], "ours", contiguous, work, f"ours-contiguous-seed{seed}")
            runs["ours_contiguous"].append(result["ours"])
    return runs


def split_runs(env: bl.Env, seed: int, pythons: dict, work: Path) -> dict[str, dict]:
    """At the ``SPLIT``-way micro-batch split: a timed run of each side, then in the same process the
    update comparison (and, on our side, the generation attribution)."""
    spec = dict(make_spec(env, seed), micro_split=SPLIT)
    spec["steps"] = spec["split_steps"]
    out = {}
    for side, extra in (("trl", ",trl-split"), ("ours", ",ours-split,ours-generation")):
        if pythons[side] is not None:
            out.update(run_side(pythons[side], side + extra, spec, work, f"{side}-split{SPLIT}"))
    return out


def stage_rows(result: dict) -> list[dict]:
    ours, trl = result["summaries"]["ours"], result["summaries"]["trl"]
    rows = []
    for key, label in STAGE_ROWS + (("tokens_per_s", "tokens per second"),):
        row = dict(key=key, stage=label,
                   ours_cpu=bl.median([s["cpu"][key] for s in ours]), ours_wall=bl.median([s["wall"][key] for s in ours]))
        if trl:
            row.update(trl_cpu=bl.median([s["cpu"][key] for s in trl]), trl_wall=bl.median([s["wall"][key] for s in trl]),
                       ratio=paired(ours, trl, "cpu", key), ratio_wall=paired(ours, trl, "wall", key))
        rows.append(row)
    return rows


def score_summary(result: dict) -> dict:
    scores = result["scores"]
    out = {"initial": scores["initial"]}
    for side in ("ours", "trl", "ours_contiguous"):
        values = [scores[f"{side}-{i}"] for i in range(len(result["summaries"][side]))]
        if values:
            out[side] = dict(values=values, mean=statistics.mean(values),
                             sd=statistics.stdev(values) if len(values) > 1 else 0.0,
                             train=statistics.mean(s["train_score"] for s in result["summaries"][side]))
    return out


# --------------------------------------------------------------------------------------------- render

def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _ratio(r: dict | None) -> str:
    return "n/a" if not r or math.isnan(r["median"]) else f"{r['median']:.3f}"


def _range(r: dict | None) -> str:
    return "" if not r or math.isnan(r["median"]) else f"{r['low']:.3f}–{r['high']:.3f}"


def setup_table(result: dict) -> str:
    s = result["spec"]
    n, mini, B = s["n"], s["mini_batch_prompts"], s["prompts_per_step"]
    updates = B // mini
    rows = [
        ["model", "built-in charlm (LlamaForCausalLM, 107k parameters, vocabulary 99), float32", "the same directory"],
        ["task, reward", "builtin://addition/train, exact match", "the same rows and rule (a TRL reward function)"],
        ["prompts per step", f"data.train_batch_size {B}, our sampler's order (data.seed {s['data_seed']})",
         "the same prompts in the same order (shuffle_dataset false)"],
        ["samples per prompt", f"rollout.n {n}", f"num_generations {n}"],
        ["optimizer steps per step", f"ppo_mini_batch_size {mini} ({updates} per step)",
         f"per_device_train_batch_size {mini * n}, steps_per_generation {updates}"],
        ["minibatch composition", "actor.shuffle true: the rollout batch is permuted (seeded) before it is cut "
         "into minibatches", "the generation batch is shuffled before it is split (always)"],
        ["response length, sampling", f"max_response_length {s['max_response_length']}, temperature {s['temperature']}, "
         "no top-k / top-p", f"max_completion_length {s['max_response_length']}, temperature {s['temperature']}, "
         "top_k 0, top_p 1.0 (HF generate, no vLLM)"],
        ["optimizer", f"AdamW lr {s['lr']}, betas {tuple(s['betas'])}, eps 1e-8, weight decay {s['weight_decay']} "
         "(every weight), constant schedule", "the same AdamW object, passed as `optimizers=`; constant schedule"],
        ["clipping", f"grad_clip {s['grad_clip']}, PPO clip 0.2", f"max_grad_norm {s['grad_clip']}, epsilon 0.2"],
        ["loss", f"loss_agg_mode {s['ours_loss_agg_mode']}, grpo advantages / group std",
         f"loss_type {s['trl_loss_type']}, scale_rewards {s['scale_rewards']}"],
        ["KL, precision, memory", "no KL, fp32, no gradient checkpointing",
         "beta 0, bf16 false, gradient_checkpointing false"],
        ["steps, seeds", f"{s['steps']} steps; seeds {', '.join(map(str, result['seeds']))} (rollout.seed)",
         f"{s['steps'] * updates} optimizer steps (max_steps); the same seeds (seed)"],
        ["threads, processes", "one torch thread, one process per run", "the same"],
    ]
    return bl.table(["setting", "splitproof (`splitproof train`)", f"TRL {result['trl_version'] or '(not run)'}"], rows)


MAPPING = bl.table(
    ["TRL loss_type", "normalisation (TRL)", "splitproof / verl equivalent", "split-invariant in TRL"],
    [["dapo (default)", "Σ token losses / tokens of the generation batch × GA / steps_per_generation",
      "token-mean (÷ tokens of the optimizer minibatch); equal when each generation batch is one optimizer step",
      "yes (global count)"],
     ["dr_grpo", "Σ token losses / (micro-batch rows × max_completion_length) / GA",
      "seq-mean-token-sum-norm (its constant defaults to max_response_length); scale_rewards=\"none\" ≈ "
      "norm_adv_by_std_in_grpo=false", "yes"],
     ["grpo", "mean over micro-batch rows of each row's token mean / GA", "seq-mean-token-mean", "yes, with equal micro-batches"],
     ["bnpo", "Σ token losses / tokens of the micro-batch / GA", "none: the per-micro-batch token mean splitproof replaces",
      "no (depends on the local batch)"]])


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    s = result["spec"]
    have_trl = bool(result["summaries"]["trl"])
    intro = (f"Setup — both sides train the same model on the same prompts with the same settings for {s['steps']} "
             f"steps, once per seed, each run a fresh process with one torch thread; the sides alternate "
             f"(ours, TRL, TRL, ours, ...). Figures are medians over steps 2–{s['steps']} (step 1 holds one-time "
             "warm-up) and then over the seeds; a ratio is the median over the seeds of the per-seed ratio "
             "splitproof / TRL (range beside it). The machine is shared with other jobs (2 cores). "
             + bl.clock_note("cpu") + " TRL's stage times come from wrappers around its methods (`_generate`, "
             "`_calculate_rewards`, the no-grad `_get_per_token_logps_and_entropies`, `training_step` minus its "
             "`_prepare_inputs`, `_clip_grad_norm`, the optimizer step); ours from the same kind of wrappers around "
             "`splitproof.rl.step`'s stage functions, whose wall times agree with the `timing_s/*` of metrics.jsonl "
             f"to {100 * max(x['timing_gap'] for x in result['summaries']['ours']):.1f} % at worst (the update also "
             "holds the scheduler step).")
    blocks = [intro, setup_table(result), "Loss mapping (the comparison uses the first row):", MAPPING]
    if not have_trl:
        blocks.append("TRL was not available in this run: splitproof's side only.")
    headers = ["stage", "splitproof ms", "TRL ms", "splitproof / TRL", "range over seeds", "wall: splitproof / TRL"]
    body = []
    for row in result["rows"]:
        if row["key"] == "tokens_per_s":
            continue
        body.append([row["stage"], _ms(row["ours_cpu"]), _ms(row["trl_cpu"]) if have_trl else "n/a",
                     _ratio(row.get("ratio")), _range(row.get("ratio")), _ratio(row.get("ratio_wall"))])
    tok = next(r for r in result["rows"] if r["key"] == "tokens_per_s")
    body.append(["tokens per second (prompt + response)", f"{tok['ours_cpu']:.0f}",
                 f"{tok['trl_cpu']:.0f}" if have_trl else "n/a", _ratio(tok.get("ratio")), _range(tok.get("ratio")),
                 _ratio(tok.get("ratio_wall"))])
    ours_s, trl_s = result["summaries"]["ours"], result["summaries"]["trl"]
    peak_o = bl.median([x["peak"] for x in ours_s])
    grow_o = bl.median([x["growth"] for x in ours_s])
    if have_trl:
        peak_t, grow_t = bl.median([x["peak"] for x in trl_s]), bl.median([x["growth"] for x in trl_s])
        body.append(["peak RSS, MiB (whole process)", f"{peak_o:.0f}", f"{peak_t:.0f}", f"{peak_o / peak_t:.3f}", "", ""])
        body.append(["RSS growth during training, MiB", f"{grow_o:.1f}", f"{grow_t:.1f}",
                     f"{grow_o / grow_t:.3f}" if grow_t > 0 else "n/a", "", ""])
    else:
        body.append(["peak RSS, MiB (whole process)", f"{peak_o:.0f}", "n/a", "n/a", "", ""])
    blocks += [f"Per training step ({s['prompts_per_step']} prompts × {s['n']} samples, "
               f"{s['prompts_per_step'] // s['mini_batch_prompts']} optimizer steps), CPU ms; a time ratio below 1 "
               "means splitproof is faster (for tokens per second, above 1 does):", bl.table(headers, body)]

    sc = result["score"]
    held = [["initial model", f"{sc['initial']:.3f}", "", "", ""]]
    for side, label in (("ours", "splitproof"), ("trl", "TRL"),
                        ("ours_contiguous", "splitproof, contiguous minibatches (actor.shuffle false)")):
        if side in sc:
            held.append([f"{label} after {s['steps']} steps", f"{sc[side]['mean']:.3f}", f"{sc[side]['sd']:.3f}",
                         ", ".join(f"{v:.3f}" for v in sc[side]["values"]), f"{sc[side]['train']:.3f}"])
    contiguous = (" The contiguous row is our side with verl's default minibatches — the rollout batch cut in "
                  "order, so each optimizer step sees whole prompt groups — everything else as in the first row."
                  if "ours_contiguous" in sc else "")
    blocks += [f"Held-out score — greedy exact match on builtin://addition/test "
               f"({'40 problems, quick' if env.quick else '500 problems'}), both final models scored by splitproof's "
               "own validation code (the last column: the mean training reward over the run's steps, for context)."
               + contiguous,
               bl.table(["model", "mean", "sd over seeds", "per seed", "training reward"], held)]

    split = result["split_summaries"]
    if split:
        srows = []
        for key, label in STAGE_ROWS:
            o = split["ours"]["cpu"][key]
            t = split["trl"]["cpu"][key] if "trl" in split else None
            at1 = next(r for r in result["rows"] if r["key"] == key).get("ratio")
            srows.append([label, _ms(o), _ms(t) if t is not None else "n/a",
                          f"{o / t:.3f}" if t else "n/a", _ratio(at1)])
        blocks += [f"At a {SPLIT}-way micro-batch split — splitproof ppo_micro_batch_size_per_gpu "
                   f"{s['mini_batch_prompts'] * s['n'] // SPLIT} (of {s['mini_batch_prompts'] * s['n']}); TRL "
                   f"per_device_train_batch_size {s['mini_batch_prompts'] * s['n'] // SPLIT} × gradient_accumulation_steps "
                   f"{SPLIT} — one seed, {s['split_steps']} steps:",
                   bl.table(["stage", "splitproof ms", "TRL ms", "splitproof / TRL", "ratio without the split"], srows)]
    rows = result["split_rows"]
    if rows:
        blocks += [f"Which update changes when only the split changes — one optimizer step from the built-in model "
                   f"on one rollout batch of {s['prompts_per_step']} prompts × {s['n']} samples (the whole batch is "
                   "the minibatch), SGD with learning rate 1, no weight decay and no clipping, so that the update is minus "
                   "the gradient (Adam's first step is sign-like and would hide a rescaling), float32; Δw at split 1 "
                   "against Δw at split "
                   f"{SPLIT}. \"Unchanged\" means below {UNCHANGED:g} relative, the float32 floor of re-ordered sums.",
                   bl.table(["side", "loss", "layout", "same samples", "max |Δw₄ − Δw₁| / max |Δw₁|",
                             "‖Δw₄ − Δw₁‖ / ‖Δw₁‖", "update"],
                            [[r["side"], r["loss"], r["layout"], "yes" if r["same_samples"] else "NO",
                              f"{r['max_rel']:.1e}", f"{r['norm_rel']:.1e}", update_word(r)] for r in rows])]
    blocks += causes(result)
    blocks += ["Goals:", bl.table(["goal", "measured", "verdict"], goal_rows(result))]
    return bl.section(NAME, "Side by side with TRL", command, env, load_before, blocks)


def causes(result: dict) -> list[str]:
    """Where splitproof's side is slower, attributed with numbers measured in this run."""
    g = result.get("generation")
    if not g:
        return []
    t = g["seconds"]
    rows = {r["key"]: r for r in result["rows"]}
    excess = t["ours"] - t["hf_generate"]
    padding = t["prefill_canonical"] - t["prefill_longest"]
    table = bl.table(
        ["generation of one step's samples (CPU, median over interleaved repeats)", "ms"],
        [["splitproof's rollout (`HFRollout.generate`, counter-based sampling, canonical padding)", _ms(t["ours"])],
         ["`model.generate` on the same prompts (what TRL's `_generate` calls), left-padded to the longest",
          _ms(t["hf_generate"])],
         [f"prefill forward alone, prompts padded to the canonical width ({g['canonical_width']} columns)",
          _ms(t["prefill_canonical"])],
         [f"prefill forward alone, prompts padded to the batch's longest ({g['longest']} columns)",
          _ms(t["prefill_longest"])]])
    text = (f"Generation, attributed ({g['samples']} samples, chunks of {g['chunk']}): our rollout pads every prompt "
            f"of fewer than {g['canonical_width']} tokens to {g['canonical_width']} columns (the layout rule that makes "
            "a row's logits, and so its tokens, independent of which prompts share its batch — docs/rollout.md), "
            f"where `generate` pads to the batch's longest prompt ({g['longest']}). The prefill at the canonical width "
            f"costs {_ms(padding)} ms more than at the batch's width: {100 * padding / excess:.0f} % of our rollout's "
            f"{_ms(excess)} ms over plain `generate`; the rest is the longer KV cache in the decode steps and the "
            "per-sample bookkeeping. " if excess > 0 else "Generation: our rollout is not slower than plain `generate`. ")
    if rows["gen"].get("ratio"):
        text += (f"Against TRL's whole generation stage (which also tokenizes prompts and decodes completions — our "
                 f"decoding is in the reward stage, so compare generation + reward) the ratio is "
                 f"{_ratio(rows['gen_reward']['ratio'])}.")
    return [text, table]


def update_word(row: dict) -> str:
    if math.isnan(row["max_rel"]):
        return "no update (every advantage is zero)"
    return "unchanged" if row["max_rel"] <= UNCHANGED else "changed"


def goal_rows(result: dict) -> list[list[str]]:
    rows = []
    step = next(r for r in result["rows"] if r["key"] == "total").get("ratio")
    if step:
        rows.append(["step time splitproof / TRL ≤ 1.0", f"{step['median']:.3f} ({step['low']:.3f}–{step['high']:.3f})",
                     bl.verdict(step["median"], 1.0)])
    sc = result["score"]
    if "trl" in sc:
        spread = max(sc["ours"]["sd"], sc["trl"]["sd"])
        gap = sc["ours"]["mean"] - sc["trl"]["mean"]
        rows.append(["held-out score not lower than TRL's beyond the seed spread",
                     f"{gap:+.3f} (larger sd {spread:.3f})",
                     "met" if gap >= -spread else f"missed by {-gap - spread:.3f}"])
    ours = [r for r in result["split_rows"] if r["side"] == "splitproof"]
    if ours:
        rows.append([f"our update unchanged by the split (≤ {UNCHANGED:g} relative)", f"{ours[0]['max_rel']:.1e}",
                     "missed (the samples differ)" if not ours[0]["same_samples"]
                     else "met" if update_word(ours[0]) == "unchanged" else f"missed ({update_word(ours[0])})"])
    return rows


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=3, quick_repeats=1)
    p.add_argument("--trl-python", default=None, help="interpreter of an environment with trl (default: "
                   "SPLITPROOF_TRL_PYTHON, else this one if it has trl)")
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 20, 2 with --quick)")
    args = p.parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
