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
    python benchmarks/vs_trl.py --model DIR [--vllm-python PATH] ...   (each part of the step on DIR's model)

TRL is never a dependency of splitproof: install it in its own environment (`pip install -e '.[bench]'`,
which pins torch so that no CUDA build is pulled) and name its interpreter with `--trl-python` (or
SPLITPROOF_TRL_PYTHON); without it a `--quick` run measures splitproof's side only.

This script runs the sides and holds the settings; the reduction of their results is `vs_trl_summary.py`,
the docs section `vs_trl_report.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import benchlib as bl
import vs_trl_model
import vs_trl_sides as sides
from vs_trl_common import TASK_TRAIN
from vs_trl_report import render
from vs_trl_summary import NAME, SPLIT, score_summary, side_summary, split_rows, stage_rows

SIDES_SCRIPT = Path(__file__).resolve().parent / "vs_trl_sides.py"
SEEDS = (1, 2, 3, 4, 5)
VAL_FULL = "builtin://addition/test"
VAL_QUICK = "builtin://addition/test?size=40"

# The built-in model's recipe (splitproof/recipes/charlm.yaml): 128 prompts × 8 samples, four optimizer
# steps of 32 prompts per training step, responses of at most 4 tokens.
FULL = dict(prompts_per_step=128, n=8, mini_batch_prompts=32, steps=20, split_steps=10, generation_repeats=5)
QUICK = dict(prompts_per_step=8, n=8, mini_batch_prompts=4, steps=2, split_steps=2, generation_repeats=2)
COMMON = dict(
    micro_split=1,
    data_seed=1,
    max_response_length=4,
    temperature=1.0,
    lr=5e-4,
    betas=[0.9, 0.999],
    weight_decay=0.01,
    grad_clip=1.0,
    ours_loss_agg_mode="token-mean",
    ours_shuffle=True,
    trl_loss_type="dapo",
    scale_rewards="group",
    splits=[1, SPLIT],
    trl_split_losses=["dapo", "bnpo", "grpo"],
)


# --------------------------------------------------------------------------------------------- settings


def make_spec(env: bl.Env, seed: int) -> dict:
    """The settings both sides run, with the uids our prompt sampler serves at every step."""
    from splitproof.rl.data.prompts import PromptSampler
    from splitproof.rl.data.tasks import task_rows

    if env.args.model:
        sizes = dict(vs_trl_model.sizes(env.quick), model=str(Path(env.args.model).resolve()))
    else:
        sizes = QUICK if env.quick else FULL
    steps = env.args.steps or sizes["steps"]
    spec = dict(COMMON, **dict(sizes, steps=steps), seed=seed)
    sampler = PromptSampler(len(task_rows(TASK_TRAIN)), spec["prompts_per_step"], seed=spec["data_seed"], shuffle=True)
    spec["uids"] = [sampler.next_batch() for _ in range(max(steps, spec["split_steps"]))]
    return spec


def find_trl_python(requested: str | None) -> tuple[str | None, str]:
    """(interpreter, TRL version) of the environment with TRL, or (None, why not)."""
    candidate = requested or os.environ.get("SPLITPROOF_TRL_PYTHON") or sys.executable
    try:
        done = subprocess.run(
            [candidate, "-c", "import trl; print(trl.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            env=_child_env(),
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot run {candidate}: {e}"
    if done.returncode != 0:
        return None, f"{candidate} cannot import trl"
    return candidate, done.stdout.strip()


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(bl.REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
        TRANSFORMERS_VERBOSITY="error",
        HF_HUB_OFFLINE="1",
    )
    # a rollout.name=vllm side: the engine's threads on one core, like every other side's one thread
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run_side(python: str, side: str, spec: dict, work: Path, tag: str) -> dict:
    """Sides (comma-separated) in one fresh process, one after the other; their results by side."""
    out = work / tag
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    bl.log(f"[{NAME}] {tag}: {side} ({Path(python).parent.parent.name})")
    done = subprocess.run(
        [python, str(SIDES_SCRIPT), side, str(spec_path), str(out)], capture_output=True, text=True, env=_child_env()
    )
    if done.returncode != 0:
        raise RuntimeError(f"{tag} ({side}) failed with exit {done.returncode}:\n{done.stderr[-4000:]}")
    results = json.loads((out / "result.json").read_text())
    for result in results.values():
        result["dir"] = str(out)
    return results


def held_out(spec: dict, weights: dict[str, Path], quick: bool, work: Path) -> dict[str, float]:
    """Greedy held-out score (our validation code, the same split) of the initial model and each final one."""
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.evaluate import evaluate_held_out
    from splitproof.rl.run import build_parts

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
            sys.exit(
                f"error: the TRL side needs an environment with trl ({trl_version}); install it apart from "
                "splitproof's (pip install -e '.[bench]') and pass --trl-python PATH or SPLITPROOF_TRL_PYTHON"
            )
        bl.log(f"[{NAME}] TRL not available ({trl_version}): this quick run measures splitproof's side only")
    pythons = {"ours": sys.executable, "trl": trl_python, "vllm": env.args.vllm_python}
    if env.args.model:
        work = Path(tempfile.mkdtemp(prefix="splitproof-vs-trl-"))
        bl.log(f"[{NAME}] the sides' results go to {work} (kept if the run fails)")
        result = vs_trl_model.run_model(env, pythons, make_spec, run_side, work)
        shutil.rmtree(work, ignore_errors=True)
        return dict(result, trl_version=trl_version if trl_python else None, trl_python=trl_python)
    seeds = SEEDS[: env.repeats]
    work = Path(tempfile.mkdtemp(prefix="splitproof-vs-trl-"))
    try:
        runs = main_runs(env, seeds, pythons, work)
        split = split_runs(env, seeds[0], pythons, work)
        weights = {f"{side}-{i}": Path(res["dir"]) / "final.pt" for side in runs for i, res in enumerate(runs[side])}
        bl.log(f"[{NAME}] held-out evaluation of {len(weights)} final models")
        scores = held_out(make_spec(env, seeds[0]), weights, env.quick, work)
        update_rows = split_rows(split.get("ours-split"), split.get("trl-split"), make_spec(env, seeds[0]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = dict(
        spec={k: v for k, v in make_spec(env, seeds[0]).items() if k != "uids"},
        seeds=list(seeds),
        trl_version=trl_version if trl_python else None,
        trl_python=trl_python,
        summaries={side: [side_summary(res) for res in results] for side, results in runs.items()},
        split_summaries={side: side_summary(split[side]) for side in ("ours", "trl") if side in split},
        scores=scores,
        split_rows=update_rows,
        runs=runs,
        generation=split.get("ours-generation"),
    )
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
        for side in ["ours", "trl"] if r % 2 == 0 else ["trl", "ours"]:
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


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=3, quick_repeats=1)
    p.add_argument(
        "--trl-python",
        default=None,
        help="interpreter of an environment with trl (default: SPLITPROOF_TRL_PYTHON, else this one if it has trl)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per run (default 20, 2 with --quick)")
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory: each part of the step on it against TRL's (vs_trl_model.py)",
    )
    p.add_argument(
        "--vllm-python", default=None, help="with --model: an interpreter with vLLM (a rollout.name=vllm side)"
    )
    p.add_argument(
        "--variants",
        default=None,
        help=f"with --model: the variants to run, comma-separated (default: all of {','.join(vs_trl_model.VARIANTS)})",
    )
    args = p.parse_args(argv)
    try:
        vs_trl_model.chosen_variants(args.variants)  # a misspelt variant stops here, before any side runs
    except ValueError as e:
        p.error(str(e))
    if args.model:
        section = f"{NAME}_{Path(args.model).name.lower()}"
        return bl.run_script(NAME, args, argv, run, vs_trl_model.render_model, section=section)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
