"""Rollout costs: layout-independent sampling against ordinary `torch.multinomial` in the same decode loop,
and the old-log-prob pass against a plain no-grad forward of the same tokens.

- Generation: `HFRollout.generate` with its token pick swapped and nothing else — the same prefill,
  KV-cached decode, row compaction and layout rules. "counter-based" is the shipped rule (one
  counter-based uniform per token, inverse CDF); "multinomial" draws with `torch.multinomial` from one
  shared `torch.Generator`. Both apply the same temperature / top-k / top-p and compute the same log-probs.
  No EOS, so both generate exactly the same number of tokens.
- Token pick alone, on one decode step's logits: the two above and a counter-based Gumbel-max (one
  uniform per vocabulary entry), the alternative the shipped rule was chosen against.
- Old log-probs: `splitproof.engine.compute_log_probs` against a plain no-grad forward of the same
  microbatches (the model's own forward, logits at every position) and against that forward plus the
  usual `log_softmax` + `gather` at the response positions.
- Layout drift: the same requests generated whole, in chunks of 5 in a shuffled order, and split over
  two "ranks"; samples whose tokens differ, the largest log-prob difference, and the rollout log-probs
  against the full forward of `compute_log_probs` — in float32 and float64.

    python benchmarks/rollout.py [--quick] [--device cuda] [--repeats N] [--threads N]
"""

from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl
from rollout_report import (
    drift_blocks,
    generation_table,
    old_log_prob_blocks,
    pick_blocks,
    setup_text,
)

NAME = "rollout"

MODELS_FULL = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    "small": dict(vocab_size=16384, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=768),
}
MODELS_QUICK = {
    "tiny": dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
    "small": dict(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
}
SETTINGS = {"T 1": dict(), "T 0.8, top-k 50, top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9)}


def make_model(env: bl.Env, name: str, dtype: torch.dtype | None = None):
    from splitproof.hf_models import tiny_causal_lm

    sizes = (MODELS_QUICK if env.quick else MODELS_FULL)[name]
    return (
        tiny_causal_lm("llama", dtype=dtype or env.dtype, seed=0, max_position_embeddings=1024, **sizes)
        .to(env.device)
        .eval()
    )


def workload_sizes(env: bl.Env) -> dict:
    return (
        dict(prompts=4, n=2, shortest=2, longest=8, length=8)
        if env.quick
        else dict(prompts=16, n=4, shortest=16, longest=64, length=64)
    )


def workload(env: bl.Env, vocab: int) -> tuple[list, int]:
    """(requests, max_response_length): prompts of random lengths, n samples each."""
    from splitproof.rl.rollout.hf import requests_for

    w = workload_sizes(env)
    g = random.Random(0)
    prompts = [
        (u, [g.randrange(vocab) for _ in range(g.randint(w["shortest"], w["longest"]))]) for u in range(w["prompts"])
    ]
    return requests_for(prompts, w["n"]), w["length"]


# ---------------------------------------------------------------------------------------- token picks


def multinomial_pick(logits, generator, params):
    """Ordinary sampling: the shipped filters, then `torch.multinomial` from a shared generator."""
    from splitproof.rl.rollout.sampling import scaled_log_probs, truncated_weights

    z, log_probs = scaled_log_probs(logits, params.temperature)
    tokens = torch.multinomial(
        truncated_weights(z, log_probs, params.top_k, params.top_p), 1, generator=generator
    ).squeeze(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def gumbel_pick(logits, keys, t, params):
    """Counter-based Gumbel-max: one uniform per (token, vocabulary entry), argmax of log p + Gumbel noise."""
    from splitproof.rl.rollout.sampling import (
        GAMMA,
        _int64,
        mix64,
        scaled_log_probs,
        truncated_weights,
        uniform_from_bits,
    )

    z, log_probs = scaled_log_probs(logits, params.temperature)
    weights = truncated_weights(z, log_probs, params.top_k, params.top_p)
    offsets = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=torch.int64) * _int64(GAMMA)
    u = uniform_from_bits(mix64(mix64(keys + _int64((t + 1) * GAMMA)).unsqueeze(-1) + offsets))
    noisy = torch.where(weights > 0, log_probs.double() - torch.log(-torch.log(u)), -torch.inf)
    tokens = noisy.argmax(-1)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def rollouts(model, device):
    """The shipped backend and the same loop with `torch.multinomial`, both without EOS."""
    from splitproof.rl.rollout.hf import HFRollout

    class MultinomialRollout(HFRollout):
        generator = torch.Generator(device=device)

        def _sample(self, logits, uniforms, params):
            return multinomial_pick(logits, self.generator, params)

    return {
        "counter-based": HFRollout(model, eos_token_ids=None, pad_token_id=0),
        "multinomial": MultinomialRollout(model, eos_token_ids=None, pad_token_id=0),
    }


def generation_rows(env: bl.Env, model_name: str) -> list[dict]:
    from splitproof.rl.rollout.hf import SamplingParams

    model = make_model(env, model_name)
    requests, length = workload(env, model.config.vocab_size)
    backends = rollouts(model, env.device)
    rows = []
    for setting, kwargs in SETTINGS.items():
        params = SamplingParams(n=4, max_response_length=length, **kwargs)
        variants = {name: (lambda b=b, p=params: b.generate(requests, p, step=0)) for name, b in backends.items()}
        bl.log(f"[{NAME}] generation: {model_name}, {setting}")
        times = bl.interleaved(
            variants, repeats=env.repeats, env=env, prepare=lambda: backends["multinomial"].generator.manual_seed(0)
        )
        ratio = bl.Ratio.paired(times["counter-based"], times["multinomial"])
        tokens = len(requests) * length
        rows.append(
            dict(
                model=model_name,
                setting=setting,
                ours_s=bl.median(times["counter-based"]),
                plain_s=bl.median(times["multinomial"]),
                ratio=ratio.median,
                q1=ratio.q1,
                q3=ratio.q3,
                tokens=tokens,
                clock=times.clock,
            )
        )
    return rows


def pick_rows(env: bl.Env, model_name: str) -> list[dict]:
    """The token pick alone on one decode step's logits [requests, V]."""
    from splitproof.rl.rollout.hf import SamplingParams
    from splitproof.rl.rollout.sampling import sample_tokens, scaled_log_probs, stream_keys, token_uniforms

    model = make_model(env, model_name)
    requests, _ = workload(env, model.config.vocab_size)
    R, V = len(requests), model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    logits = (3 * torch.randn(R, V, generator=g)).to(device=env.device, dtype=env.dtype)
    keys = stream_keys(
        42,
        0,
        0,
        torch.tensor([u for u, _, _ in requests], device=env.device),
        torch.tensor([j for _, j, _ in requests], device=env.device),
    )
    uniforms = token_uniforms(keys, 3)  # the loop takes them from a per-chunk table: one gather per step
    generator = torch.Generator(device=env.device).manual_seed(0)
    params = SamplingParams()
    variants = {
        "log_softmax only": lambda: scaled_log_probs(logits, 1.0),
        "counter-based inverse CDF": lambda: sample_tokens(logits, uniforms),
        "torch.multinomial": lambda: multinomial_pick(logits, generator, params),
        "counter-based Gumbel-max": lambda: gumbel_pick(logits, keys, 3, params),
    }
    times = bl.interleaved(variants, repeats=max(9, 3 * env.repeats), env=env, warmup=2)
    return [dict(model=model_name, shape=f"{R} × {V}", pick=name, ms=bl.median(times[name]) * 1e3) for name in variants]


# ---------------------------------------------------------------------------------------- old log-probs


class ZeroLogits(torch.nn.Module):
    """A stand-in model whose forward returns zero logits of the right shape: times a pass without the model."""

    def __init__(self, vocab: int, device):
        super().__init__()
        self.vocab = vocab
        self.anchor = torch.nn.Parameter(torch.zeros(1, device=device))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):
        b, width = input_ids.shape
        return SimpleNamespace(logits=self.anchor.new_zeros(b, logits_to_keep or width, self.vocab))


def old_log_prob_rows(env: bl.Env, model_name: str) -> list[dict]:
    """compute_log_probs against the plain loops, with the model and with a zero-logits stand-in."""
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine import compute_log_probs

    real = make_model(env, model_name)
    B, P, T, micro = (8, 8, 8, 4) if env.quick else (64, 64, 64, 8)
    batch = synthetic_rollout(real, B, P, T, seed=1).validate()
    chunks = [torch.arange(s, min(s + micro, B), device=env.device) for s in range(0, B, micro)]
    input_ids, attention, responses = batch.input_ids, batch.attention_mask.long(), batch.responses

    def microbatches():
        """The rows of each microbatch, as any forward loop takes them from the batch."""
        for rows in chunks:
            mask = attention[rows]
            yield input_ids[rows], mask, (mask.cumsum(-1) - 1).clamp(min=0), responses[rows].unsqueeze(-1)

    rows = []
    models = [("model", real)]
    if model_name == "tiny":  # where the pass's own cost is a visible share of the forward
        models.append(("zero-logits stand-in", ZeroLogits(real.config.vocab_size, env.device)))
    for kind, model in models:

        @torch.no_grad()
        def plain_forward(model=model):
            for ids, mask, pos, _ in microbatches():
                model(input_ids=ids, attention_mask=mask, position_ids=pos)

        @torch.no_grad()
        def forward_and_head(model=model):
            for ids, mask, pos, tokens in microbatches():
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1 : -1]
                torch.log_softmax(logits, -1).gather(-1, tokens)

        variants = {
            "compute_log_probs": lambda model=model: compute_log_probs(model, batch, micro_batch_size=micro),
            "plain forward": plain_forward,
            "forward + log_softmax head": forward_and_head,
        }
        bl.log(f"[{NAME}] old log-probs: {model_name}, {kind}")
        times = bl.interleaved(variants, repeats=env.repeats if kind == "model" else max(9, 3 * env.repeats), env=env)
        rows += [
            dict(
                model=model_name,
                kind=kind,
                variant=name,
                ms=bl.median(times[name]) * 1e3,
                ratio=bl.Ratio.paired(times[name], times["plain forward"]),
                sequences=B,
                micro=micro,
                prompt=P,
                response=T,
                tokens=int(batch.attention_mask.sum()),
            )
            for name in variants
        ]
    return rows


# ---------------------------------------------------------------------------------------- layout drift


def long_workload(env: bl.Env, vocab: int) -> tuple[list, int]:
    """Long prompts and responses: sequences pass the CPU attention kernel's 512-key block."""
    from splitproof.rl.rollout.hf import requests_for

    prompts, shortest, longest, length = (2, 20, 40, 8) if env.quick else (8, 300, 480, 200)
    g = random.Random(1)
    return requests_for(
        [(u, [g.randrange(vocab) for _ in range(g.randint(shortest, longest))]) for u in range(prompts)], 2
    ), length


def _prefix_gap(a, b) -> float:
    """Largest |Δ log-prob| over the tokens before the first token that differs."""
    same = next((t for t, (x, y) in enumerate(zip(a.response_ids, b.response_ids)) if x != y), len(a.response_ids))
    return max((abs(x - y) for x, y in zip(a.log_probs[:same], b.log_probs[:same])), default=0.0)


def drift_rows(env: bl.Env) -> list[dict]:
    from splitproof.engine import compute_log_probs
    from splitproof.rl.rollout.hf import HFRollout, SamplingParams, samples_to_batch

    rows = []
    for dtype in (torch.float32, torch.float64):
        for model_name, make_workload in (("small", workload), ("tiny", long_workload)):
            model = make_model(env, model_name, dtype)
            requests, length = make_workload(env, model.config.vocab_size)
            params = SamplingParams(n=4, max_response_length=length)

            def generate(reqs, max_num_seqs, model=model, params=params):
                return HFRollout(model, eos_token_ids=None, pad_token_id=0, max_num_seqs=max_num_seqs).generate(
                    reqs, params, step=0
                )

            bl.log(f"[{NAME}] layout drift: {model_name}, {dtype}")
            base = generate(requests, len(requests))
            keyed = {(s.uid, s.sample_index): s for s in base}
            order = list(range(len(requests)))
            random.Random(2).shuffle(order)
            shuffled = [requests[i] for i in order]
            half = len(requests) // 2
            layouts = {
                "chunks of 5, shuffled": generate(shuffled, 5),
                "two ranks (chunks of 8)": generate(shuffled[:half], 8) + generate(shuffled[half:], 8),
            }
            batch = samples_to_batch(base, dtype=dtype, device=env.device)
            full, _ = compute_log_probs(model, batch, micro_batch_size=8)
            vs_full = (full - batch.old_log_probs).abs()[batch.response_mask].max().item()
            lengths = [len(ids) for _, _, ids in requests]
            for name, samples in layouts.items():
                rows.append(
                    dict(
                        dtype=str(dtype).replace("torch.", ""),
                        model=model_name,
                        workload=f"prompts {min(lengths)}–{max(lengths)}, {length} new tokens",
                        layout=name,
                        samples=len(samples),
                        tokens=len(samples) * length,
                        differ=sum(s.response_ids != keyed[s.uid, s.sample_index].response_ids for s in samples),
                        max_logprob_gap=max(_prefix_gap(s, keyed[s.uid, s.sample_index]) for s in samples),
                        vs_full=vs_full,
                    )
                )
    return rows


# ---------------------------------------------------------------------------------------- run, render


def run(env: bl.Env) -> dict:
    generation = [row for name in ("tiny", "small") for row in generation_rows(env, name)]
    picks = [row for name in ("tiny", "small") for row in pick_rows(env, name)]
    old = [row for name in ("tiny", "small") for row in old_log_prob_rows(env, name)]
    describe = {name: bm.describe_model(make_model(env, name)) for name in ("tiny", "small")}
    return dict(
        generation=generation,
        picks=picks,
        old=old,
        drift=drift_rows(env),
        models=describe,
        clock=generation[0]["clock"],
        workload=workload_sizes(env),
    )


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    blocks = [
        setup_text(result),
        generation_table(result),
        *pick_blocks(result),
        *old_log_prob_blocks(result),
        *drift_blocks(result),
    ]
    return bl.section(NAME, "Rollout: layout-independent sampling and old log-probs", command, env, load_before, blocks)


def main(argv: list[str] | None = None) -> dict:
    args = bl.parser(__doc__.splitlines()[0], repeats=5).parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
