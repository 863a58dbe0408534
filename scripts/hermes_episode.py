"""One hermes-format episode on a real chat model, printed with its token mask: what the model wrote, the
call parsed from it, the tool response appended, and the next turn.

    python scripts/hermes_episode.py --model smollm2 [--sample]

The tools' schemas go to the chat template as ``tools=`` (as the run renders prompts); a template that
ignores them (SmolLM2's) gets them described in a system message instead. With ``--few-shot`` a
short system message and two worked exchanges (a question, the assistant's ``<tool_call>``, the tool's
answer, the bare result) come first: that is what makes SmolLM2-135M-Instruct write a call.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from splitproof.rl.rollout.episode import EpisodeRollout, MultiTurnSettings
from splitproof.rl.rollout.hf import HFRollout, SamplingParams
from splitproof.rl.rollout.tools import load_tools

SYSTEM = (
    "You are a function calling AI model. You may call the function below. For each call, return a JSON "
    "object with the function name and arguments within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>\n'
    "Functions: {schemas}"
)


SHORT_SYSTEM = (
    "You are a calculator assistant. You cannot multiply by yourself. To multiply a and b, reply only "
    'with <tool_call>{"name": "mul", "arguments": {"a": a, "b": b}}</tool_call> and wait for the result.'
)


def worked(a: int, b: int) -> list[dict]:
    """One worked hermes exchange: the question, the call, the tool's answer, the bare result."""
    call = json.dumps({"name": "mul", "arguments": {"a": a, "b": b}})
    return [
        {"role": "user", "content": f"What is {a} times {b}?"},
        {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
        {"role": "tool", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def messages_for(question: str, schemas: list[dict], shots: bool) -> list[dict]:
    """Without shots: the system message with the schemas, then the question. With them: a short system
    message, two worked exchanges (12×34, 25×17), then the question."""
    if not shots:
        return [
            {"role": "system", "content": SYSTEM.format(schemas=json.dumps(schemas))},
            {"role": "user", "content": question},
        ]
    return [
        {"role": "system", "content": SHORT_SYSTEM},
        *worked(12, 34),
        *worked(25, 17),
        {"role": "user", "content": question},
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--question", default="What is 123 times 456? Use the mul function.")
    parser.add_argument("--sample", action="store_true", help="sample (seed 0) instead of greedy")
    parser.add_argument("--few-shot", action="store_true", help="open with one worked tool-call exchange")
    parser.add_argument("--max-response-length", type=int, default=160)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tools = load_tools("pkg://splitproof.builtin.calculator", None)
    schemas = [t.schema for t in tools.values()]
    messages = messages_for(args.question, schemas, args.few_shot)
    prompt = tokenizer.apply_chat_template(messages, tools=schemas, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    rollout = EpisodeRollout(
        HFRollout(
            model, eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, min_rows=1
        ),  # one episode: no filler rows (speed only)
        tokenizer,
        tools,
        MultiTurnSettings(format="hermes", max_assistant_turns=3),
    )
    params = SamplingParams(do_sample=args.sample, max_response_length=args.max_response_length, seed=0)
    episode = rollout.generate([(0, 0, ids)], params, step=1)[0]
    segments, start = [], 0
    for t in range(1, len(episode.token_mask) + 1):
        if t == len(episode.token_mask) or episode.token_mask[t] != episode.token_mask[start]:
            who = "model" if episode.token_mask[start] else "tool"
            segments.append((who, tokenizer.decode(episode.response_ids[start:t])))
            start = t
    for who, text in segments:
        print(f"--- {who} ---\n{text}")
    print(
        f"--- turns {episode.num_turns}, tool calls {episode.tool_calls}, errors {episode.tool_errors}, "
        f"malformed {episode.malformed_calls}, tokens {len(episode.response_ids)} "
        f"(model {sum(episode.token_mask)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
