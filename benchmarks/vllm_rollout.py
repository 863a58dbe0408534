"""Generation with ``rollout.name=vllm`` (splitproof's counter-based pick inside vLLM) against the ``hf``
backend and against vLLM with its own sampler, on the same requests, side by side in one run; then what
the vLLM engine's tokens depend on, and the weight sync's cost.

- Requests: ``--prompts`` chat prompts × ``--n`` samples, ``--tokens`` new tokens each, no EOS (every
  request generates exactly ``--tokens`` tokens), temperature 1, float32. Runs alternate (vllm-ours,
  vllm-own, hf) ``--repeats`` times; tokens/s = generated tokens / wall seconds, best and median.
- "vllm, own sampler": the same engine, requests without splitproof's key (the processor leaves them to
  vLLM's sampler), one vLLM seed per request, the sampled token's log-prob returned (as ours are).
- Layout: the engine's samples generated all together against one request at a time (samples whose
  tokens differ; the largest log-prob gap where they agree), and against the ``hf`` backend.
- Weight sync: ``VLLMRollout.sync_weights(force=True)`` (every weight to /dev/shm, ``reload_weights``,
  prefix-cache reset), best of ``--repeats``.

Needs the ``vllm`` extra (its own environment; docs/rollout.md). The machine may be shared: the load
average before and after is printed with the figures.

    VLLM_CPU_OMP_THREADS_BIND=0 python benchmarks/vllm_rollout.py [--model DIR] [--prompts 8] [--n 4]
        [--tokens 32] [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def chat_requests(tokenizer, prompts: int, n: int) -> list:
    questions = [
        "What is 17 + 25?",
        "Name a prime number above 50.",
        "Write one sentence about the sea.",
        "How many legs does a spider have?",
        "Give a synonym of quick.",
        "What is the capital of France?",
        "Count from one to five.",
        "Why is the sky blue? Answer briefly.",
    ]
    out = []
    for uid in range(prompts):
        message = [{"role": "user", "content": questions[uid % len(questions)]}]
        ids = tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.extend((uid, j, ids) for j in range(n))
    return out


def own_sampler(llm, requests, tokens: int):
    """vLLM's own sampler on the same requests (one seed per request), the sampled token's log-prob."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=uid * 1000 + j, logprobs=0)
        for uid, j, _ in requests
    ]
    prompts = [TokensPrompt(prompt_token_ids=ids) for _, _, ids in requests]
    return llm.generate(prompts, sampling_params=params, use_tqdm=False)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def layout_gaps(a, b) -> tuple[int, float]:
    """(samples whose tokens differ, the largest log-prob gap over the samples whose tokens agree)."""
    differ = sum(x.response_ids != y.response_ids for x, y in zip(a, b))
    gaps = [
        abs(p - q) for x, y in zip(a, b) if x.response_ids == y.response_ids for p, q in zip(x.log_probs, y.log_probs)
    ]
    return differ, max(gaps, default=0.0)


def prefix_cache_pair(engine, tokenizer, params) -> tuple[list, list]:
    """Sample 1 of long prompts (past the CPU engine's 128-token cache block) generated right after sample 0
    (its first block is a prefix-cache hit) and after a cache reset (a full prefill)."""
    text = " ".join(["The quick brown fox jumps over the lazy dog near the river bank."] * 24)
    prompts = [(uid, tokenizer(f"{uid}: {text}")["input_ids"]) for uid in range(4)]
    hits, fresh = [], []
    for uid, ids in prompts:
        engine.llm.reset_prefix_cache()
        engine.generate([(uid, 0, ids)], params, step=1)
        hits += engine.generate([(uid, 1, ids)], params, step=1)
        engine.llm.reset_prefix_cache()
        fresh += engine.generate([(uid, 1, ids)], params, step=1)
    return hits, fresh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/smollm2")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import torch
    from transformers import AutoTokenizer

    from splitproof.hf_models import load_causal_lm
    from splitproof.rl.rollout.hf import HFRollout, SamplingParams
    from splitproof.rl.rollout.vllm_engine import VLLMRollout, VLLMSettings

    torch.set_num_threads(args.threads)
    print(f"load average before: {os.getloadavg()}")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = load_causal_lm(args.model, dtype=torch.float32).eval()
    requests = chat_requests(tokenizer, args.prompts, args.n)
    params = SamplingParams(n=args.n, temperature=1.0, max_response_length=args.tokens, seed=7)
    total = len(requests) * args.tokens
    start = time.perf_counter()
    settings = VLLMSettings(model_path=args.model, max_num_seqs=len(requests), max_model_len=512)
    engine = VLLMRollout(model, settings, eos_token_ids=[], pad_token_id=0)
    engine.sync_weights()
    print(f"engine start + first sync: {time.perf_counter() - start:.1f} s")
    hf = HFRollout(model, eos_token_ids=[], pad_token_id=0, max_num_seqs=len(requests))
    runs = {
        "vllm, splitproof's sampling": lambda: engine.generate(requests, params, step=1),
        "vllm, its own sampler": lambda: own_sampler(engine.llm, requests, args.tokens),
        "hf": lambda: hf.generate(requests, params, step=1),
    }
    for fn in runs.values():  # warm-up
        fn()
    seconds = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            seconds[name].append(timed(fn))
    print(f"\n{len(requests)} requests x {args.tokens} new tokens, float32, {args.threads} thread(s)\n")
    print("| backend | tokens/s (best) | tokens/s (median) |\n|---|---|---|")
    for name, values in seconds.items():
        print(f"| {name} | {total / min(values):.1f} | {total / statistics.median(values):.1f} |")
    together = engine.generate(requests, params, step=1)
    alone = [s for r in requests for s in engine.generate([r], params, step=1)]
    differ, gap = layout_gaps(together, alone)
    print(f"\nvllm all together vs one at a time: {differ}/{len(requests)} samples differ; log-prob gap {gap:.2e}")
    differ, gap = layout_gaps(together, hf.generate(requests, params, step=1))
    print(f"vllm vs hf: {differ}/{len(requests)} samples differ in tokens; log-prob gap where equal {gap:.2e}")
    hits, fresh = prefix_cache_pair(engine, tokenizer, params)
    differ, gap = layout_gaps(hits, fresh)
    print(f"prefix-cache hit vs full prefill (prompts of 300+ tokens): {differ}/{len(hits)} differ; gap {gap:.2e}")
    sync = min(timed(lambda: engine.sync_weights(force=True)) for _ in range(args.repeats))
    print(f"weight sync ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M parameters): {sync:.2f} s")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
