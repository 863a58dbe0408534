"""One side of `benchmarks/vs_trl.py`, run in a process of its own.

    python benchmarks/vs_trl_sides.py SIDE[,SIDE...] SPEC.json OUT_DIR    (SIDE: ours, trl, ours-split, trl-split)

- ``ours``: `splitproof train`'s own entry (`splitproof.rl.train.train`) on the spec's settings; stage
  times from the wrapped stage functions (wall and process CPU time) next to `timing_s/*` of
  metrics.jsonl; the final weights saved for the held-out evaluation.
- ``trl``: TRL's `GRPOTrainer` on the same model, data order, sampling and optimizer settings; stage
  times from wrappers around the trainer's methods (generation, reward, the no-grad log-prob pass,
  the training micro-steps, gradient clipping and the optimizer step).
- ``ours-split`` / ``trl-split``: one optimizer step from the built-in model on one rollout batch, at
  each micro-batch split (TRL: each loss type at gradient accumulation 1 and 4), SGD; the update
  Δw of every split, saved for the driver to compare.

The sides named run one after the other; ``OUT_DIR/result.json`` maps each to its result (``.pt`` files
hold weights). The process uses one torch thread.
TRL is imported only by the ``trl*`` sides, so this file runs in any environment that has splitproof.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stage_clock import Clock, finishes, peak_rss_mib, rss_mib, starts_step, timed_call, wrap
from vs_trl_common import SPLIT_OPTIMIZER, chat_rows, delta_of, digest
from vs_trl_trl_side import run_trl, run_trl_split

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

STAGES = ("gen", "reward", "old_log_prob", "update")


# --------------------------------------------------------------------------------------------- settings


def ours_overrides(
    spec: dict,
    out: Path,
    *,
    steps: int | None = None,
    micro_split: int | None = None,
    optimizer: str | None = None,
    grad_clip: float | None = None,
) -> list[str]:
    """The `splitproof train` overrides of a spec (the built-in model's recipe fills in the rest)."""
    n, mini = spec["n"], spec["mini_batch_prompts"]
    split = micro_split or spec["micro_split"]
    clip = spec["grad_clip"] if grad_clip is None else grad_clip
    return [
        f"data.train_batch_size={spec['prompts_per_step']}",
        f"data.max_response_length={spec['max_response_length']}",
        f"data.seed={spec['data_seed']}",
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.temperature={spec['temperature']}",
        f"actor_rollout_ref.rollout.seed={spec['seed']}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={mini * n // split}",
        f"actor_rollout_ref.actor.loss_agg_mode={spec['ours_loss_agg_mode']}",
        f"actor_rollout_ref.actor.shuffle={str(spec['ours_shuffle']).lower()}",
        f"actor_rollout_ref.actor.grad_clip={clip}",
        f"actor_rollout_ref.actor.optim.clip_grad={clip}",
        f"actor_rollout_ref.actor.optim.optimizer={optimizer or 'AdamW'}",
        f"actor_rollout_ref.actor.optim.lr={spec['lr']}",
        f"actor_rollout_ref.actor.optim.betas=[{spec['betas'][0]},{spec['betas'][1]}]",
        f"actor_rollout_ref.actor.optim.weight_decay={spec['weight_decay']}",
        f"algorithm.norm_adv_by_std_in_grpo={str(spec['scale_rewards'] == 'group').lower()}",
        f"trainer.total_training_steps={steps or spec['steps']}",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        "trainer.logger=[file]",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={out}",
    ] + model_overrides(spec, out)


def model_overrides(spec: dict, folder: Path) -> list[str]:
    """With ``spec["model"]`` (a Hugging Face directory): that model on the built-in task's prompts as chat
    messages (written to ``folder``; verl's defaults otherwise, so GRPO named), one thread; ``bypass``,
    ``prefix_grouper`` and ``rollout`` pick verl's variants."""
    if not spec.get("model"):
        return []
    folder.mkdir(parents=True, exist_ok=True)
    train = folder / "chat_train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in chat_rows()))
    out = [
        f"actor_rollout_ref.model.path={spec['model']}",
        f"data.train_files={train}",
        "data.max_prompt_length=128",
        "algorithm.adv_estimator=grpo",
        "trainer.cpu_threads=1",
    ]
    if spec.get("bypass"):
        out.append("algorithm.rollout_correction.bypass_mode=true")
    if spec.get("prefix_grouper"):
        out.append("actor_rollout_ref.actor.use_prefix_grouper=true")
    if spec.get("rollout", "hf") != "hf":
        out.append(f"actor_rollout_ref.rollout.name={spec['rollout']}")
    return out


# --------------------------------------------------------------------------------------------- ours


def run_ours(spec: dict, out: Path) -> dict:
    import torch

    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl import train as train_mod
    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.models import learner as learner_mod

    clock = Clock()
    built = {}
    cfg = load_train_config(None, ours_overrides(spec, out))
    wrap(step_mod, "generate", timed_call(clock, "gen"))
    wrap(step_mod, "score_samples", timed_call(clock, "reward"))
    wrap(step_mod, "no_grad_log_probs", timed_call(clock, "old_log_prob"))
    wrap(learner_mod, "update_policy", timed_call(clock, "update"))

    def build_recorded(original):
        def call(*args, **kwargs):
            run = original(*args, **kwargs)
            built.update(run=run, rss_loaded=rss_mib(), peak_loaded=peak_rss_mib())
            return run

        return call

    wrap(loop_mod, "train_step", starts_step(clock))
    wrap(train_mod, "build_parts", build_recorded)
    wrap(train_mod, "fit", finishes(clock))
    train_mod.train(cfg)
    peak = peak_rss_mib()
    run = built["run"]
    torch.save(run.actor.model.state_dict(), out / "final.pt")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if r.get("step", 0) >= 1]
    metric = lambda key: [float(r.get(key, 0.0)) for r in records]  # noqa: E731
    return dict(
        side="ours",
        steps=spec["steps"],
        clock=clock.report(spec["steps"]),
        metrics_timing={
            k: metric(k)
            for k in (
                "timing_s/gen",
                "timing_s/reward",
                "timing_s/old_log_prob",
                "timing_s/adv",
                "timing_s/update_actor",
                "timing_s/step",
            )
        },
        tokens=metric("perf/total_num_tokens"),
        train_score=metric("critic/score/mean"),
        response_length=metric("response_length/mean"),
        rss_loaded=built["rss_loaded"],
        peak_loaded=built["peak_loaded"],
        peak=peak,
        threads=torch.get_num_threads(),
        optimizer_steps=run.actor.optimizer_steps,
    )


# --------------------------------------------------------------------------------------------- splits


def run_ours_split(spec: dict, out: Path) -> dict:
    """One training step (one optimizer step: the minibatch is the whole rollout batch) with
    ``SPLIT_OPTIMIZER``, at each micro-batch split; the samples' digest shows they are the same."""
    import torch

    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.run import build_parts
    from splitproof.rl.step import train_step

    split_spec = dict(spec, mini_batch_prompts=spec["prompts_per_step"], **SPLIT_OPTIMIZER)
    results = {}
    for split in spec["splits"]:
        cfg = load_train_config(
            None,
            ours_overrides(
                split_spec, out / f"ours{split}", steps=1, micro_split=split, optimizer="SGD", grad_clip=1e9
            ),
        )
        run = build_parts(cfg)
        start = {k: v.detach().clone() for k, v in run.actor.model.state_dict().items()}
        output = train_step(run, 1, run.prompts.sampler.next_batch())
        delta = delta_of(run.actor.model.state_dict(), start)
        torch.save(delta, out / f"ours_split{split}.pt")
        results[str(split)] = dict(
            samples=digest([list(s.prompt_ids) + [-1] + list(s.response_ids) for s in output.scored.samples]),
            micro_batch=split_spec["mini_batch_prompts"] * spec["n"] // split,
            pg_loss=output.metrics.get("actor/pg_loss"),
        )
    return dict(side="ours-split", splits=results)


# --------------------------------------------------------------------------------------------- generation


def _interleaved_cpu(variants: dict, repeats: int) -> dict[str, float]:
    """Median process-CPU seconds of each variant, the variants interleaved, one untimed warm-up each."""
    import statistics

    for fn in variants.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            c0 = time.process_time()
            fn()
            times[name].append(time.process_time() - c0)
    return {name: statistics.median(values) for name, values in times.items()}


def run_ours_generation(spec: dict, out: Path) -> dict:
    """Our generation of one step's samples against `model.generate` on the same prompts (what TRL calls:
    left padding to the batch's longest prompt, sampling at the same temperature), and the prefill
    forward alone at our canonical prompt width against the batch's longest prompt."""
    import torch
    from transformers import GenerationConfig

    from splitproof.rl.config.load import load_train_config
    from splitproof.rl.rollout.prefill import canonical_prompt_width
    from splitproof.rl.run import build_parts
    from splitproof.rl.step import generate

    run = build_parts(load_train_config(None, ours_overrides(spec, out / "generation", steps=1)))
    engine = run.generation.engine
    model, uids, n = engine.model, spec["uids"][0], spec["n"]
    prompts = [list(run.prompts.train[u].prompt_ids) for u in uids for _ in range(n)]
    longest, pad = max(map(len, prompts)), run.pad_token_id
    canonical = max(canonical_prompt_width(len(p), engine.pad_multiple) for p in prompts)

    def left_padded(width: int):
        return (
            torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
            torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]),
        )

    hf_config = GenerationConfig(
        max_new_tokens=spec["max_response_length"],
        do_sample=True,
        temperature=spec["temperature"],
        top_k=0,
        top_p=1.0,
        pad_token_id=pad,
        eos_token_id=list(engine.eos_token_ids),
    )
    short_ids, short_mask = left_padded(longest)
    wide_ids, wide_mask = left_padded(canonical)
    chunk = engine.max_num_seqs

    @torch.no_grad()
    def prefill(ids, mask):
        model.eval()
        for start in range(0, len(ids), chunk):
            m = mask[start : start + chunk]
            model(
                input_ids=ids[start : start + chunk],
                attention_mask=m,
                position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                use_cache=True,
                logits_to_keep=1,
            )

    @torch.no_grad()
    def hf_generate():
        model.eval()
        model.generate(input_ids=short_ids, attention_mask=short_mask, generation_config=hf_config)

    medians = _interleaved_cpu(
        {
            "ours": lambda: generate(engine, run.prompts.train, uids, 1, run.generation.sampling, run.collective),
            "hf_generate": hf_generate,
            "prefill_canonical": lambda: prefill(wide_ids, wide_mask),
            "prefill_longest": lambda: prefill(short_ids, short_mask),
        },
        repeats=spec["generation_repeats"],
    )
    return dict(
        side="ours-generation",
        seconds=medians,
        canonical_width=canonical,
        longest=longest,
        samples=len(prompts),
        chunk=chunk,
    )


SIDES = {
    "ours": run_ours,
    "trl": run_trl,
    "ours-split": run_ours_split,
    "trl-split": run_trl_split,
    "ours-generation": run_ours_generation,
}


def main(argv: list[str]) -> None:
    names, spec_path, out = argv
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    import warnings

    warnings.filterwarnings("ignore")
    results = {}
    for side in names.split(","):
        results[side] = dict(SIDES[side](spec, out), python=sys.executable)
    (out / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
