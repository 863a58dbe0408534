"""Environment episodes against function-tool episodes and single-turn rollouts: model tokens per second on
the same model, the same requests and (for single-turn, to the rounding) the same number of model tokens.

The built-in model on ``builtin://product`` prompts; every model turn is read as the call ``mul(123,456)``
(the built-in model never learned to call), ``max_assistant_turns`` 3, so each episode has 3 model turns
and 2 tool responses. Variants: single-turn (``HFRollout`` without EOS); the built-in calculator as a
function tool; the same as an environment (one instance per episode, ``reset`` with the row, ``mul`` a
method); each with tools answering at once and sleeping ``--latency`` ms per call on a pool of
``--workers`` threads. An environment's calls of one episode run one after another; different episodes'
calls run on the pool while later chunks of ``max_num_seqs`` episodes generate.

    python benchmarks/environments.py [--prompts 32] [--n 4] [--repeats 3] [--latency 20] [--workers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from multi_turn import sleeping_mul


class SleepingCalculatorEnv:
    """The built-in calculator environment, each call after ``LATENCY_S`` seconds of sleep."""

    LATENCY_S = 0.0

    def reset(self, **row) -> None:
        self.calls = 0

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the left factor
            b: the right factor
        """
        time.sleep(self.LATENCY_S)
        self.calls += 1
        return a * b


def every_turn_calls():
    """The ``simple`` format with every turn read as ``mul(123,456)``, installed for every episode."""
    from splitproof.rl.rollout import tool_format
    from splitproof.rl.rollout.tools import ToolCall

    class EveryTurnCalls(tool_format.SimpleFormat):
        def parse(self, ids):
            return [ToolCall("mul", json.dumps({"a": 123, "b": 456}))], 0

    tool_format.FORMATS["simple"] = EveryTurnCalls


def build(args):
    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.hf_models import load_causal_lm
    from splitproof.rl.data.tasks import task_rows
    from splitproof.rl.environments.session import EnvironmentSet
    from splitproof.rl.environments.trl_factory import load_environments
    from splitproof.rl.rollout.episode import EpisodeRollout, MultiTurnSettings
    from splitproof.rl.rollout.hf import HFRollout, requests_for
    from splitproof.rl.rollout.tools import function_tool

    every_turn_calls()
    tokenizer = char_tokenizer()
    import splitproof

    model = load_causal_lm(Path(splitproof.__file__).parent / "builtin" / "charlm").eval()
    rows = task_rows("builtin://product/train")[: args.prompts]
    ids = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    records = [
        SimpleNamespace(uid=u, prompt=r["prompt"], columns=r, prompt_ids=tuple(i))
        for u, (r, i) in enumerate(zip(rows, ids))
    ]
    requests = requests_for(list(enumerate(ids)), args.n)
    by_uid = {r.uid: r for r in records}
    seqs = max(1, len(requests) // 4)
    settings = MultiTurnSettings(format="simple", max_assistant_turns=3, num_workers=args.workers)

    def hf(eos=True):
        eos_ids = tokenizer.eos_token_id if eos else None
        return HFRollout(model, eos_token_ids=eos_ids, pad_token_id=tokenizer.pad_token_id, max_num_seqs=seqs)

    def function_rollout(latency):
        return EpisodeRollout(hf(), tokenizer, {"mul": function_tool(sleeping_mul(latency), "benchmark")}, settings)

    def environment_rollout(latency):
        SleepingCalculatorEnv.LATENCY_S = latency
        classes = load_environments(f"{__file__}:SleepingCalculatorEnv")
        envs = EnvironmentSet(classes=classes, tokenizer=tokenizer, max_prompt_length=16)
        return EpisodeRollout(hf(), tokenizer, {}, settings, envs)

    return tokenizer, requests, by_uid, hf(eos=False), function_rollout, environment_rollout


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--latency", type=float, default=20.0, help="milliseconds a slow call sleeps")
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args(argv)
    from splitproof.rl.rollout.hf import SamplingParams

    tokenizer, requests, by_uid, single, function_rollout, environment_rollout = build(args)
    params = SamplingParams(n=args.n, max_response_length=48, seed=0)
    records = [by_uid[u] for u, _, _ in requests]
    latency = args.latency / 1000
    variants = {}
    for label, seconds in (("instant", 0.0), (f"{args.latency:g} ms", latency)):
        fn, env = function_rollout(seconds), environment_rollout(seconds)
        variants[f"function tool, {label}"] = lambda fn=fn: fn.generate(requests, params, step=1)
        variants[f"environment, {label}"] = lambda env=env: env.generate(requests, params, step=1, records=records)
    episodes = next(iter(variants.values()))()
    model_tokens = sum(sum(e.token_mask) for e in episodes)
    length = max(1, round(model_tokens / len(requests)))
    single_params = SamplingParams(n=args.n, max_response_length=length, seed=0)
    variants = {"single-turn": lambda: single.generate(requests, single_params, step=1), **variants}
    times = {name: [] for name in variants}
    for _ in range(args.repeats):  # interleaved, so that the machine's load spreads over every variant
        for name, fn in variants.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    print(f"{len(requests)} requests, {model_tokens} model tokens, {sum(e.tool_calls for e in episodes)} calls")
    print("| rollout | model tokens | wall s (median) | tokens/s (wall) | CPU s (median) | tokens/s (CPU) |")
    print("|---|---|---|---|---|---|")
    for name, samples in times.items():
        tokens = len(requests) * length if name == "single-turn" else model_tokens
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        print(f"| {name} | {tokens} | {wall:.3f} | {tokens / wall:.0f} | {cpu:.3f} | {tokens / cpu:.0f} |")


if __name__ == "__main__":
    main()
