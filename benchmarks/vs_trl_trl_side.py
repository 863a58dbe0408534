"""TRL's side of `benchmarks/vs_trl.py`: `GRPOTrainer` on the built-in model with the spec's data order,
sampling and optimizer settings, its methods timed stage by stage; the split side's updates. TRL is imported
only inside these functions, so the module loads in any environment that has splitproof."""

from __future__ import annotations

from pathlib import Path

from stage_clock import Clock, peak_rss_mib, rss_mib
from vs_trl_common import SPLIT_OPTIMIZER, TASK_TRAIN, chat_rows, delta_of, digest


def trl_args(
    spec: dict,
    out: Path,
    *,
    loss_type: str | None = None,
    micro_split: int | None = None,
    max_steps: int | None = None,
    optimizer: str | None = None,
    grad_clip: float | None = None,
):
    """`GRPOConfig` for the spec: one generation batch per RL step, ``mini_batch_prompts × n`` samples per
    optimizer step, accumulated over ``micro_split`` micro-steps."""
    from trl import GRPOConfig

    n, mini, split = spec["n"], spec["mini_batch_prompts"], micro_split or spec["micro_split"]
    updates_per_step = spec["prompts_per_step"] // mini
    return GRPOConfig(
        output_dir=str(out / "trl"),
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        seed=spec["seed"],
        data_seed=spec["seed"],
        shuffle_dataset=False,
        dataloader_num_workers=0,
        per_device_train_batch_size=mini * n // split,
        gradient_accumulation_steps=split,
        steps_per_generation=split * updates_per_step,
        num_generations=n,
        num_iterations=1,
        max_completion_length=spec["max_response_length"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        loss_type=loss_type or spec["trl_loss_type"],
        scale_rewards=spec["scale_rewards"],
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.2,
        learning_rate=spec["lr"],
        adam_beta1=spec["betas"][0],
        adam_beta2=spec["betas"][1],
        adam_epsilon=1e-8,
        weight_decay=spec["weight_decay"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim=optimizer or "adamw_torch",
        max_grad_norm=spec["grad_clip"] if grad_clip is None else grad_clip,
        max_steps=max_steps or spec["steps"] * updates_per_step,
        report_to=[],
        logging_steps=10**9,
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
    )


def trl_dataset(spec: dict):
    """The prompts in the order our sampler serves them: step after step, each step's uids in order."""
    from datasets import Dataset

    from splitproof.rl.data.tasks import task_rows

    rows = chat_rows() if spec.get("model") else task_rows(TASK_TRAIN)
    return Dataset.from_list(
        [
            {"prompt": rows[u]["prompt"], "ground_truth": rows[u]["reward_model"]["ground_truth"]}
            for uids in spec["uids"]
            for u in uids
        ]
    )


def addition_reward(prompts, completions, ground_truth, **kwargs):
    """The built-in task's rule (exact match), TRL's reward-function signature."""
    from splitproof.rl.data.tasks import score

    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]  # chat: the assistant message
    return [score(t, g) for t, g in zip(texts, ground_truth)]


def timed_trainer_class(clock: Clock, per_step: dict, record_samples: list | None):
    """`GRPOTrainer` with its stage methods timed on ``clock``: generation, reward, the no-grad log-prob pass,
    the training micro-steps without their input preparation, gradient clipping."""
    import torch
    from trl import GRPOTrainer

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

    return Timed


def trl_trainer(
    spec: dict, out: Path, clock: Clock, args, *, record_samples: list | None = None, per_step: dict | None = None
):
    """A `GRPOTrainer` on the built-in model (or ``spec["model"]``) whose methods report their time to
    ``clock`` (and, per RL step, the tokens generated on and the mean training reward to ``per_step``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from splitproof.builtin import charlm_directory

    per_step = {"tokens": [], "train_score": []} if per_step is None else per_step
    trainer_class = timed_trainer_class(clock, per_step, record_samples)

    class OptimizerStep(TrainerCallback):
        started = None

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.started = clock.now()

        def on_optimizer_step(self, args, state, control, **kwargs):
            w1, c1 = clock.now()
            clock.add("update", w1 - self.started[0], c1 - self.started[1])

        def on_train_end(self, args, state, control, **kwargs):
            clock.finish()

    directory = spec.get("model") or charlm_directory()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left", local_files_only=True)
    return trainer_class(
        model=model,
        reward_funcs=addition_reward,
        args=args,
        train_dataset=trl_dataset(spec),
        processing_class=tokenizer,
        callbacks=[OptimizerStep()],
        optimizers=(same_optimizer(model, spec, args), None),
    )


def same_optimizer(model, spec: dict, args):
    """Our optimizer, built by our code: transformers' own would exempt biases and norm weights from weight
    decay, which ours does not."""
    from types import SimpleNamespace

    from splitproof.rl.models.optim import make_optimizer

    name = "SGD" if args.optim == "sgd" else "AdamW"
    return make_optimizer(
        model, SimpleNamespace(optimizer=name, lr=spec["lr"], betas=spec["betas"], weight_decay=spec["weight_decay"])
    )


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
    return dict(
        side="trl",
        steps=steps,
        clock=clock.report(steps),
        tokens=per_step["tokens"],
        train_score=per_step["train_score"],
        rss_loaded=rss_loaded,
        peak_loaded=peak_loaded,
        peak=peak,
        threads=torch.get_num_threads(),
        trl_version=trl.__version__,
        optimizer_steps=trainer.state.global_step,
    )


def run_trl_split(spec: dict, out: Path) -> dict:
    """TRL: one optimizer step on one generation batch with ``SPLIT_OPTIMIZER``, for each loss type at each
    gradient-accumulation split (``steps_per_generation`` = the split, so the generation batch is the
    optimizer's batch and no old log-prob pass runs)."""
    import torch

    split_spec = dict(
        spec, mini_batch_prompts=spec["prompts_per_step"], uids=spec["uids"][:1], steps=1, **SPLIT_OPTIMIZER
    )
    results = {}
    for loss_type in spec["trl_split_losses"]:
        for split in spec["splits"]:
            clock, samples = Clock(), []
            args = trl_args(
                split_spec,
                out / f"trl_{loss_type}{split}",
                loss_type=loss_type,
                micro_split=split,
                max_steps=1,
                optimizer="sgd",
                grad_clip=0.0,
            )
            trainer = trl_trainer(split_spec, out, clock, args, record_samples=samples)
            start = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
            trainer.train()
            delta = delta_of(trainer.model.state_dict(), start)
            torch.save(delta, out / f"trl_split_{loss_type}{split}.pt")
            results[f"{loss_type}:{split}"] = dict(
                samples=digest(samples),
                loss_type=loss_type,
                micro_batch=args.per_device_train_batch_size,
                accumulation=args.gradient_accumulation_steps,
            )
    return dict(side="trl-split", splits=results)
