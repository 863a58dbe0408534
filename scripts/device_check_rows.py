"""The measurements of scripts/device_check.py, one function per group of rows (each returns table rows)."""

from __future__ import annotations

import copy
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# the random models: SmolLM2-135M's shape, and a tiny one for the CPU and --quick
SHAPES = {
    "smol": dict(
        vocab_size=49152,
        hidden_size=576,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        intermediate_size=1536,
        rows=16,
        prompt=48,
        response=64,
    ),
    "tiny": dict(
        vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, rows=12
    )
    | dict(prompt=12, response=16),
}
MODEL_KEYS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


def _row(check: str, setting: str, result: str) -> dict:
    return {"check": check, "setting": setting, "result": result}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def random_model(shape: dict, dtype: torch.dtype, device: torch.device):
    from splitproof.hf_models import tiny_causal_lm

    model = tiny_causal_lm("llama", **{k: shape[k] for k in MODEL_KEYS}, seed=0, dtype=dtype)
    return model.to(device).eval()


def random_tokens(shape: dict, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts and responses of varied lengths (ids 1..vocab-1; 0 pads)."""
    g = torch.Generator().manual_seed(seed)
    vocab, rows = shape["vocab_size"], shape["rows"]
    p_len = torch.randint(2, shape["prompt"] + 1, (rows,), generator=g).tolist()
    r_len = torch.randint(1, shape["response"] + 1, (rows,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in p_len]
    responses = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in r_len]
    return prompts, responses


def difference(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor, unit: str = "tokens") -> str:
    """ "bitwise", or how many masked entries differ and the largest absolute difference."""
    a, b = a[mask].double(), b[mask].double()
    differ = int((a != b).sum())
    if differ == 0:
        return "bitwise"
    return f"{differ} of {a.numel()} {unit} differ, max abs {float((a - b).abs().max()):.3g}"


def log_prob_rows(device: torch.device, dtype: torch.dtype, shape: dict, compute: torch.dtype | None = None) -> list:
    """No-grad log-probs of one batch under each split against one micro-batch of every row; ``compute``:
    the model stored in ``dtype`` computes in it (``engine.precision.compute_in``, verl's bf16 over fp32)."""
    from splitproof.batch import TokenBatch
    from splitproof.engine import compute_log_probs
    from splitproof.engine.precision import compute_in

    model = compute_in(random_model(shape, dtype, device), compute)
    label = f"log-probs {_name(dtype)}" if compute is None else f"log-probs {_name(compute)} over {_name(dtype)}"
    prompts, responses = random_tokens(shape)
    batch = TokenBatch.from_sequences(prompts, responses, response_width=shape["response"]).to(device)
    batch.attention_mask, batch.response_mask = batch.attention_mask.bool(), batch.response_mask.bool()
    rows, width = len(prompts), batch.prompts.shape[1] + batch.response_width
    with torch.no_grad():
        want, _ = compute_log_probs(model, batch, micro_batch_size=rows)
        splits = {
            "micro-batch 1": dict(micro_batch_size=1),
            "micro-batch 5": dict(micro_batch_size=5),
            f"token budget {3 * width}": dict(max_token_len=3 * width),
            f"packed, budget {3 * width}": dict(max_token_len=3 * width, packed=True),
        }
        out = []
        for setting, kwargs in splits.items():
            got, _ = compute_log_probs(model, batch, **kwargs)
            out.append(_row(label, setting, difference(got, want, batch.response_mask)))
    return out


def _generate(model, prompts, max_num_seqs: int, length: int):
    from splitproof.rl.rollout.hf import HFRollout, SamplingParams, requests_for

    engine = HFRollout(model, eos_token_ids=[1], pad_token_id=0, max_num_seqs=max_num_seqs)
    params = SamplingParams(n=2, temperature=1.0, max_response_length=length, seed=7)
    return engine.generate(requests_for(list(enumerate(prompts)), 2), params, step=1)


def rollout_rows(device: torch.device, dtype: torch.dtype, shape: dict) -> list[dict]:
    """Sampled tokens with 1, 3 and all sequences decoding at once (the counter-based sampler)."""
    model = random_model(shape, dtype, device)
    prompts, _ = random_tokens(shape, seed=1)
    length = shape["response"]
    start = time.perf_counter()
    want = _generate(model, prompts, 2 * len(prompts), length)
    seconds = time.perf_counter() - start
    out = [_row("rollout", f"{len(want)} samples x {length} tokens, all at once", f"{seconds:.2f} s")]
    for seqs in (1, 3):
        got = _generate(model, prompts, seqs, length)
        differ = sum(a.response_ids != b.response_ids for a, b in zip(got, want))
        result = "identical tokens" if differ == 0 else f"{differ} of {len(want)} samples differ"
        out.append(_row(f"rollout tokens {_name(dtype)}", f"max_num_seqs {seqs}", result))
    return out


def _update(model, batch, **split) -> dict[str, torch.Tensor]:
    from splitproof.engine import UpdateConfig, update_policy

    model = copy.deepcopy(model).train()
    before = {k: v.detach().double().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = UpdateConfig(ppo_mini_batch_size=len(batch), **split)
    update_policy(model, optimizer, batch, config)
    return {k: v.detach().double() - before[k] for k, v in model.named_parameters()}


def update_rows(device: torch.device, dtype: torch.dtype, shape: dict) -> list[dict]:
    """One policy update (SGD) under micro-batch splits and a token budget, against one micro-batch."""
    from splitproof.batch import RolloutBatch
    from splitproof.engine import compute_log_probs

    model = random_model(shape, dtype, device)
    prompts, responses = random_tokens(shape, seed=2)
    g = torch.Generator().manual_seed(3)
    advantages = torch.randn(len(prompts), generator=g).tolist()
    zeros = [[0.0] * len(r) for r in responses]
    batch = RolloutBatch.from_sequences(prompts, responses, zeros, advantages, dtype=dtype, device=device)
    with torch.no_grad():
        old, _ = compute_log_probs(model, batch, micro_batch_size=len(prompts))
    batch = RolloutBatch(**{**batch.__dict__, "old_log_probs": old.to(dtype)})
    want = _update(model, batch)
    norm = sum(float((d**2).sum()) for d in want.values()) ** 0.5
    width = batch.prompts.shape[1] + batch.response_width
    out = []
    splits = {
        "micro-batch 1": dict(ppo_micro_batch_size_per_gpu=1),
        "micro-batch 5": dict(ppo_micro_batch_size_per_gpu=5),
        f"token budget {3 * width}": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=3 * width),
    }
    for setting, split in splits.items():
        got = _update(model, batch, **split)
        diff = sum(float(((got[k] - want[k]) ** 2).sum()) for k in want) ** 0.5
        out.append(_row(f"update {_name(dtype)}", setting, f"relative difference {diff / norm:.3g}"))
    return out


def _timed(fn, repeats: int = 3) -> float:
    fn()  # warm-up
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def fixed_rows_cost(device: torch.device, dtype: torch.dtype, shape: dict) -> list[dict]:
    """One log-prob pass over the batch with the fixed-row products and without them (plain products)."""
    from splitproof.batch import TokenBatch
    from splitproof.engine import compute_log_probs, response_log_probs

    model = random_model(shape, dtype, device)
    prompts, responses = random_tokens(shape)
    batch = TokenBatch.from_sequences(prompts, responses, response_width=shape["response"]).to(device)
    with torch.no_grad():
        fixed = _timed(lambda: compute_log_probs(model, batch, micro_batch_size=len(prompts)))
        plain = _timed(lambda: response_log_probs(model, batch))
    setting = f"a log-prob pass, {len(prompts)} rows, {_name(dtype)}"
    return [_row("fixed-row products", setting, f"{fixed * 1e3:.1f} ms vs {plain * 1e3:.1f} ms plain")]


def short_train(device: str, steps: int, env: dict) -> dict:
    """``splitproof train`` (the embedded default) for ``steps`` steps on ``device``: its exit status, the
    last held-out score and the median step time (the first step left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        command = [
            *(sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "splitproof", "train"),
            f"trainer.total_training_steps={steps}",
            f"trainer.device={device}",
            f"trainer.default_local_dir={run}",
            "trainer.logger=[file]",
            f"trainer.test_freq={steps}",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        records = []
        if (run / "metrics.jsonl").is_file():
            records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    scores = [v for r in records for k, v in r.items() if k.startswith("val-core/") and "/mean@" in k]
    times = [r["timing_s/step"] for r in records if "timing_s/step" in r][1:]
    error = (done.stderr.strip().splitlines() or [""])[-1]
    return {
        "rc": done.returncode,
        "score": scores[-1] if scores else None,
        "step_s": statistics.median(times) if times else None,
        "error": error,
    }


def train_rows(device: torch.device, steps: int, env: dict) -> list[dict]:
    """The short run on the device; off the CPU, the same run on this machine's CPU for the step time."""
    runs = {str(device): short_train(str(device), steps, env)}
    if device.type != "cpu":
        runs["cpu"] = short_train("cpu", steps, env)
    out = []
    for where, r in runs.items():
        score = "no held-out score" if r["score"] is None else f"held-out score {r['score']:.3f}"
        tail = "" if r["rc"] == 0 else f" ({r['error']})"
        out.append(_row("splitproof train", f"{where}, {steps} steps", f"rc {r['rc']}, {score}{tail}"))
    times = {w: r["step_s"] for w, r in runs.items() if r["step_s"] is not None}
    if times:
        result = ", ".join(f"{w} {t:.3f} s" for w, t in times.items())
        out.append(_row("step time (median)", "the embedded default's step", result))
    return out
