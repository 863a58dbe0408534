"""LoRA against full fine-tuning on the same work: peak memory (RSS), step time, and the adapter's share.

Each variant runs in a fresh process (so its peak RSS is its own): load the model, build the AdamW
optimizer over what trains (every weight, or the adapter alone), run one warm-up policy update and
``--repeats`` timed ones (``update_policy``: one minibatch, two microbatches, KL loss on). Reported per
variant: the process's peak RSS (``ru_maxrss``), its RSS after loading the model, the median step time,
the trainable parameters, and — for LoRA — the share of the step spent inside the adapter's A and B
layers, forward and backward (module hooks' wall time summed / step time).

    python benchmarks/lora.py [--model DIR] [--rank R] [--quick] [--threads N] [--docs PATH | --no-docs]

``--model`` defaults to /work/smollm2 if present (SmolLM2-135M-Instruct as a Hugging Face directory,
see scripts/smollm2_to_hf.py), else the benchmarks' tiny model.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import benchlib as bl  # noqa: E402

NAME = "lora"
GOAL_RSS = 0.5  # LoRA's peak RSS / full fine-tuning's
DEFAULT_MODEL = "/work/smollm2"
WORK = dict(sequences=8, prompt_length=32, response_length=32, micro=4)
WORK_QUICK = dict(sequences=4, prompt_length=6, response_length=6, micro=2)


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


def child(variant: str, model_dir: str | None, rank: int, repeats: int, quick: bool, threads: int) -> dict:
    """One variant in this process: its figures as a dict."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(threads)
    from splitproof import LossConfig
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine import UpdateConfig, update_policy
    from splitproof.hf_models import load_causal_lm, tiny_causal_lm
    from splitproof.lora import LoraSettings, apply_lora, trainable_parameters

    if model_dir:
        model = load_causal_lm(model_dir, dtype=torch.float32)
    else:
        model = tiny_causal_lm("llama", **{k: v for k, v in bl.MODEL_QUICK.items()}, dtype=torch.float32)
    rss_loaded = _rss_mb()
    model.train(False)
    clock = None
    if variant == "lora":
        model = apply_lora(model, LoraSettings(lora_rank=rank, lora_alpha=2 * rank), seed=0)
        clock = AdapterClock(model)
    work = WORK_QUICK if quick else WORK
    batch = synthetic_rollout(model, work["sequences"], work["prompt_length"], work["response_length"], seed=1)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-5)
    config = UpdateConfig(loss=LossConfig(use_kl_loss=True), ppo_mini_batch_size=work["sequences"],
                          ppo_micro_batch_size_per_gpu=work["micro"])
    times, shares = [], []
    for i in range(1 + repeats):
        if clock is not None:
            clock.seconds = 0.0
        start = time.perf_counter()
        update_policy(model, optimizer, batch, config)
        elapsed = time.perf_counter() - start
        if i > 0:  # the first is a warm-up
            times.append(elapsed)
            if clock is not None:
                shares.append(clock.seconds / elapsed)
    return {"variant": variant, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "loaded_rss_mb": rss_loaded, "step_s": bl.median(times), "steps": times,
            "trainable": sum(p.numel() for p in trainable_parameters(model)),
            "parameters": sum(p.numel() for p in model.parameters()),
            "adapter_share": bl.median(shares) if shares else None}


def run(env: bl.Env) -> dict:
    args = env.args
    model_dir = args.model if args.model else (DEFAULT_MODEL if os.path.isdir(DEFAULT_MODEL) and not env.quick else "")
    out = {"model": model_dir or "tiny llama (benchmarks' quick model)", "rank": args.rank,
           "work": WORK_QUICK if env.quick else WORK, "variants": {}}
    for variant in ("full", "lora"):
        command = [sys.executable, os.path.abspath(__file__), "--child", variant, "--model", model_dir,
                   "--rank", str(args.rank), "--repeats", str(env.repeats), "--threads", str(env.threads)]
        if env.quick:
            command.append("--quick")
        bl.log(f"[{NAME}] {variant} ...")
        done = subprocess.run(command, capture_output=True, text=True, check=True,
                              env=dict(os.environ, PYTHONPATH=bl.REPO.as_posix()))
        out["variants"][variant] = json.loads(done.stdout.strip().splitlines()[-1])
    full, lora = out["variants"]["full"], out["variants"]["lora"]
    out["rss_ratio"] = lora["peak_rss_mb"] / full["peak_rss_mb"]
    out["time_ratio"] = lora["step_s"] / full["step_s"]
    return out


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    w = result["work"]
    rows = []
    for name, v in result["variants"].items():
        share = f"{100 * v['adapter_share']:.1f} %" if v["adapter_share"] is not None else "—"
        rows.append([name, f"{v['trainable']:,}", f"{v['loaded_rss_mb']:.0f}", f"{v['peak_rss_mb']:.0f}",
                     bl.ms(v["step_s"]), share])
    table = bl.table(["variant", "trainable parameters", "RSS after load (MB)", "peak RSS (MB)", "step (ms, median)",
                      "adapter share"], rows)
    body = [f"Model: {result['model']}, float32; LoRA rank {result['rank']} (alpha {2 * result['rank']}) on every "
            f"linear layer. Work: one policy update of {w['sequences']} sequences (prompts ≤ {w['prompt_length']}, "
            f"responses ≤ {w['response_length']} tokens) in microbatches of {w['micro']}, KL loss on, AdamW; "
            f"{env.repeats} timed step(s) after a warm-up, each variant in a fresh process.", table,
            f"Peak RSS, LoRA / full: {bl.verdict(result['rss_ratio'], GOAL_RSS)}; step time, LoRA / full: "
            f"{result['time_ratio']:.2f}."]
    return bl.section(NAME, "LoRA against full fine-tuning", command, env, load_before, body)


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=2, quick_repeats=1)
    p.add_argument("--model", default=None, help="a local Hugging Face directory (default: /work/smollm2 if present)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument("--child", default=None, choices=("full", "lora"), help=argparse_hidden())
    args = p.parse_args(argv)
    if args.child:
        figures = child(args.child, args.model or None, args.rank, args.repeats, args.quick, args.threads or 1)
        print(json.dumps(figures))
        return figures
    return bl.run_script(NAME, args, argv, run, render)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
