"""The ``hf`` rollout's generation against the loop before its cost rules, side by side, and where a
decode step's time goes.

Two variants of ``HFRollout.generate`` on the same requests, interleaved (the starting one alternates):
``shipped`` and ``before`` — every request prefilled on its own row and transformers' cache grown by
``torch.cat`` (``hf.prefill`` replaced by the old prefill). Both must give the same bits (checked). Then
one generation of ``shipped`` timed in parts: the prefill, the decode forwards, the sampling, and the
decode steps' matrix products at the rate one core reaches on them (the floor: their FLOPs over that rate).

Models: SmolLM2-135M-Instruct (``--smollm2 DIR``: 8 chat prompts × 4 samples × 32 new tokens) and the
built-in model (128 addition prompts × 8 samples × 8 tokens). CPU time of the process, one torch thread.

    python benchmarks/rollout_decode.py [--smollm2 /work/smollm2] [--repeats 5] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from splitproof.engine.forward_output import cache_of
from splitproof.rl.rollout import hf
from splitproof.rl.rollout.hf import HFRollout, SamplingParams, requests_for
from splitproof.rl.rollout.prefill import canonical_prompt_width

QUESTIONS = [
    "What is 17 times 23?",
    "Name three primary colours.",
    "Write a haiku about rain.",
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "How many legs does a spider have?",
    "Give me a synonym for happy.",
    "What is 2 to the power 10?",
]


def before_prefill(model, prompts, kept, rows, extra, *, pad_multiple, pad_id, device):
    """The loop before: every row prefilled on its own into transformers' growing cache."""
    padded = prompts + [prompts[0]] * (rows - len(prompts))
    width = max(canonical_prompt_width(len(p), pad_multiple) for p in padded)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in padded], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in padded], device=device)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1], cache_of(out), mask


def workload(name: str, smollm2: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "smollm2":
        tok = AutoTokenizer.from_pretrained(smollm2)
        model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=dtype)
        chat = [[{"role": "user", "content": q}] for q in QUESTIONS]
        ids = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False) for c in chat]
        return (
            model,
            tok.eos_token_id,
            tok.pad_token_id,
            list(enumerate(ids)),
            SamplingParams(n=4, max_response_length=32),
        )
    from splitproof.builtin import charlm_directory
    from splitproof.builtin.tokenizer import char_tokenizer

    tok = char_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(charlm_directory(), dtype=dtype)
    r = random.Random(0)
    prompts = [(i, tok.encode(f"{r.randint(0, 999)}+{r.randint(0, 999)}=")) for i in range(128)]
    return model, tok.eos_token_id, tok.pad_token_id, prompts, SamplingParams(n=8, max_response_length=8)


def parts(rollout: HFRollout, requests, params) -> dict:
    """One generation timed in parts (CPU s): prefill, decode forwards, sampling; a second one times the
    decode steps' matrix products alone (and counts their FLOPs)."""
    model_type = type(rollout.model)
    spent = {"prefill": 0.0, "decode forwards": 0.0, "sampling": 0.0, "decode products": 0.0, "flops": 0.0}
    spent["decode forwards (2nd run)"] = 0.0
    forward, sample, prefill, linear = model_type.forward, HFRollout._sample, hf.prefill, torch.nn.functional.linear
    decoding = [False]

    def timed(key, fn, count=lambda *a, **k: True):
        def wrapper(*args, **kwargs):
            start = time.process_time()
            out = fn(*args, **kwargs)
            if count(*args, **kwargs):
                spent[key] += time.process_time() - start
            return out

        return wrapper

    def is_decode(self, *args, input_ids=None, **kwargs):
        decoding[0] = input_ids is not None and input_ids.shape[1] == 1
        return decoding[0]

    def decode_product(x, w, b=None):
        if decoding[0]:
            spent["flops"] += 2 * x.numel() // x.shape[-1] * w.shape[0] * w.shape[1]
        return decoding[0]

    try:
        hf.prefill, HFRollout._sample = timed("prefill", prefill), timed("sampling", sample)
        model_type.forward = timed("decode forwards", forward, is_decode)
        start = time.process_time()
        rollout.generate(requests, params, step=1)
        total = time.process_time() - start
        hf.prefill, HFRollout._sample, model_type.forward = prefill, sample, forward
        model_type.forward = timed("decode forwards (2nd run)", forward, is_decode)  # sets `decoding` only
        torch.nn.functional.linear = timed("decode products", linear, decode_product)
        rollout.generate(requests, params, step=1)
    finally:
        hf.prefill, HFRollout._sample, model_type.forward = prefill, sample, forward
        torch.nn.functional.linear = linear
    return {"total": total, **spent}


def run(name: str, args) -> list[str]:
    dtype = getattr(torch, args.dtype)
    model, eos, pad, prompts, params = workload(name, args.smollm2, dtype)
    requests = requests_for(prompts, params.n)
    rollout = HFRollout(model, eos_token_ids=eos, pad_token_id=pad, max_num_seqs=256)
    shipped = rollout.generate(requests, params, step=1)
    hf.prefill, shipped_prefill = before_prefill, hf.prefill
    try:
        same = [(s.response_ids, s.log_probs) for s in rollout.generate(requests, params, step=1)] == [
            (s.response_ids, s.log_probs) for s in shipped
        ]
    finally:
        hf.prefill = shipped_prefill
    times = {"shipped": [], "before": []}
    ratios = []
    for i in range(args.repeats):
        t = {}
        for variant in ("shipped", "before") if i % 2 == 0 else ("before", "shipped"):
            hf.prefill = shipped_prefill if variant == "shipped" else before_prefill
            start = time.process_time()
            rollout.generate(requests, params, step=1)
            t[variant] = time.process_time() - start
            times[variant].append(t[variant])
        hf.prefill = shipped_prefill
        ratios.append(t["shipped"] / t["before"])
    tokens = sum(len(s.response_ids) for s in shipped)
    p = parts(rollout, requests, params)
    rate = p["flops"] / p["decode products"] / 1e9 if p["decode products"] else float("nan")
    return [
        f"| {name} | {args.dtype} | {len(requests)} × ≤ {params.max_response_length} ({tokens} tokens) "
        f"| {statistics.median(times['before']):.3f} | {statistics.median(times['shipped']):.3f} "
        f"| {statistics.median(ratios):.3f} ({min(ratios):.2f}–{max(ratios):.2f}) | {'yes' if same else 'NO'} "
        f"| {p['total']:.3f} | {p['prefill']:.3f} | {p['decode forwards']:.3f} | {p['sampling']:.3f} "
        f"| {p['decode products']:.3f} ({rate:.0f} GFLOP/s) |"
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smollm2", default="/work/smollm2")
    ap.add_argument("--models", default="builtin,smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()
    rows = []
    for name in args.models.split(","):
        rows += run(name, args)
    print(
        f"torch {torch.__version__}, 1 thread, {args.repeats} interleaved repeats, load average {load[0]:.1f} → "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| model | dtype | requests × tokens | before s | shipped s | shipped / before | same bits | "
        "parts run s | prefill s | decode forwards s | sampling s | decode products s (rate) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
