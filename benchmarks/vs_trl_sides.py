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

import hashlib
import json
import os
import resource
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TASK_TRAIN = "builtin://addition/train"
STAGES = ("gen", "reward", "old_log_prob", "update")


# --------------------------------------------------------------------------------------------- clocks

def rss_mib() -> float:
    """The resident set size now (MiB)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """The process's peak resident set size so far (``getrusage`` maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Clock:
    """Wall and process-CPU seconds per (stage, RL step), added up over the calls of that step."""

    def __init__(self):
        self.step = 0  # the RL step the next measurements belong to (1-based once training runs)
        self.wall: dict[str, dict[int, float]] = {}
        self.cpu: dict[str, dict[int, float]] = {}
        self.starts: list[tuple[float, float]] = []  # (wall, cpu) at the start of every RL step
        self.end: tuple[float, float] | None = None

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def add(self, stage: str, wall: float, cpu: float) -> None:
        for table, value in ((self.wall, wall), (self.cpu, cpu)):
            per_step = table.setdefault(stage, {})
            per_step[self.step] = per_step.get(self.step, 0.0) + value

    @contextmanager
    def timed(self, stage: str):
        w0, c0 = self.now()
        try:
            yield
        finally:
            w1, c1 = self.now()
            self.add(stage, w1 - w0, c1 - c0)

    def begin_step(self) -> None:
        self.step += 1
        self.starts.append(self.now())

    def finish(self) -> None:
        self.end = self.now()

    def totals(self) -> dict[str, list[float]]:
        """Per RL step: wall and CPU from one step's start to the next's (the last to ``finish``)."""
        marks = self.starts + [self.end]
        return {"wall": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
                "cpu": [b[1] - a[1] for a, b in zip(marks, marks[1:])]}

    def per_step(self, stage: str, clock: str, steps: int) -> list[float]:
        table = (self.wall if clock == "wall" else self.cpu).get(stage, {})
        return [table.get(s, 0.0) for s in range(1, steps + 1)]

    def report(self, steps: int) -> dict:
        out = {"total": self.totals()}
        for stage in sorted(set(self.wall) | set(self.cpu)):
            out[stage] = {clock: self.per_step(stage, clock, steps) for clock in ("wall", "cpu")}
        return out


def wrap(owner, name: str, fn_for):
    """Replace ``owner.name`` by ``fn_for(original)``; returns the original."""
    original = getattr(owner, name)
    setattr(owner, name, fn_for(original))
    return original


def timed_call(clock: Clock, stage: str):
    def make(original):
        def call(*args, **kwargs):
            with clock.timed(stage):
                return original(*args, **kwargs)
        return call
    return make


def starts_step(clock: Clock, stage: str | None = None):
    """A wrapper maker: every call begins the next RL step on ``clock`` (and is timed as ``stage``)."""
    def make(original):
        def call(*args, **kwargs):
            clock.begin_step()
            if stage is None:
                return original(*args, **kwargs)
            with clock.timed(stage):
                return original(*args, **kwargs)
        return call
    return make


def finishes(clock: Clock):
    """A wrapper maker: the end of the call ends the last RL step on ``clock``."""
    def make(original):
        def call(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            finally:
                clock.finish()
        return call
    return make


# --------------------------------------------------------------------------------------------- settings

def ours_overrides(spec: dict, out: Path, *, steps: int | None = None, micro_split: int | None = None,
                   optimizer: str | None = None, grad_clip: float | None = None) -> list[str]:
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
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[file]", "trainer.resume_mode=disable", f"trainer.default_local_dir={out}",
    ]


def trl_args(spec: dict, out: Path, *, loss_type: str | None = None, micro_split: int | None = None,
             max_steps: int | None = None, optimizer: str | None = None, grad_clip: float | None = None):
    """`GRPOConfig` for the spec: one generation batch per RL step, ``mini_batch_prompts × n`` samples per
    optimizer step, accumulated over ``micro_split`` micro-steps."""
    from trl import GRPOConfig

    n, mini, split = spec["n"], spec["mini_batch_prompts"], micro_split or spec["micro_split"]
    updates_per_step = spec["prompts_per_step"] // mini
    return GRPOConfig(
        output_dir=str(out / "trl"), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        seed=spec["seed"], data_seed=spec["seed"], shuffle_dataset=False, dataloader_num_workers=0,
        per_device_train_batch_size=mini * n // split, gradient_accumulation_steps=split,
        steps_per_generation=split * updates_per_step, num_generations=n, num_iterations=1,
        max_completion_length=spec["max_response_length"], temperature=spec["temperature"], top_p=1.0, top_k=0,
        loss_type=loss_type or spec["trl_loss_type"], scale_rewards=spec["scale_rewards"], beta=0.0,
        epsilon=0.2, epsilon_high=0.2,
        learning_rate=spec["lr"], adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1], adam_epsilon=1e-8,
        weight_decay=spec["weight_decay"], lr_scheduler_type="constant", warmup_steps=0,
        optim=optimizer or "adamw_torch", max_grad_norm=spec["grad_clip"] if grad_clip is None else grad_clip,
        max_steps=max_steps or spec["steps"] * updates_per_step,
        report_to=[], logging_steps=10**9, save_strategy="no", disable_tqdm=True, log_completions=False,
    )


# --------------------------------------------------------------------------------------------- ours

def run_ours(spec: dict, out: Path) -> dict:
    import torch

    from splitproof.rl import loop as loop_mod
    from splitproof.rl import step as step_mod
    from splitproof.rl import train as train_mod
    from splitproof.rl.models import learner as learner_mod
    from splitproof.rl.config.load import load_train_config

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
    return dict(side="ours", steps=spec["steps"], clock=clock.report(spec["steps"]),
                metrics_timing={k: metric(k) for k in ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
                                                      "timing_s/adv", "timing_s/update_actor", "timing_s/step")},
                tokens=metric("perf/total_num_tokens"), train_score=metric("critic/score/mean"),
                response_length=metric("response_length/mean"), rss_loaded=built["rss_loaded"],
                peak_loaded=built["peak_loaded"], peak=peak, threads=torch.get_num_threads(),
                optimizer_steps=run.actor.optimizer_step)


# --------------------------------------------------------------------------------------------- TRL

def trl_dataset(spec: dict):
    """The prompts in the order our sampler serves them: step after step, each step's uids in order."""
    from datasets import Dataset

    from splitproof.rl.data.tasks import task_rows

    rows = task_rows(TASK_TRAIN)
    return Dataset.from_list([{"prompt": rows[u]["prompt"], "ground_truth": rows[u]["reward_model"]["ground_truth"]}
                              for uids in spec["uids"] for u in uids])


def addition_reward(prompts, completions, ground_truth, **kwargs):
    """The built-in task's rule (exact match), TRL's reward-function signature."""
    from splitproof.rl.data.tasks import score

    return [score(c, g) for c, g in zip(completions, ground_truth)]


def trl_trainer(spec: dict, out: Path, clock: Clock, args, *, record_samples: list | None = None,
                per_step: dict | None = None):
    """A `GRPOTrainer` on the built-in model whose methods report their time to ``clock`` (and, per RL
    step, the tokens generated on and the mean training reward to ``per_step``)."""
    per_step = {"tokens": [], "train_score": []} if per_step is None else per_step
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from splitproof.builtin import charlm_directory

    class Timed(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            clock.begin_step()
            return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            with clock.timed("gen"):
                result = super()._generate(prompts)
            prompt_ids, completion_ids = result[0], result[1]
            per_step["tokens"].append(sum(map(len, prompt_ids)) + sum(map(len, completion_ids)))
            if record_samples is not None:
                record_samples.append([list(p) + [-1] + list(c) for p, c in zip(prompt_ids, completion_ids)])
            return result

        def _calculate_rewards(self, *args, **kwargs):
            with clock.timed("reward"):
                rewards = super()._calculate_rewards(*args, **kwargs)
            per_step["train_score"].append(float(rewards.sum(dim=1).mean()))
            return rewards

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with clock.timed("old_log_prob"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def training_step(self, model, inputs, num_items_in_batch):
            w0, c0 = clock.now()
            before = (sum(clock.wall.get("prepare", {}).values()), sum(clock.cpu.get("prepare", {}).values()))
            try:
                return super().training_step(model, inputs, num_items_in_batch)
            finally:
                w1, c1 = clock.now()
                after = (sum(clock.wall.get("prepare", {}).values()), sum(clock.cpu.get("prepare", {}).values()))
                clock.add("update", (w1 - w0) - (after[0] - before[0]), (c1 - c0) - (after[1] - before[1]))

        def _prepare_inputs(self, generation_batch):
            with clock.timed("prepare"):
                return super()._prepare_inputs(generation_batch)

        def _clip_grad_norm(self, model):
            with clock.timed("update"):
                return super()._clip_grad_norm(model)

    class OptimizerStep(TrainerCallback):
        started = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.started = clock.now()

        def on_optimizer_step(self, args, state, control, **kwargs):
            w1, c1 = clock.now()
            clock.add("update", w1 - self.started[0], c1 - self.started[1])

        def on_train_end(self, args, state, control, **kwargs):
            clock.finish()

    directory = charlm_directory()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left", local_files_only=True)
    return Timed(model=model, reward_funcs=addition_reward, args=args, train_dataset=trl_dataset(spec),
                 processing_class=tokenizer, callbacks=[OptimizerStep()],
                 optimizers=(same_optimizer(model, spec, args), None))


def same_optimizer(model, spec: dict, args):
    """Our optimizer, built by our code: transformers' own would exempt biases and norm weights from weight
    decay, which ours does not."""
    from types import SimpleNamespace

    from splitproof.rl.models.optim import make_optimizer

    name = "SGD" if args.optim == "sgd" else "AdamW"
    return make_optimizer(model, SimpleNamespace(optimizer=name, lr=spec["lr"], betas=spec["betas"],
                                                 weight_decay=spec["weight_decay"]))


def run_trl(spec: dict, out: Path) -> dict:
    import torch
    import trl

    clock, per_step = Clock(), {"tokens": [], "train_score": []}
    trainer = trl_trainer(spec, out, clock, trl_args(spec, out), per_step=per_step)
    rss_loaded, peak_loaded = rss_mib(), peak_rss_mib()
    trainer.train()
    peak = peak_rss_mib()
    torch.save(trainer.model.state_dict(), out / "final.pt")
    steps = spec["steps"]
    if clock.step != steps:
        raise RuntimeError(f"TRL ran {clock.step} generation batches, expected {steps}")
    return dict(side="trl", steps=steps, clock=clock.report(steps), tokens=per_step["tokens"],
                train_score=per_step["train_score"], rss_loaded=rss_loaded,
                peak_loaded=peak_loaded, peak=peak, threads=torch.get_num_threads(), trl_version=trl.__version__,
                optimizer_steps=trainer.state.global_step)


# --------------------------------------------------------------------------------------------- splits

# SGD with learning rate 1, no weight decay and no clipping: the update Δw is minus the gradient, and the
# weights' float32 rounding (about 1e-8) is small next to it.
SPLIT_OPTIMIZER = dict(lr=1.0, weight_decay=0.0)


def _delta(model_state: dict, start: dict) -> dict:
    return {k: (model_state[k].detach().double() - start[k].double()) for k in start}


def _digest(tokens) -> str:
    return hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]


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
        cfg = load_train_config(None, ours_overrides(split_spec, out / f"ours{split}", steps=1, micro_split=split,
                                                     optimizer="SGD", grad_clip=1e9))
        run = build_parts(cfg)
        start = {k: v.detach().clone() for k, v in run.actor.model.state_dict().items()}
        output = train_step(run, 1, run.prompts.sampler.next_batch())
        delta = _delta(run.actor.model.state_dict(), start)
        torch.save(delta, out / f"ours_split{split}.pt")
        results[str(split)] = dict(samples=_digest([list(s.prompt_ids) + [-1] + list(s.response_ids)
                                                    for s in output.scored.samples]),
                                   micro_batch=split_spec["mini_batch_prompts"] * spec["n"] // split,
                                   pg_loss=output.metrics.get("actor/pg_loss"))
    return dict(side="ours-split", splits=results)


def run_trl_split(spec: dict, out: Path) -> dict:
    """TRL: one optimizer step on one generation batch with ``SPLIT_OPTIMIZER``, for each loss type at each
    gradient-accumulation split (``steps_per_generation`` = the split, so the generation batch is the
    optimizer's batch and no old log-prob pass runs)."""
    import torch

    split_spec = dict(spec, mini_batch_prompts=spec["prompts_per_step"], uids=spec["uids"][:1], steps=1,
                      **SPLIT_OPTIMIZER)
    results = {}
    for loss_type in spec["trl_split_losses"]:
        for split in spec["splits"]:
            clock, samples = Clock(), []
            args = trl_args(split_spec, out / f"trl_{loss_type}{split}", loss_type=loss_type, micro_split=split,
                            max_steps=1, optimizer="sgd", grad_clip=0.0)
            trainer = trl_trainer(split_spec, out, clock, args, record_samples=samples)
            start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            trainer.train()
            delta = _delta(trainer.model.state_dict(), start)
            torch.save(delta, out / f"trl_split_{loss_type}{split}.pt")
            results[f"{loss_type}:{split}"] = dict(samples=_digest(samples), loss_type=loss_type,
                                                   micro_batch=args.per_device_train_batch_size,
                                                   accumulation=args.gradient_accumulation_steps)
    return dict(side="trl-split", splits=results)


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
    from splitproof.rl.rollout.hf import canonical_prompt_width
    from splitproof.rl.run import build_parts
    from splitproof.rl.step import generate

    run = build_parts(load_train_config(None, ours_overrides(spec, out / "generation", steps=1)))
    engine = run.generation.engine
    model, uids, n = engine.model, spec["uids"][0], spec["n"]
    prompts = [list(run.prompts.train[u].prompt_ids) for u in uids for _ in range(n)]
    longest, pad = max(map(len, prompts)), run.pad_token_id
    canonical = max(canonical_prompt_width(len(p), engine.pad_multiple) for p in prompts)

    def left_padded(width: int):
        return (torch.tensor([[pad] * (width - len(p)) + p for p in prompts]),
                torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts]))

    hf_config = GenerationConfig(max_new_tokens=spec["max_response_length"], do_sample=True,
                                 temperature=spec["temperature"], top_k=0, top_p=1.0, pad_token_id=pad,
                                 eos_token_id=list(engine.eos_token_ids))
    short_ids, short_mask = left_padded(longest)
    wide_ids, wide_mask = left_padded(canonical)
    chunk = engine.max_num_seqs

    @torch.no_grad()
    def prefill(ids, mask):
        model.eval()
        for start in range(0, len(ids), chunk):
            m = mask[start:start + chunk]
            model(input_ids=ids[start:start + chunk], attention_mask=m, position_ids=(m.cumsum(-1) - 1).clamp(min=0),
                  use_cache=True, logits_to_keep=1)

    @torch.no_grad()
    def hf_generate():
        model.eval()
        model.generate(input_ids=short_ids, attention_mask=short_mask, generation_config=hf_config)

    medians = _interleaved_cpu({
        "ours": lambda: generate(engine, run.prompts.train, uids, 1, run.generation.sampling, run.collective),
        "hf_generate": hf_generate,
        "prefill_canonical": lambda: prefill(wide_ids, wide_mask),
        "prefill_longest": lambda: prefill(short_ids, short_mask),
    }, repeats=spec["generation_repeats"])
    return dict(side="ours-generation", seconds=medians, canonical_width=canonical, longest=longest,
                samples=len(prompts), chunk=chunk)


SIDES = {"ours": run_ours, "trl": run_trl, "ours-split": run_ours_split, "trl-split": run_trl_split,
         "ours-generation": run_ours_generation}


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
