"""The reward model's and the judge's share of a GRPO step, and the judge's tokens per second against the
policy's rollout on the same engine.

Two short `splitproof train` runs through its own entry, on the same data and settings, one torch thread:

- the policy scored by a discriminative reward model (a one-label sequence classifier with the policy's
  body and a fresh head, `classifier_from_causal_lm`, saved to a temporary directory);
- the policy scored by a generative judge (the policy's base model loaded a second time, greedy, a short
  yes/no template, at most ``JUDGE_TOKENS`` answer tokens).

Full: SmolLM2-135M-Instruct (``--model``, default /work/smollm2) as policy, reward model body and judge,
float32. ``--quick``: the built-in character model in all three roles (the smoke test only).

Per step (wrappers around the functions that run the stages, wall and process CPU time): generation, the
old log-probs, the update, the reward model's or the judge's scoring (`model_scores`, the same span as
`timing_s/reward_model`) and the whole step. The share = scoring / step. Every `HFRollout.generate` call
is counted (its response tokens and seconds), told apart by its sampling stream: the policy's training
stream 0, the judge's streams from `JUDGE_STREAM`. Medians over the steps after the first (a warm-up).

    python benchmarks/reward_models.py [--quick] [--steps N] [--prompts 8] [--n 4] [--length 32]
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl
import stage_clock

NAME = "reward_models"
STEPS = 3
DEFAULT_MODEL = "/work/smollm2"
JUDGE_TOKENS = 8
TEMPLATE = (
    "Question: What is {prompt}? Proposed answer: {response}. Is the proposed answer correct? Reply with yes or no."
)
QUICK_TEMPLATE = "{prompt}{response}"  # the built-in model's characters only
STAGES = (
    ("gen", "generation (policy rollout)"),
    ("old_log_prob", "old log-probs"),
    ("update", "update (actor)"),
    ("reward_model", "scoring (reward model / judge)"),
)


def model_dirs(env: bl.Env, work: Path) -> tuple[str, str]:
    """(the policy's and judge's directory, the reward model's directory, written under ``work``)."""
    import splitproof
    from splitproof.hf_models import load_causal_lm
    from splitproof.rl.rewards.reward_model import classifier_from_causal_lm

    policy = str(Path(splitproof.__file__).parent / "builtin" / "charlm") if env.quick else env.args.model
    body = load_causal_lm(policy)
    rm = classifier_from_causal_lm(body, seed=0, dtype=env.dtype)
    rm.save_pretrained(work / "rm")
    del body, rm
    return policy, str(work / "rm")


def overrides(env: bl.Env, policy: str, rm: str, kind: str, run_dir: Path) -> list[str]:
    a = env.args
    common = [
        f"actor_rollout_ref.model.path={policy}",
        "algorithm.adv_estimator=grpo",
        "data.train_files=builtin://addition/train",
        "data.val_files=null",
        f"data.train_batch_size={a.prompts}",
        "data.max_prompt_length=64",
        f"data.max_response_length={a.length}",
        f"actor_rollout_ref.rollout.n={a.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        f"trainer.total_training_steps={a.steps or (2 if env.quick else STEPS)}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.cpu_threads={env.threads}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.resume_mode=disable",
        "reward.reward_model.enable=true",
    ]
    if kind == "classifier":
        return common + [f"reward.reward_model.model_path={rm}"]
    template = QUICK_TEMPLATE if env.quick else TEMPLATE
    return common + [
        "reward.reward_model.kind=judge",
        f"reward.reward_model.model_path={policy}",
        f"reward.reward_model.judge.template='{template}'",
        "reward.reward_model.judge.parser=" + ("score" if env.quick else "verdict"),
        "reward.reward_model.rollout.do_sample=false",
        f"reward.reward_model.rollout.response_length={JUDGE_TOKENS}",
    ]


def counted_generate(clock: stage_clock.Clock, calls: list[dict]):
    """A wrapper maker for ``HFRollout.generate``: each call's step, stream, tokens and seconds."""

    def make(original):
        def call(self, requests, params, *, step, stream=0, **kwargs):
            w0, c0 = clock.now()
            samples = original(self, requests, params, step=step, stream=stream, **kwargs)
            w1, c1 = clock.now()
            calls.append(
                dict(
                    step=clock.step,
                    stream=stream,
                    sequences=len(samples),
                    prompt_tokens=sum(len(r[2]) for r in requests),
                    tokens=sum(len(s.response_ids) for s in samples),
                    wall=w1 - w0,
                    cpu=c1 - c0,
                )
            )
            return samples

        return call

    return make


def train_run(env: bl.Env, cfg_overrides: list[str], run_dir: Path) -> dict:
    """One `splitproof train` run under the wrappers: the stage report and the engine's calls."""
    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl import train as train_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.models import learner as learner_mod
    from splitproof.rl.rewards import model_scoring
    from splitproof.rl.rollout.hf import HFRollout

    cfg = load_train_config(None, cfg_overrides)
    clock, calls, built = stage_clock.Clock(), [], {}
    patches = [
        (step_mod, "generate", stage_clock.timed_call(clock, "gen")),
        (model_scoring, "model_scores", stage_clock.timed_call(clock, "reward_model")),
        (learner_mod, "update_policy", stage_clock.timed_call(clock, "update")),
        (step_mod, "no_grad_log_probs", stage_clock.log_prob_passes(clock, built)),
        (loop_mod, "train_step", stage_clock.starts_step(clock, "step")),
        (train_mod, "fit", stage_clock.finishes(clock)),
        (train_mod, "build_parts", stage_clock.records_parts(built)),
        (HFRollout, "generate", counted_generate(clock, calls)),
    ]
    with stage_clock.patched(patches), open(os.devnull, "w") as console:
        train_mod.train(cfg, console=console)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = cfg.trainer.total_training_steps
    return dict(report=clock.report(steps), calls=calls, records=[r for r in records if r.get("step", 0) >= 1])


def summary(run: dict, judge_stream: int) -> dict:
    """Medians over the steps after the first: seconds per stage and the step (wall, CPU), the scoring's
    share, and tokens per second of the policy's and the judge's engine calls."""
    report = run["report"]
    steps = len(report["total"]["wall"])
    kept = list(range(1, steps)) if steps > 1 else [0]

    def med(values: list[float]) -> float:
        return bl.median([values[i] for i in kept])

    out = {}
    for clock in ("wall", "cpu"):
        row = {stage: med(report.get(stage, {clock: [0.0] * steps})[clock]) for stage, _ in STAGES}
        step = report["step"][clock]
        row["step"] = med(step)
        row["rest"] = med(
            [step[i] - sum(report.get(s, {clock: [0.0] * steps})[clock][i] for s, _ in STAGES) for i in range(steps)]
        )
        row["share"] = med([report["reward_model"][clock][i] / step[i] for i in range(steps)])
        out[clock] = row
    for role, test in (("policy", lambda s: s == 0), ("judge", lambda s: s >= judge_stream)):
        calls = [c for c in run["calls"] if test(c["stream"]) and c["step"] - 1 in kept]
        out[role] = dict(
            calls=len(calls),
            sequences=bl.median([c["sequences"] for c in calls]) if calls else 0,
            prompt_tokens=bl.median([c["prompt_tokens"] for c in calls]) if calls else 0,
            tokens=bl.median([c["tokens"] for c in calls]) if calls else 0,
            **{
                f"{clock}_tps": bl.median([c["tokens"] / c[clock] for c in calls]) if calls else 0.0
                for clock in ("wall", "cpu")
            },
        )
    out["judge_parse_failures"] = [r.get("judge/parse_failures") for r in run["records"]]
    out["steps"] = steps
    return out


def run(env: bl.Env) -> dict:
    from splitproof.rl.rewards.judge import JUDGE_STREAM

    work = Path(tempfile.mkdtemp(prefix="splitproof-reward-models-"))
    try:
        policy, rm = model_dirs(env, work)
        results = {}
        for kind in ("classifier", "judge"):
            run_dir = work / f"run-{kind}"
            bl.log(f"[{NAME}] {kind}: training for {env.args.steps or (2 if env.quick else STEPS)} steps")
            results[kind] = summary(train_run(env, overrides(env, policy, rm, kind, run_dir), run_dir), JUDGE_STREAM)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    judge = results["judge"]
    results["judge_vs_policy_cpu"] = judge["judge"]["cpu_tps"] / judge["policy"]["cpu_tps"]
    results["judge_vs_policy_wall"] = judge["judge"]["wall_tps"] / judge["policy"]["wall_tps"]
    results["config"] = dict(
        model=policy, prompts=env.args.prompts, n=env.args.n, length=env.args.length, judge_tokens=JUDGE_TOKENS
    )
    return results


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    c = result["config"]
    rm, judge = result["classifier"], result["judge"]
    model = "the built-in character model (quick mode)" if env.quick else f"SmolLM2-135M-Instruct (`{c['model']}`)"
    intro = (
        f"Setup: `splitproof train` (GRPO) with {model} as the policy, {c['prompts']} prompts × {c['n']} samples "
        f"of at most {c['length']} tokens per step on builtin://addition, one optimizer step per step, "
        f"{rm['steps']} steps per run, medians over the steps after the first. Reward model: a one-label "
        "classifier with the policy's body and a fresh head (`classifier_from_causal_lm`). Judge: the same "
        f"model loaded a second time, greedy, a yes/no template, at most {c['judge_tokens']} answer tokens, on "
        "the `hf` rollout engine the policy generates with. The machine has 2 cores and other jobs (a test "
        "suite) ran beside this one: wall times carry their load; CPU time (one thread) much less."
    )
    rows = []
    for stage, label in STAGES + (
        ("rest", "rest of the step (reward rule, advantages, batching)"),
        ("step", "whole step"),
    ):
        rows.append(
            [label] + [f"{r[clock][stage]:.3f}" for r in (rm, judge) for clock in ("cpu", "wall")],
        )
    rows.append(
        ["scoring's share of the step"]
        + [f"{100 * r[clock]['share']:.1f} %" for r in (rm, judge) for clock in ("cpu", "wall")]
    )
    stages = bl.table(["stage (s per step)", "reward model CPU", "reward model wall", "judge CPU", "judge wall"], rows)
    p, j = judge["policy"], judge["judge"]
    engine = bl.table(
        ["engine call (judge run)", "sequences", "prompt tokens", "generated tokens", "tokens/s CPU", "tokens/s wall"],
        [
            [
                "policy rollout",
                p["sequences"],
                p["prompt_tokens"],
                p["tokens"],
                f"{p['cpu_tps']:.1f}",
                f"{p['wall_tps']:.1f}",
            ],
            ["judge", j["sequences"], j["prompt_tokens"], j["tokens"], f"{j['cpu_tps']:.1f}", f"{j['wall_tps']:.1f}"],
            [
                "judge / policy",
                "",
                "",
                "",
                f"{result['judge_vs_policy_cpu']:.2f}",
                f"{result['judge_vs_policy_wall']:.2f}",
            ],
        ],
    )
    note = (
        "Tokens per second = generated tokens / the seconds of the engine call (prefill of the prompts or "
        "questions included), median over the steps. The judge's questions are longer prompts than the "
        f"policy's and its answers shorter, so its prefill weighs more per generated token. Judge parse "
        f"failures per step: {', '.join(str(int(x)) for x in judge['judge_parse_failures'] if x is not None)}."
    )
    return bl.section(NAME, "Reward models and judges", command, env, load_before, [intro, stages, engine, note])


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=1, quick_repeats=1)
    p.add_argument("--steps", type=int, default=None, help=f"training steps per run (default {STEPS}, 2 with --quick)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="the policy's (and judge's) directory (full runs)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8, 2 with --quick)")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--length", type=int, default=None, help="response tokens at most (default 32, 8 with --quick)")
    args = p.parse_args(argv)
    args.prompts = args.prompts or (2 if args.quick else 8)
    args.length = args.length or (8 if args.quick else 32)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
