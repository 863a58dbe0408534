"""Packed forwards and multi-turn episodes out of lockstep (rl/rollout/packed.py, rl/rollout/continuous.py).

- a token's logits are the same bits whichever sequences share its forwards, in which order and slots
  (random groupings of each sequence's feeds, hypothesis), float32 and float64, with and without
  grouped-query attention;
- episodes (tokens, log-probs, masks, turns) are the same bits whatever ``max_num_seqs``, the tool pool and
  the tools' random latency (so which episodes share a forward and when each rejoins);
- the decoder stack (rl/rollout/decoder_stack.py) gives the bits of ``model(...)``, on Llama, Qwen2 and
  Mistral blocks, and leaves Qwen3 to ``model(...)``;
- the engine is used on Hugging Face models on the attention interface, the lockstep turns otherwise, and
  the model's attention implementation is restored after a rollout.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.engine.row_invariant import row_invariant
from splitproof.hf_models import tiny_causal_lm
from splitproof.rl.rollout.decoder_stack import stack_of
from splitproof.rl.rollout.episode import EpisodeRollout, MultiTurnSettings
from splitproof.rl.rollout.hf import HFRollout, SamplingParams, requests_for
from splitproof.rl.rollout.packed import SlotCache, packed_forward, packed_forwards, packed_model, supports_packed
from splitproof.rl.rollout.tool_format import SimpleFormat
from splitproof.rl.rollout.tools import ToolCall, function_tool

BUILTIN = "splitproof/builtin/charlm"


@pytest.fixture(scope="module")
def models():
    """The built-in model in float32 and float64, and a tiny random one with grouped-query attention (4 query
    heads on 2 key heads, head_dim 32: SmolLM2's shape of attention, smaller)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    gqa = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=99,
            hidden_size=128,
            intermediate_size=200,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attn_implementation="sdpa",
        )
    ).eval()
    return {
        "float32": AutoModelForCausalLM.from_pretrained(BUILTIN, attn_implementation="sdpa").eval(),
        "float64": AutoModelForCausalLM.from_pretrained(BUILTIN).double().eval(),
        "gqa-float32": gqa,
    }


_generator = torch.Generator().manual_seed(0)
SEQUENCES = [torch.randint(2, 99, (n,), generator=_generator).tolist() for n in (5, 17, 33, 9, 48, 2)]


def _logits(model, schedule, slots: int, stack: bool = True) -> dict[tuple[int, int], torch.Tensor]:
    """The logits at every (sequence, position) after the forwards of ``schedule``: a list of forwards,
    each a list of (sequence, start, end) chunks; sequence s sits in slot s. ``stack=False``: through
    ``model(...)`` instead of the decoder stack."""
    cache, packed = SlotCache(slots, 64), packed_model(model, stack=stack)
    out = {}
    with torch.no_grad(), row_invariant(model), packed_forwards(model):
        for forward in schedule:
            feeds = [(s, a, SEQUENCES[s][a:b]) for s, a, b in forward]
            keys = [(s, p) for s, a, b in forward for p in range(a, b)]
            logits = packed_forward(packed, cache, feeds, list(range(len(keys))), pad_multiple=16)
            out.update(zip(keys, logits))
    return out


def _chunks(rng: random.Random, length: int) -> list[tuple[int, int]]:
    """A sequence's feeds: its first chunk (a prompt), then chunks of 1 (decode steps) or more (a tool's reply)."""
    cuts, at = [], 0
    while at < length:
        end = min(length, at + (rng.choice([1, 1, 1, 2, 3, 16, 40]) if at else rng.randint(1, length)))
        cuts.append((at, end))
        at = end
    return cuts


PLAN = [_chunks(random.Random(s), len(seq)) for s, seq in enumerate(SEQUENCES)]  # each sequence's feeds


@st.composite
def schedules(draw):
    """Random groupings of the sequences' feeds into forwards (a feed stays whole and in order)."""
    rng = random.Random(draw(st.integers(0, 2**31 - 1)))
    done, schedule = [0] * len(SEQUENCES), []
    while any(d < len(p) for d, p in zip(done, PLAN)):
        forward = []
        for s, plan in enumerate(PLAN):
            if done[s] < len(plan) and rng.random() < 0.5:
                forward.append((s, *plan[done[s]]))
                done[s] += 1
        if forward:
            rng.shuffle(forward)
            schedule.append(forward)
    return schedule


@pytest.fixture(scope="module")
def alone(models):
    """Each sequence's feeds in forwards of their own: the reference."""
    return {
        name: {k: v for s, plan in enumerate(PLAN) for k, v in _logits(model, [[(s, *c)] for c in plan], 8).items()}
        for name, model in models.items()
    }


@pytest.mark.invariance
@pytest.mark.parametrize("name", ["float32", "float64", "gqa-float32"])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules())
def test_a_tokens_logits_do_not_depend_on_which_sequences_share_its_forwards(models, alone, name, schedule):
    got = _logits(models[name], schedule, len(SEQUENCES))
    assert got.keys() == alone[name].keys()
    differing = [k for k in got if not torch.equal(got[k], alone[name][k])]
    assert not differing, f"{len(differing)} of {len(got)} tokens differ, first {differing[:3]}"


def _all_feeds_together() -> list:
    """Forward i holds feed i of every sequence that has one (prompts, decode steps and longer feeds mixed)."""
    return [[(s, *plan[i]) for s, plan in enumerate(PLAN) if i < len(plan)] for i in range(max(map(len, PLAN)))]


@pytest.mark.invariance
@pytest.mark.parametrize("name", ["float32", "float64", "gqa-float32"])
def test_the_decoder_stack_gives_the_bits_of_the_models_own_forward(models, name):
    assert stack_of(models[name]) is not None
    schedule = _all_feeds_together()
    got = _logits(models[name], schedule, len(SEQUENCES))
    want = _logits(models[name], schedule, len(SEQUENCES), stack=False)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.invariance
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])
def test_the_decoder_stack_runs_the_plain_llama_family_blocks_only(arch):
    """Qwen2 (biased q/k/v) and Mistral: the stack, same bits; Qwen3 (per-head q/k norms): ``model(...)``."""
    if arch == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(0)
        config = MistralConfig(
            vocab_size=99, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=None, attn_implementation="sdpa",
        )  # fmt: skip
        model = MistralForCausalLM(config).eval()
    else:
        model = tiny_causal_lm(arch, vocab_size=99).eval()
    assert supports_packed(model)
    assert (stack_of(model) is None) == (arch == "qwen3")
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert stack_of(model) is None  # the stack would skip the hook
    handle.remove()
    schedule = _all_feeds_together()
    got = _logits(model, schedule, len(SEQUENCES))
    want = _logits(model, schedule, len(SEQUENCES), stack=False)
    assert all(torch.equal(got[k], want[k]) for k in want)


class EveryTurnCalls(SimpleFormat):
    """Any turn is read as the call ``mul(<its length>, 7)``: every episode calls a tool at every turn."""

    def parse(self, ids):
        return [ToolCall("mul", json.dumps({"a": len(ids), "b": 7}))], 0


def _episodes(model, max_num_seqs: int, workers: int, latency: float, seed: int, continuous: bool = True):
    tokenizer = char_tokenizer()
    rng = random.Random(seed)

    def mul(a: int, b: int) -> int:
        """Multiply.

        Args:
            a: left
            b: right
        """
        time.sleep(rng.random() * latency)  # random completion order
        return a * b

    tools = {"mul": function_tool(mul, "test")}
    hf = HFRollout(
        model, eos_token_ids=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, max_num_seqs=max_num_seqs
    )
    rollout = EpisodeRollout(
        hf, tokenizer, tools, MultiTurnSettings(format="simple", max_assistant_turns=3, num_workers=workers)
    )
    rollout.format = EveryTurnCalls(tokenizer, tools)
    rollout.continuous = rollout.continuous and continuous
    prompts = [(u, tokenizer.encode(f"{u * 37 % 90 + 10}*{u + 3}=", add_special_tokens=False)) for u in range(6)]
    episodes = rollout.generate(requests_for(prompts, 3), SamplingParams(n=3, max_response_length=40, seed=5), step=2)
    return rollout, [(e.response_ids, e.log_probs, e.token_mask, e.assistant_turns, e.tool_calls) for e in episodes]


@pytest.mark.invariance
@pytest.mark.parametrize("name", ["float32", "float64"])
def test_episodes_do_not_depend_on_max_num_seqs_pool_or_latency(models, name):
    rollout, want = _episodes(models[name], 18, 8, 0.0, 0)
    assert rollout.continuous
    assert sum(turns for *_, turns, _ in want) > len(want)  # episodes go past their first turn
    for max_num_seqs, workers, latency, seed in [(1, 1, 0.0, 0), (4, 8, 0.004, 1), (7, 2, 0.004, 2)]:
        _, got = _episodes(models[name], max_num_seqs, workers, latency, seed)
        assert got == want, (max_num_seqs, workers, latency)


def test_the_lockstep_engine_agrees_and_the_attention_implementation_is_restored(models):
    """float64: the lockstep turns (kept KV caches, padded layouts) give the same tokens, and log-probs within
    1e-12 (the layouts differ, so the bits may)."""
    model = models["float64"]
    before = model.config._attn_implementation
    rollout, continuous = _episodes(model, 5, 2, 0.0, 0)
    assert rollout.continuous and model.config._attn_implementation == before
    rollout, lockstep = _episodes(model, 5, 2, 0.0, 0, continuous=False)
    assert not rollout.continuous
    assert [(e[0], e[2:]) for e in lockstep] == [(e[0], e[2:]) for e in continuous]
    gap = max(abs(a - b) for x, y in zip(lockstep, continuous) for a, b in zip(x[1], y[1]))
    assert gap <= 1e-12, gap
    assert not supports_packed(torch.nn.Linear(2, 2))


def test_a_lora_model_runs_out_of_lockstep_with_the_lockstep_tokens(models):
    """A PEFT (LoRA) wrapper of the built-in model, adapter weights non-zero: the engine and its decoder stack
    apply, and the two engines agree as for the plain model (float64)."""
    import copy

    from splitproof.lora import LoraSettings, apply_lora

    model = apply_lora(copy.deepcopy(models["float64"]), LoraSettings(lora_rank=4, lora_alpha=8))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert supports_packed(model) and stack_of(model) is not None  # the adapters run inside the stack's calls
    rollout, continuous = _episodes(model, 4, 2, 0.0, 0)
    assert rollout.continuous
    _, lockstep = _episodes(model, 4, 2, 0.0, 0, continuous=False)
    assert [(e[0], e[2:]) for e in lockstep] == [(e[0], e[2:]) for e in continuous]
    _, plain = _episodes(models["float64"], 4, 2, 0.0, 0)
    assert [e[0] for e in plain] != [e[0] for e in continuous]  # the adapter is applied
