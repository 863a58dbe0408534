"""Multi-turn rollouts against single-turn ones: model tokens per second on the same model, the same requests
and (to the request count) the same number of generated tokens.

The built-in model (``builtin://charlm``) on ``builtin://product`` prompts, ``rollout.n`` samples each:

- multi-turn: ``EpisodeRollout`` with the built-in calculator, ``max_assistant_turns`` 3. The built-in
  model has never learned to call a tool, so the benchmark's format reads *every* turn as the call
  ``mul(123,456)`` (the ``simple`` format's rendering appends ``=56088`` and a newline): each episode has
  3 model turns and 2 tool responses, turns end at the model's own EOS. Run with tools answering at once
  and with tools sleeping ``--latency`` ms per call (on the pool of ``agent.num_workers`` threads).
- single-turn: ``HFRollout`` on the same requests without EOS, ``max_response_length`` = the episodes'
  model tokens / requests (rounded), so both generate the same total up to the rounding.

On the ``hf`` engine episodes run out of lockstep (``rl/rollout/continuous.py``): up to ``max_num_seqs``
episodes share every packed forward, an episode whose turn ends sits out until its tools answer and then
feeds its last token and the tool's tokens in the next forward, and a finished episode's slot goes to the
next one. The row "turns in lockstep" runs the engine models without packed forwards get: each turn of the
live episodes in chunks of ``max_num_seqs`` (KV caches kept across turns, ``rl/rollout/prefill.py``), then
their tools.

    python benchmarks/multi_turn.py [--quick] [--repeats N] [--latency MS] [--model DIR]

``--model DIR`` (e.g. SmolLM2-135M-Instruct): 16 chat prompts × 4 samples, ``max_num_seqs`` 16,
``max_response_length`` 96, a turn ending at EOS or at a newline token (a call is one line), in a section
of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchlib as bl

NAME = "multi_turn"
BUILTIN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "splitproof", "builtin", "charlm")


def sleeping_mul(latency_s: float):
    """The built-in calculator's ``mul`` after ``latency_s`` seconds of sleep (a slow tool); no sleep call at 0
    (instant tools: ``time.sleep(0)`` still gives up the interpreter's lock and the core, about 80 µs a call
    here, which no quick tool of a user's does)."""

    def mul(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the left factor
            b: the right factor
        """
        if latency_s:
            time.sleep(latency_s)
        return a * b

    return mul


WAITS: list[float] = []  # seconds the episodes blocked on tool results, one entry per call read


def watch_waits() -> None:
    """Make the episode's tool runner record how long reading each result, or waiting for any episode's
    results, blocked (the tool time that generation did not hide)."""
    from splitproof.rl.rollout import episode
    from splitproof.rl.rollout.tool_runner import ToolRunner

    class TimedRunner(ToolRunner):
        def result(self, handle):
            start = time.perf_counter()
            out = super().result(handle)
            WAITS.append(time.perf_counter() - start)
            return out

        def wait_any(self, groups):  # out of lockstep: every running episode waits for its tools
            start = time.perf_counter()
            super().wait_any(groups)
            WAITS.append(time.perf_counter() - start)

    episode.ToolRunner = TimedRunner


def every_turn_calls(tokenizer, tools):
    """The ``simple`` format, except that any turn is read as the call ``mul(123,456)``."""
    from splitproof.rl.rollout.tool_format import SimpleFormat
    from splitproof.rl.rollout.tools import ToolCall

    class EveryTurnCalls(SimpleFormat):
        def parse(self, ids):
            return [ToolCall("mul", json.dumps({"a": 123, "b": 456}))], 0

    return EveryTurnCalls(tokenizer, tools)


def rollouts(env: bl.Env, latency_s: float, max_num_seqs: int):
    """(single-turn rollout without EOS, multi-turn rollouts with instant tools (KV caches kept across
    turns, and re-prefilled every turn), with slow tools)."""
    from transformers import AutoModelForCausalLM

    from splitproof.builtin.tokenizer import char_tokenizer
    from splitproof.rl.rollout.episode import EpisodeRollout, MultiTurnSettings
    from splitproof.rl.rollout.hf import HFRollout
    from splitproof.rl.rollout.tools import function_tool

    if env.args.model is None:
        tokenizer = char_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(env.args.model)
    model = AutoModelForCausalLM.from_pretrained(env.args.model or BUILTIN, dtype=env.dtype).to(env.device).eval()
    settings = MultiTurnSettings(format="simple", max_assistant_turns=3)

    ends = [tokenizer.eos_token_id]
    if env.args.model is not None:  # a chat model's turn ends at a line's end too: a call is one line
        ends += [
            ids[0] for ids in (tokenizer.encode(t, add_special_tokens=False) for t in ("\n", "\n\n")) if len(ids) == 1
        ]

    def episodes(latency: float, lockstep: bool = False):
        hf = HFRollout(model, eos_token_ids=ends, pad_token_id=tokenizer.pad_token_id, max_num_seqs=max_num_seqs)
        tools = {"mul": function_tool(sleeping_mul(latency), "benchmark")}
        rollout = EpisodeRollout(hf, tokenizer, tools, settings)
        rollout.format = every_turn_calls(tokenizer, tools)
        rollout.continuous = rollout.continuous and not lockstep
        return rollout

    single = HFRollout(model, eos_token_ids=None, pad_token_id=tokenizer.pad_token_id, max_num_seqs=max_num_seqs)
    single.eos_token_ids = ()  # a chat model's tokenizer names an EOS: single-turn runs without one
    return tokenizer, single, episodes(0.0), episodes(0.0, lockstep=True), episodes(latency_s)


def run(env: bl.Env) -> dict:
    from splitproof.rl.data.tasks import task_rows
    from splitproof.rl.rollout.hf import SamplingParams, requests_for

    chat = env.args.model is not None
    prompts_n, n, chunks = (4, 2, 2) if env.quick else ((16, 4, 4) if chat else (32, 4, 4))
    latency_s = (env.args.latency if env.args.latency is not None else 20.0) / 1000
    requests_total = prompts_n * n
    tokenizer, single, instant, lockstep, slow = rollouts(env, latency_s, max_num_seqs=requests_total // chunks)
    rows = task_rows("builtin://product/train")[:prompts_n]

    def encode(prompt: str) -> list[int]:
        if not chat:
            return tokenizer.encode(prompt, add_special_tokens=False)
        message = [{"role": "user", "content": f"Compute {prompt} with the calculator tool."}]
        return list(
            tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True, return_dict=False)
        )

    requests = requests_for([(u, encode(r["prompt"])) for u, r in enumerate(rows)], n)
    budget = 96 if chat else 48
    params = SamplingParams(n=n, max_response_length=budget, seed=0)
    episodes = instant.generate(requests, params, step=1)
    model_tokens = sum(sum(e.token_mask) for e in episodes)
    tool_tokens = sum(len(e.token_mask) - sum(e.token_mask) for e in episodes)
    calls = sum(e.tool_calls for e in episodes)
    length = max(1, round(model_tokens / len(requests)))
    single_params = SamplingParams(n=n, max_response_length=length, seed=0)
    lockstep_tokens = sum(sum(e.token_mask) for e in lockstep.generate(requests, params, step=1))
    variants = {
        "single-turn": lambda: single.generate(requests, single_params, step=1),
        "multi-turn, instant tools": lambda: instant.generate(requests, params, step=1),
        "multi-turn, instant tools, turns in lockstep": lambda: lockstep.generate(requests, params, step=1),
        f"multi-turn, tools sleep {latency_s * 1000:g} ms": lambda: slow.generate(requests, params, step=1),
    }
    bl.log(f"[{NAME}] {len(requests)} requests, {model_tokens} model tokens, {calls} calls")
    times = bl.interleaved(variants, repeats=env.repeats, env=env)
    watch_waits()
    blocked = {}
    for name, rollout in (("instant", instant), ("slow", slow)):
        WAITS.clear()
        rollout.generate(requests, params, step=1)
        blocked[name] = sum(WAITS)
    tokens = {"single-turn": len(requests) * length, "multi-turn, instant tools, turns in lockstep": lockstep_tokens}
    rows_out = []
    for name in variants:
        count = tokens.get(name, model_tokens)
        wall, cpu = bl.median(times.wall[name]), bl.median(times.cpu[name])
        rows_out.append(
            dict(variant=name, tokens=count, wall_s=wall, cpu_s=cpu, wall_tps=count / wall, cpu_tps=count / cpu)
        )
    lockstep = rows_out.pop(2)  # shown beside the others; `rows` keeps single, instant, slow
    return dict(
        model=env.args.model,
        rows=rows_out,
        lockstep=lockstep,
        requests=len(requests),
        prompts=prompts_n,
        n=n,
        max_num_seqs=requests_total // chunks,
        model_tokens=model_tokens,
        tool_tokens=tool_tokens,
        calls=calls,
        latency_s=latency_s,
        workers=slow.settings.num_workers,
        turns=sum(e.assistant_turns for e in episodes),
        budget=budget,
        repeats=env.repeats,
        blocked=blocked,
    )


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    rows = result["rows"]
    base = rows[0]
    table = bl.table(
        [
            "rollout",
            "model tokens",
            "wall s (median)",
            "tokens/s (wall)",
            "CPU s (median)",
            "tokens/s (CPU)",
            "vs single-turn (CPU tokens/s)",
        ],
        [
            [
                r["variant"],
                r["tokens"],
                f"{r['wall_s']:.3f}",
                f"{r['wall_tps']:.0f}",
                f"{r['cpu_s']:.3f}",
                f"{r['cpu_tps']:.0f}",
                f"{r['cpu_tps'] / base['cpu_tps']:.2f} ×",
            ]
            for r in rows[:2] + [result["lockstep"]] + rows[2:]
        ],
    )
    model = "the built-in model" if result["model"] is None else f"`{model_name(env.args)}` (chat prompts)"
    intro = (
        f"Setup: {model}, {result['prompts']} `builtin://product` prompts × {result['n']} samples "
        f"= {result['requests']} requests, `max_num_seqs` {result['max_num_seqs']}, sampling at T 1, "
        f"`max_response_length` {result['budget']}. Multi-turn: every turn read as a call of the "
        f"calculator (`max_assistant_turns` 3{', a newline ends a turn' if result['model'] else ''}): "
        f"{result['turns']} model turns, {result['calls']} calls, "
        f"{result['model_tokens']} model and {result['tool_tokens']} tool tokens. Single-turn: the same "
        f"requests without EOS, {rows[0]['tokens'] // result['requests']} tokens each. "
        f"{result['repeats']} interleaved repeats; tokens/s counts the model's tokens only."
    )
    instant = rows[1]
    tool_s = result["calls"] * result["latency_s"]
    blocked = result["blocked"]
    note = (
        f"Slow tools: {result['calls']} calls × {result['latency_s'] * 1000:g} ms = {tool_s:.2f} s of tool time "
        f"per rollout, on {result['workers']} threads. Time the episodes blocked reading tool results (one "
        "more rollout of each, timed around every read and every wait for any episode's results): "
        f"{blocked['slow']:.3f} s with the slow tools, "
        f"{blocked['instant']:.3f} s with instant ones; the rest of the tool time ran in parallel on the pool "
        "while the other episodes generated (an episode's calls start when its turn ends; it feeds their "
        "responses in the first forward after they all answered). Instant tools' calls run on the generating "
        "thread once the tool has answered quickly 4 times in a row (the first 4 calls of the run go to the pool; "
        "the rollout engine keeps the count from one rollout to the next). "
        f"Wall / CPU time of the instant-tool rollouts: {instant['wall_s'] / instant['cpu_s']:.1f} (above 1: "
        "the process waited for a core; the wall columns then measure the machine's load more than the code)."
    )
    return bl.section(
        section_name(env.args),
        "Multi-turn rollouts: tokens per second against single-turn"
        if env.args.model is None
        else f"Multi-turn rollouts on a chat model ({model_name(env.args)})",
        command,
        env,
        load_before,
        [intro, table, note],
    )


def model_name(args) -> str:
    return args.name or os.path.basename(args.model.rstrip("/"))


def main(argv: list[str] | None = None) -> dict:
    p = bl.parser(__doc__.splitlines()[0], repeats=5, quick_repeats=1)
    p.add_argument("--latency", type=float, default=None, help="milliseconds each slow tool call sleeps (default 20)")
    p.add_argument("--model", default=None, help="a Hugging Face chat model's directory instead of the built-in model")
    p.add_argument("--name", default=None, help="the chat model's name in the report (default: its directory's name)")
    args = p.parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render, section=section_name(args))


def section_name(args) -> str:
    """The docs section: one for the built-in model, one for ``--model``."""
    return NAME if args.model is None else f"{NAME}_model"


if __name__ == "__main__":
    main()
