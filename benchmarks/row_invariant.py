"""Cost of the row-invariant products (``splitproof.engine.row_invariant``) in the no-grad passes, side by side.

Three variants of every pass, interleaved in every repeat: ``plain`` (the model's own ``nn.Linear``), ``blocks``
(every product as batched 16-row blocks, at least two: the design before ``fixed_tile_linear``) and ``shipped``
(``row_invariant`` as it is now). Passes: the log-prob pass (``compute_log_probs``: old/reference log-probs and
the KL-Cov prepass run it), the critic's values (``compute_values``), and generation — a prefill of 32 prompts
(logits of the last position only, as ``HFRollout`` asks) and decode steps at 32 live sequences. Models: the
built-in one (``splitproof/builtin/charlm``) and a SmolLM2-135M-shaped Llama with random weights (width 576,
30 layers, 9 heads / 3 KV heads, MLP 1536, vocabulary 49152, tied embeddings). CPU time of the calling thread
(``time.thread_time``) with one torch thread, so other processes on the machine do not count; medians and the
spread (min–max) of the paired ratios, and the ratio of the least times. Each pass also checks that ``shipped``
gives the bits of ``blocks``.

    python benchmarks/row_invariant.py [--repeats 3] [--models builtin,smollm2] [--dtypes float32,float64]
    python benchmarks/row_invariant.py --probe   # which row counts give every row the bits of the 16-row blocks
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import splitproof.engine.logprobs as logprobs
import splitproof.engine.values as values
from splitproof import RolloutBatch
from splitproof.builtin import charlm_directory
from splitproof.engine.row_invariant import aligned_width, blocked_linear, row_invariant
from splitproof.hf_models import load_causal_lm, tiny_causal_lm
from splitproof.value_model import value_model_from_pretrained

SMOLLM2 = dict(
    hidden_size=576,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# (sequences, prompt tokens lo-hi, response tokens lo-hi) of the log-prob / values pass; prefill prompt lengths
WORK = {
    "builtin": dict(seqs=32, prompt=(16, 64), response=(8, 48), prefill=(16, 48), decode_steps=8, repeats=21),
    "smollm2": dict(seqs=4, prompt=(8, 24), response=(8, 24), prefill=(4, 12), decode_steps=4, repeats=3),
}


@contextlib.contextmanager
def plain(model):
    yield model


@contextlib.contextmanager
def blocks(model):
    """Every ``nn.Linear`` as ``blocked_linear`` (16-row blocks, at least two): the previous design."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" not in vars(m)]
    for m in linears:
        m.forward = (lambda mod: lambda x: blocked_linear(x, mod.weight, mod.bias))(m)
    try:
        yield model
    finally:
        for m in linears:
            del m.forward


VARIANTS = {"plain": plain, "blocks": blocks, "shipped": row_invariant}


@contextlib.contextmanager
def as_variant(module, variant: str):
    """``module``'s pass with the variant's products; ``plain`` on the micro-batch's own width (the shipped
    pass, and ``blocks`` beside it, widen it to ``aligned_width``, so that the products need no filler rows)."""
    module.row_invariant = VARIANTS[variant]
    if variant == "plain":
        logprobs.aligned_width = lambda rows, width: width
    try:
        yield
    finally:
        module.row_invariant, logprobs.aligned_width = row_invariant, aligned_width


def build(name: str, dtype: torch.dtype):
    if name == "builtin":
        return load_causal_lm(charlm_directory(), dtype=dtype).eval()
    return tiny_causal_lm("llama", dtype=dtype, seed=0, **SMOLLM2).eval()


def rollout_batch(n: int, vocab: int, prompt: tuple, response: tuple, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, responses = [draw(*prompt) for _ in range(n)], [draw(*response) for _ in range(n)]
    return RolloutBatch.from_sequences(
        prompt_ids=prompts,
        response_ids=responses,
        old_log_probs=[[0.0] * len(r) for r in responses],
        advantages=[0.0] * n,
    )


def generation_inputs(vocab: int, lengths: tuple, rows: int = 32, seed: int = 1):
    """Left-padded prompts of ``rows`` sequences, as ``HFRollout`` lays them out."""
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(lengths[0], lengths[1], (rows,), generator=g)
    width = int(n.max())
    ids = torch.randint(3, vocab, (rows, width), generator=g)
    mask = (torch.arange(width) >= width - n.unsqueeze(1)).long()
    return ids * mask, mask


def generate(model, ids, mask, steps: int):
    """Prefill (last position's logits) then ``steps`` greedy decode steps; (prefill s, [step s], logits)."""
    start = time.thread_time()
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    prefill, step_times, kept = time.thread_time() - start, [], [out.logits[:, -1]]
    lengths = mask.sum(-1)
    for t in range(steps):
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        start = time.thread_time()
        out = model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=(lengths + t).unsqueeze(1),
            use_cache=True,
            past_key_values=out.past_key_values,
        )
        step_times.append(time.thread_time() - start)
        kept.append(out.logits[:, -1])
    return prefill, step_times, torch.stack(kept)


def passes(name: str, model, critic, work: dict):
    """{pass: fn(variant) -> (seconds, result)}: each runs one pass with the variant's products."""
    vocab = model.config.vocab_size
    batch = rollout_batch(work["seqs"], vocab, work["prompt"], work["response"])
    ids, mask = generation_inputs(vocab, work["prefill"])

    def timed(fn):
        start = time.thread_time()
        result = fn()
        return time.thread_time() - start, result

    def log_probs(variant, micro_batch_size=work["seqs"] // 2):
        with as_variant(logprobs, variant):
            return timed(lambda: logprobs.compute_log_probs(model, batch, micro_batch_size=micro_batch_size)[0])

    def value_pass(variant):
        with as_variant(values, variant):
            return timed(lambda: values.compute_values(critic, batch, micro_batch_size=work["seqs"] // 2))

    def prefill_and_decode(variant):
        with torch.no_grad(), VARIANTS[variant](model):
            prefill, steps, logits = generate(model, ids, mask, work["decode_steps"])
        return (prefill, statistics.median(steps)), logits

    mb = f"{work['seqs']} seqs, micro-batch {work['seqs'] // 2}, {int(batch.attention_mask.sum())} tokens"
    return {
        f"log-probs ({mb})": log_probs,
        "log-probs (micro-batch 1: rows of any count)": lambda variant: log_probs(variant, 1),
        f"values ({mb})": value_pass,
        f"generation (32 seqs, {int(mask.sum())} prompt tokens)": prefill_and_decode,
    }


def best_of(fn, variant: str, inner: int):
    """The least time of ``inner`` back-to-back runs (per part, for generation) and the last run's result."""
    runs = [fn(variant) for _ in range(inner)]
    if isinstance(runs[0][0], tuple):
        return tuple(min(r[0][i] for r in runs) for i in range(len(runs[0][0]))), runs[-1][1]
    return min(r[0] for r in runs), runs[-1][1]


def measure(fn, repeats: int, inner: int = 1) -> tuple[dict, bool]:
    """Interleaved timings {variant: [seconds or (prefill, step)]} (first round warms up) and whether
    ``shipped`` gave the bits of ``blocks``."""
    times, same = {v: [] for v in VARIANTS}, True
    for repeat in range(repeats + 1):
        results = {}
        for variant in VARIANTS:
            t, results[variant] = best_of(fn, variant, inner)
            if repeat:
                times[variant].append(t)
        same = same and torch.equal(results["shipped"], results["blocks"])
    return times, same


def ratio_text(num: list, den: list) -> str:
    r = [a / b for a, b in zip(num, den)]
    return f"{statistics.median(r):.3f} ({min(r):.2f}–{max(r):.2f})"


def report(label: str, times: dict, same: bool) -> list[str]:
    """Table lines: one per pass, two for generation (its prefill and its median decode step)."""
    generation = isinstance(times["plain"][0], tuple)
    parts = (
        [(0, label.replace("generation", "prefill")), (1, label.replace("generation", "decode step"))]
        if generation
        else [(None, label)]
    )
    lines = []
    for part, what in parts:
        pick = {v: [t if part is None else t[part] for t in ts] for v, ts in times.items()}
        ms = " | ".join(f"{statistics.median(pick[v]) * 1e3:.1f} ms" for v in VARIANTS)
        least = min(pick["shipped"]) / min(pick["plain"])
        lines.append(
            f"{what} | {ms} | {ratio_text(pick['blocks'], pick['plain'])} | "
            f"{ratio_text(pick['shipped'], pick['plain'])} | {least:.3f} | {'yes' if same else 'NO'} |"
        )
    return lines


def probe(threads: int) -> None:
    """Row counts M (1–160, then some up to 4096) whose plain product moves some row's bits against the
    16-row blocks, per shape of the two models (K inputs → N outputs)."""
    shapes = [
        (576, 576),
        (576, 192),
        (576, 1536),
        (1536, 576),
        (576, 49152),
        (64, 64),
        (64, 176),
        (176, 64),
        (64, 99),
        (64, 1),
        (576, 1),
    ]
    counts = list(range(1, 161)) + [252, 256, 512, 1056, 1400, 2048, 2052, 4096]
    for dtype in (torch.float32, torch.float64):
        for k, n in shapes:
            ms = [m for m in counts if n * k * m < 6e9 or m in (256, 1056)]
            g = torch.Generator().manual_seed(0)
            x, w = torch.randn(max(ms), k, generator=g, dtype=dtype), torch.randn(n, k, generator=g, dtype=dtype)
            ref = blocked_linear(x, w)
            moved = [m for m in ms if not torch.equal(F.linear(x[:m], w), ref[:m])]
            print(
                f"{str(dtype)[6:]} K {k} → N {n}: moved at {len(moved)} of {len(ms)} row counts; multiples of 4 "
                f"from 8: {[m for m in moved if m % 4 == 0 and m >= 8][:12]}; below 8: {[m for m in moved if m < 8]}",
                flush=True,
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=None, help="default: 21 for builtin, 3 for smollm2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--inner", type=int, default=1, help="each timing: the least of this many back-to-back runs")
    ap.add_argument("--models", default="builtin,smollm2")
    ap.add_argument("--dtypes", default="float32,float64")
    ap.add_argument("--passes", default="", help="only passes whose name contains this (e.g. generation)")
    ap.add_argument("--probe", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    env = {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR") if k in os.environ}
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()} {env or ''}, "
        f"{args.threads} thread(s), load average {os.getloadavg()[0]:.1f}, "
        f"{args.repeats or 'per-model'} interleaved repeats, each the least of {args.inner} runs\n"
    )
    if args.probe:
        return probe(args.threads)
    print(
        "| model | dtype | pass | plain | 16-row blocks | shipped | blocks / plain | shipped / plain | "
        "least shipped / least plain | shipped = blocks bits |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            model = build(name, dtype)
            critic = value_model_from_pretrained(model, seed=4)
            for label, fn in passes(name, model, critic, WORK[name]).items():
                if args.passes not in label:
                    continue
                times, same = measure(fn, args.repeats or WORK[name]["repeats"], args.inner)
                for line in report(f"| {name} | {str(dtype)[6:]} | {label}", times, same):
                    print(line, flush=True)
            del model, critic
    print(f"\nload average after: {' / '.join(f'{a:.1f}' for a in os.getloadavg())}")


if __name__ == "__main__":
    main()
