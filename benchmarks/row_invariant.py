"""Cost of the fixed-row block products (``splitproof.engine.row_invariant``) in the no-grad log-prob pass:
``compute_log_probs`` as shipped against the same pass with the plain products, interleaved in every
repeat, on the tiny test model and on a small one, float64 and float32. Prints a markdown table.

    python benchmarks/row_invariant.py [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import splitproof.engine.logprobs as logprobs  # noqa: E402
from splitproof import RolloutBatch  # noqa: E402
from splitproof.hf_models import tiny_causal_lm  # noqa: E402

MODELS = {"tiny (h 32, 2 layers, V 64)": dict(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                              intermediate_size=64, vocab_size=64),
          "small (h 256, 4 layers, V 4096)": dict(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                                                  intermediate_size=704, vocab_size=4096)}


def rollout_batch(n: int, vocab: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)

    def draw(lo: int, hi: int) -> list[int]:
        return torch.randint(3, vocab, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()

    prompts, responses = [draw(16, 64) for _ in range(n)], [draw(8, 48) for _ in range(n)]
    return RolloutBatch.from_sequences(prompt_ids=prompts, response_ids=responses,
                                       old_log_probs=[[0.0] * len(r) for r in responses], advantages=[0.0] * n)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    shipped = logprobs.row_invariant
    plain = lambda model: contextlib.nullcontext(model)  # noqa: E731
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads, {args.repeats} interleaved repeats (median)\n")
    print("| model | dtype | layout | plain | fixed-row blocks | ratio (median of paired) |")
    print("|---|---|---|---|---|---|")
    for name, shape in MODELS.items():
        for dtype in (torch.float64, torch.float32):
            model = tiny_causal_lm("llama", dtype=dtype, **shape).eval()
            batch = rollout_batch(16, shape["vocab_size"])
            for layout in (dict(micro_batch_size=8), dict(micro_batch_size=1)):
                def run(model=model, batch=batch, layout=layout):
                    return logprobs.compute_log_probs(model, batch, **layout)

                times = {"plain": [], "blocks": []}
                for repeat in range(args.repeats + 1):
                    for variant, context in (("plain", plain), ("blocks", shipped)):
                        logprobs.row_invariant = context
                        t = timed(run)
                        if repeat:  # the first round warms up
                            times[variant].append(t)
                logprobs.row_invariant = shipped
                ratio = statistics.median(b / p for b, p in zip(times["blocks"], times["plain"]))
                print(f"| {name} | {str(dtype)[6:]} | {layout} | {statistics.median(times['plain']) * 1e3:.1f} ms "
                      f"| {statistics.median(times['blocks']) * 1e3:.1f} ms | {ratio:.2f} |")


if __name__ == "__main__":
    main()
