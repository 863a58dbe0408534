"""LoRA against full fine-tuning on the same work: peak memory (RSS), step time, and where LoRA's memory goes.

Each (variant, work) cell runs in a fresh process, so its peak RSS is its own: load the model, build the
AdamW optimizer over what trains (every weight, or the adapter alone), run one warm-up policy update and
``--repeats`` timed ones (``update_policy``: one minibatch, KL loss on, the model in training mode as
``splitproof train`` runs it). The work is swept over the microbatch size and activation checkpointing,
the same for both variants. Reported per cell: the peak RSS (``ru_maxrss``), the median step time (wall
and process CPU), and where the memory goes — the RSS after the imports, after the model's weights are
loaded and touched (one no-grad pass), and the largest set of tensors autograd saves for the backward of
one microbatch (activations; counted once per storage, parameters excluded; the part with a vocabulary
dimension, the logits' share, apart). For LoRA, the share of the step spent inside the adapter's A and B
layers, forward and backward (module hooks' wall time summed / step time).

    python benchmarks/lora.py [--model DIR] [--rank R] [--quick] [--threads N] [--docs PATH | --no-docs]

``--model`` defaults to /work/smollm2 if present (SmolLM2-135M-Instruct as a Hugging Face directory,
see scripts/smollm2_to_hf.py), else the benchmarks' tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl

NAME = "lora"
GOAL_RSS = 0.5  # LoRA's peak RSS / full fine-tuning's
DEFAULT_MODEL = "/work/smollm2"
WORK = dict(sequences=8, prompt_length=32, response_length=32)
WORK_QUICK = dict(sequences=4, prompt_length=6, response_length=6)
CELLS = ((1, False), (2, False), (4, False), (4, True))  # (microbatch size, activation checkpointing)
CELLS_QUICK = ((2, False),)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class AdapterClock:
    """Wall time inside every LoRA A/B layer, forward (pre-hook → hook) and backward (pre-hook → hook)."""

    def __init__(self, model):
        self.seconds = 0.0
        self._start: dict[int, float] = {}
        for name, module in model.named_modules():
            if name.endswith((".lora_A.default", ".lora_B.default")):
                module.register_forward_pre_hook(self._begin)
                module.register_forward_hook(self._end)
                module.register_full_backward_pre_hook(self._begin)
                module.register_full_backward_hook(self._end)

    def _begin(self, module, *args):
        self._start[id(module)] = time.perf_counter()

    def _end(self, module, *args):
        self.seconds += time.perf_counter() - self._start.pop(id(module))


class SavedActivations:
    """The bytes autograd saves for the backward of one microbatch, the largest microbatch's: each storage
    counted once, parameters excluded; ``largest[1]`` is the part whose last dimension is the vocabulary
    (the logits and what the log-softmax keeps)."""

    def __init__(self, model, vocab: int):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.vocab = vocab
        self.largest = (0, 0)
        self._seen: dict[int, tuple[int, bool]] = {}
        model.register_forward_pre_hook(lambda *args: self.close())  # a forward starts a microbatch

    def close(self) -> None:
        total = sum(n for n, _ in self._seen.values())
        if total > self.largest[0]:
            self.largest = (total, sum(n for n, vocab in self._seen.values() if vocab))
        self._seen = {}

    def _pack(self, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self._seen.setdefault(storage.data_ptr(), (storage.nbytes(), t.dim() > 0 and t.shape[-1] == self.vocab))
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)


def _state_mb(model, optimizer) -> float:
    """Gradients and optimizer state held between steps, MB (tensor sizes)."""
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    return (grads + state) / 2**20


def child(
    variant: str,
    model_dir: str | None,
    rank: int,
    repeats: int,
    quick: bool,
    threads: int,
    micro: int,
    checkpointing: bool,
) -> dict:
    """One (variant, work) cell in this process: its figures as a dict."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    from splitproof import LossConfig
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine import UpdateConfig, update_policy
    from splitproof.hf_models import load_causal_lm, tiny_causal_lm, vocab_size_of
    from splitproof.lora import LoraSettings, apply_lora, trainable_parameters

    rss_imports = _rss_mb()
    if model_dir:
        model = load_causal_lm(model_dir, dtype=torch.float32)
    else:
        model = tiny_causal_lm("llama", **bm.MODEL_QUICK, dtype=torch.float32)
    if checkpointing:  # before the adapter, as splitproof train does
        model.activation_checkpointing_enable()
    clock = None
    if variant == "lora":
        model = apply_lora(model, LoraSettings(lora_rank=rank, lora_alpha=2 * rank), seed=0)
        clock = AdapterClock(model)
    work = WORK_QUICK if quick else WORK
    batch = synthetic_rollout(model, work["sequences"], work["prompt_length"], work["response_length"], seed=1)
    rss_loaded = _rss_mb()  # the weights are touched by the rollout's no-grad pass
    model.train()  # as splitproof train runs the update (activation checkpointing acts only in training mode)
    saved = SavedActivations(model, vocab_size_of(model))
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-5)
    config = UpdateConfig(
        loss=LossConfig(use_kl_loss=True), ppo_mini_batch_size=work["sequences"], ppo_micro_batch_size_per_gpu=micro
    )
    times, cpu, shares = [], [], []
    for i in range(1 + repeats):
        if clock is not None:
            clock.seconds = 0.0
        start, start_cpu = time.perf_counter(), time.process_time()
        if i == 0:  # the warm-up also measures what the backward keeps
            with saved.hooks():
                update_policy(model, optimizer, batch, config)
            saved.close()
            continue
        update_policy(model, optimizer, batch, config)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        if clock is not None:
            shares.append(clock.seconds / times[-1])
    return {
        "variant": variant,
        "micro": micro,
        "checkpointing": checkpointing,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "imports_rss_mb": rss_imports,
        "loaded_rss_mb": rss_loaded,
        "weights_mb": sum(p.nbytes for p in model.parameters()) / 2**20,
        "state_mb": _state_mb(model, optimizer),
        "saved_mb": saved.largest[0] / 2**20,
        "saved_vocab_mb": saved.largest[1] / 2**20,
        "step_s": bl.median(times),
        "step_cpu_s": bl.median(cpu),
        "steps": times,
        "trainable": sum(p.numel() for p in trainable_parameters(model)),
        "parameters": sum(p.numel() for p in model.parameters()),
        "adapter_share": bl.median(shares) if shares else None,
    }


def run(env: bl.Env) -> dict:
    args = env.args
    model_dir = args.model if args.model else (DEFAULT_MODEL if os.path.isdir(DEFAULT_MODEL) and not env.quick else "")
    out = {
        "model": model_dir or "tiny llama (benchmarks' quick model)",
        "rank": args.rank,
        "work": WORK_QUICK if env.quick else WORK,
        "cells": [],
    }
    for micro, checkpointing in CELLS_QUICK if env.quick else CELLS:
        cell = {"micro": micro, "checkpointing": checkpointing}
        for variant in ("full", "lora"):
            command = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                variant,
                "--model",
                model_dir,
                "--rank",
                str(args.rank),
                "--repeats",
                str(env.repeats),
                "--threads",
                str(env.threads),
                "--micro",
                str(micro),
            ] + (["--checkpointing"] if checkpointing else [])
            if env.quick:
                command.append("--quick")
            bl.log(f"[{NAME}] {variant}, microbatch {micro}{', checkpointing' if checkpointing else ''} ...")
            done = subprocess.run(
                command, capture_output=True, text=True, check=True, env=dict(os.environ, PYTHONPATH=bl.REPO.as_posix())
            )
            cell[variant] = json.loads(done.stdout.strip().splitlines()[-1])
        cell["rss_ratio"] = cell["lora"]["peak_rss_mb"] / cell["full"]["peak_rss_mb"]
        cell["time_ratio"] = cell["lora"]["step_cpu_s"] / cell["full"]["step_cpu_s"]
        out["cells"].append(cell)
    out["best_rss_ratio"] = min(c["rss_ratio"] for c in out["cells"])
    return out


def _mb(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def _work_name(cell: dict) -> str:
    return f"{cell['micro']}" + (" + checkpointing" if cell["checkpointing"] else "")


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    w, cells = result["work"], result["cells"]
    ratios = bl.table(
        [
            "microbatch",
            "full: peak RSS (MB)",
            "LoRA: peak RSS (MB)",
            "LoRA / full",
            "full: step CPU (s)",
            "LoRA: step CPU (s)",
            "LoRA / full (CPU)",
            "adapter share of LoRA's step",
        ],
        [
            [
                _work_name(c),
                f"{c['full']['peak_rss_mb']:.0f}",
                f"{c['lora']['peak_rss_mb']:.0f}",
                f"{c['rss_ratio']:.2f}",
                f"{c['full']['step_cpu_s']:.2f}",
                f"{c['lora']['step_cpu_s']:.2f}",
                f"{c['time_ratio']:.2f}",
                f"{100 * c['lora']['adapter_share']:.1f} %",
            ]
            for c in cells
        ],
    )
    where = []
    for c in cells:
        for name in ("full", "lora"):
            v = c[name]
            saved = "—" if c["checkpointing"] else f"{_mb(v['saved_mb'])} ({_mb(v['saved_vocab_mb'])})"
            where.append(
                [
                    _work_name(c),
                    name,
                    f"{v['imports_rss_mb']:.0f}",
                    f"{v['loaded_rss_mb'] - v['imports_rss_mb']:.0f} ({_mb(v['weights_mb'])})",
                    _mb(v["state_mb"]),
                    saved,
                    f"{v['peak_rss_mb'] - v['loaded_rss_mb']:.0f}",
                    f"{v['peak_rss_mb']:.0f}",
                ]
            )
    where_table = bl.table(
        [
            "microbatch",
            "variant",
            "RSS after imports",
            "+ model loaded (its weights)",
            "grads + AdamW state",
            "saved for backward, one microbatch (logits' part)",
            "peak − loaded",
            "peak RSS",
        ],
        where,
    )
    full, lora = cells[0]["full"], cells[0]["lora"]
    body = [
        f"Model: {result['model']}, float32, {full['parameters']:,} parameters; LoRA rank {result['rank']} "
        f"(alpha {2 * result['rank']}) on every linear layer, {lora['trainable']:,} trainable. Work: one policy "
        f"update of {w['sequences']} sequences (prompts ≤ {w['prompt_length']}, responses ≤ "
        f"{w['response_length']} tokens), KL loss on, AdamW, the microbatch size and activation checkpointing "
        f"as in each row (the same for both variants); {env.repeats} timed step(s) after a warm-up, each cell "
        f"in a fresh process.",
        ratios,
        f"Peak RSS, LoRA / full, at the smallest: {bl.verdict(result['best_rss_ratio'], GOAL_RSS)}.",
        "Where the memory goes (MB; RSS figures are the process's, the others tensor sizes; saved tensors "
        "not counted under checkpointing):",
        where_table,
    ]
    return bl.section(NAME, "LoRA against full fine-tuning", command, env, load_before, body)


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=2, quick_repeats=1)
    p.add_argument("--model", default=None, help="a local Hugging Face directory (default: /work/smollm2 if present)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--child", default=None, choices=("full", "lora"), help=argparse.SUPPRESS)
    p.add_argument("--micro", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        figures = child(
            args.child,
            args.model or None,
            args.rank,
            args.repeats,
            args.quick,
            args.threads or 1,
            args.micro,
            args.checkpointing,
        )
        print(json.dumps(figures))
        return figures
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
