"""The learned-reward recipe: GRPO on the built-in task against a reward model trained from the task's rule,
over several seeds, scored on held-out problems by the rule.

    python scripts/rm_curve.py --runs runs/rm --seeds 4 [--write] [key=value ...]

Uses the built-in reward model (``splitproof/builtin/addition_rm``; with ``--retrain`` one built by
``scripts/train_reward_model.py`` into ``RUNS/reward-model``, reused when there), then runs the embedded
default (``splitproof train``, the built-in model's recipe) with
``reward.reward_model.enable=true reward.reward_model.model_path=<that model>`` and no reward
function: the policy learns from the model's score alone, and the built-in rule is reported beside it as
``acc`` — held out (``val-core/addition/acc/mean@1``, greedy, 500 problems) and on the training samples
(``reward/acc/mean``, beside the model's ``reward/rm_score/mean``). Seeds as ``scripts/embedded_curve.py``.
Writes the table into docs/reward-models.md (between its ``learned-reward curve`` markers) and
docs/reward-model-curve.png with ``--write``: held-out rule accuracy per seed, and the training samples'
model score against their rule score (the mean over seeds), on one plot — reward hacking would show as the
model's score rising while the rule's does not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import embedded_curve
import train_reward_model
from splitproof.builtin import addition_reward_model_directory

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- BEGIN learned-reward curve", "<!-- END learned-reward curve -->"


def training_curves(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """The training samples' ``reward/rm_score/mean`` and ``reward/acc/mean`` per step."""
    curves: dict[str, list] = {"reward/rm_score/mean": [], "reward/acc/mean": []}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, points in curves.items():
            if key in record:
                points.append((record["step"], record[key]))
    return curves


def section(held_out: dict, timings: dict, metric: str, extra: list[str], rm_report: dict) -> str:
    steps = [s for s, _ in held_out[0]]
    lines = ["| step | " + " | ".join(f"seed {k}" for k in held_out) + " | mean |", "|" + "---|" * (len(held_out) + 2)]
    for i, step in enumerate(steps):
        values = [held_out[k][i][1] for k in held_out]
        lines.append(f"| {step} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {statistics.mean(values):.3f} |")
    gains = [100 * (c[-1][1] - c[0][1]) for c in held_out.values()]
    cpus = [t["cpu_s"] for t in timings.values()]
    test = rm_report["test"]
    command = " ".join(
        ["splitproof train", "reward.reward_model.enable=true", "reward.reward_model.model_path=RM", *extra]
    )
    return "\n".join(
        [
            f"The reward model (`scripts/train_reward_model.py`, {rm_report['seconds']:.0f} s): pairwise accuracy "
            f"{test['pairwise_accuracy']:.3f} on {test['pairs']} held-out (right, wrong) pairs of the built-in "
            f"model's samples (before training: {rm_report['test_before']['pairwise_accuracy']:.3f}).",
            "",
            f"Held-out rule score `{metric}` (greedy, 500 held-out problems) of `{command}` over {len(held_out)} "
            "seeds (seed k > 0 sets `data.seed=k+1 actor_rollout_ref.rollout.seed=42+k`), measured with "
            "`scripts/rm_curve.py`:",
            "",
            *lines,
            "",
            f"Gain from the first evaluation to the last: {min(gains):+.1f} to {max(gains):+.1f} points "
            f"(mean {statistics.mean(gains):+.1f}). Per run: {min(cpus):.0f}–{max(cpus):.0f} s of CPU time.",
            "",
            "![held-out rule score per seed; training samples' model score against their rule score]"
            "(reward-model-curve.png)",
        ]
    )


def plot(held_out: dict, training: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for seed, points in held_out.items():
        left.plot([s for s, _ in points], [v for _, v in points], marker="o", ms=3, label=f"seed {seed}")
    left.set(xlabel="training step", ylabel="held-out rule score (acc, greedy)")
    left.grid(alpha=0.3)
    left.legend()
    mean = {}
    for key in ("reward/rm_score/mean", "reward/acc/mean"):
        per_seed = [dict(training[s][key]) for s in training]
        steps = sorted(set.intersection(*[set(p) for p in per_seed]))
        mean[key] = (steps, [statistics.mean(p[s] for p in per_seed) for s in steps])
    right.plot(*mean["reward/rm_score/mean"], color="tab:red", label="reward-model score (logit)")
    right.set(xlabel="training step", ylabel="reward-model score, training samples")
    twin = right.twinx()
    twin.plot(*mean["reward/acc/mean"], color="tab:blue", label="rule score (acc)")
    twin.set_ylabel("rule score, training samples")
    handles = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(handles, [h.get_label() for h in handles], loc="lower right")
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--retrain", action="store_true", help="train the reward model into RUNS/reward-model")
    parser.add_argument("overrides", nargs="*", help="key=value for every run")
    args = parser.parse_args()
    rm_dir = Path(addition_reward_model_directory())
    if args.retrain:
        rm_dir = args.runs / "reward-model"
        if not (rm_dir / "training.json").exists():
            train_reward_model.main(["--out", str(rm_dir)])
    rm_report = json.loads((rm_dir / "training.json").read_text())
    keys = ["reward.reward_model.enable=true", f"reward.reward_model.model_path={rm_dir.resolve()}", *args.overrides]
    held_out, training, timings, metric = {}, {}, {}, None
    for seed in range(args.seeds):
        folder = args.runs / f"seed{seed}"
        timings[seed] = embedded_curve.run_seed(folder, seed, keys)
        metric, held_out[seed] = embedded_curve.held_out_curve(folder)
        training[seed] = training_curves(folder)
        print(f"seed {seed}: {held_out[seed][0][1]:.3f} -> {held_out[seed][-1][1]:.3f}", flush=True)
    text = section(held_out, timings, metric, args.overrides, rm_report)
    print(text)
    if args.write:
        embedded_curve.write_section(text, ROOT / "docs" / "reward-models.md", BEGIN, END)
        plot(held_out, training, ROOT / "docs" / "reward-model-curve.png")


if __name__ == "__main__":
    main()
