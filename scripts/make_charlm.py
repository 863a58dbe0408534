"""Build the built-in model ``splitproof/builtin/charlm``: a ~100k-parameter Llama over the character tokenizer.

    python scripts/make_charlm.py --out splitproof/builtin/charlm

It starts from a seeded random initialisation and gets its starting competence from a short supervised
warm-up on the built-in addition task's *train* split (the test split is only measured, never trained
on). Each warm-up example is the prompt exactly as the RL run tokenizes it (the task's ``prompt`` string,
no chat template, no special tokens) followed by the answer characters and ``<eos>``; the loss is the
token mean of the cross-entropy over the answer and ``<eos>`` tokens.

The warm-up stops at the first check (every ``--eval-every`` steps) where the greedy exact-match rate
on a slice of the training split reaches ``--target``: competent enough that GRPO groups have reward
spread, weak enough that there is much left to learn. The run is reproducible: fixed seeds,
``torch.use_deterministic_algorithms(True)``, one thread; the versions used are written into the
directory's README.md.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import transformers
import transformers.utils.logging
from transformers import DynamicCache, GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.rl.data.tasks import score, task_rows

TRAIN_TASK = "builtin://addition/train?digits=2"
TEST_TASK = "builtin://addition/test?digits=2"
MAX_ANSWER_TOKENS = 4  # up to three answer digits, then <eos>
# transformers 5.x names the KV-cache argument ``cache`` (``past_key_values`` is deprecated); 4.x only knows the
# old name
CACHE_KWARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"


@dataclass(frozen=True)
class Architecture:
    """The Llama shape: 2 layers of width 64, 4 heads of 16, a SwiGLU MLP of 176, tied embeddings, init std 0.1."""

    hidden_size: int = 64
    intermediate_size: int = 176
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256
    initializer_range: float = (
        0.1  # ~1/sqrt(width); transformers' default 0.02 made the warm-up 3x slower and GRPO unstable
    )
    tie_word_embeddings: bool = True


@dataclass(frozen=True)
class WarmUp:
    """The supervised warm-up: AdamW on shuffled training rows, stopped at a training-slice accuracy."""

    seed: int = 0
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    max_steps: int = 3000
    eval_every: int = 10
    eval_rows: int = 500  # the first rows of the training split, for the stopping rule
    target: float = 0.30  # stop once the greedy exact-match rate on that slice reaches this


def build_model(tokenizer, arch: Architecture, seed: int) -> LlamaForCausalLM:
    """A freshly initialised float32 Llama whose vocabulary is the tokenizer's."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **asdict(arch),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None
    )
    return model


def examples(tokenizer, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <eos>) per row; the prompt tokenized as the RL run does it."""
    prompts = tokenizer([row["prompt"] for row in rows], add_special_tokens=False)["input_ids"]
    answers = tokenizer([row["reward_model"]["ground_truth"] for row in rows], add_special_tokens=False)["input_ids"]
    return [(p, a + [tokenizer.eos_token_id]) for p, a in zip(prompts, answers)]


def sft_batch(pairs: list[tuple[list[int], list[int]]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and next-token ``labels`` (-100 except on answer and <eos> tokens)."""
    width = max(len(p) + len(a) for p, a in pairs)
    input_ids = torch.full((len(pairs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for i, (prompt, answer) in enumerate(pairs):
        input_ids[i, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[i, len(prompt) : len(prompt) + len(answer)] = torch.tensor(answer)
    return input_ids, labels


def sft_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Token mean of −log p(label) over the labelled positions (logits at t predict token t+1)."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    target = labels[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100
    )


@torch.no_grad()
def greedy_responses(model, prompt_ids: list[list[int]], eos_id: int, max_new_tokens: int) -> list[list[int]]:
    """Greedy decode with a KV cache, prompts grouped by length (no padding); each response ends at <eos>."""
    out: list[list[int]] = [[] for _ in prompt_ids]
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompt_ids):
        by_length.setdefault(len(ids), []).append(i)
    for members in by_length.values():
        tokens = torch.tensor([prompt_ids[i] for i in members])
        finished = torch.zeros(len(members), dtype=torch.bool)
        cache = DynamicCache()
        result = model(input_ids=tokens, use_cache=True, **{CACHE_KWARG: cache})
        for _ in range(max_new_tokens):
            nxt = result.logits[:, -1].argmax(-1)
            for row, i in enumerate(members):
                if not finished[row]:
                    out[i].append(int(nxt[row]))
            finished |= nxt == eos_id
            if bool(finished.all()):
                break
            result = model(input_ids=nxt[:, None], use_cache=True, **{CACHE_KWARG: cache})
    return out


def exact_match_rate(model, tokenizer, rows: list[dict]) -> float:
    """Greedy exact-match rate of ``model`` on ``rows`` with the task's own reward."""
    pairs = examples(tokenizer, rows)
    was_training = model.training
    model.eval()
    responses = greedy_responses(model, [p for p, _ in pairs], tokenizer.eos_token_id, MAX_ANSWER_TOKENS)
    model.train(was_training)
    texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
    return sum(score(text, row["reward_model"]["ground_truth"]) for text, row in zip(texts, rows)) / len(rows)


def set_reproducible() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def warm_up(model, tokenizer, train_rows: list[dict], cfg: WarmUp, *, steps: int | None = None, log=None) -> dict:
    """Train in place; stop at ``cfg.target`` on the stopping slice, or after exactly ``steps`` steps if given.

    Returns ``{"steps": ..., "train_slice_accuracy": ..., "history": [(step, accuracy), ...]}``.
    """
    pairs = examples(tokenizer, train_rows)
    slice_rows = train_rows[: cfg.eval_rows]
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    order: list[int] = []
    history: list[tuple[int, float]] = []
    limit = cfg.max_steps if steps is None else steps
    accuracy = float("nan")
    step = 0
    while step < limit:
        if len(order) < cfg.batch_size:
            order += torch.randperm(len(pairs), generator=generator).tolist()
        batch, order = order[: cfg.batch_size], order[cfg.batch_size :]
        input_ids, labels = sft_batch([pairs[i] for i in batch], tokenizer.pad_token_id)
        loss = sft_loss(model, input_ids, labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if steps is None and step % cfg.eval_every == 0:
            accuracy = exact_match_rate(model, tokenizer, slice_rows)
            history.append((step, accuracy))
            if log:
                log(f"step {step:4d}  loss {loss.item():.4f}  train-slice greedy accuracy {accuracy:.3f}")
            if accuracy >= cfg.target:
                break
    else:
        if steps is None:
            raise RuntimeError(f"the warm-up did not reach {cfg.target} in {cfg.max_steps} steps")
    return {"steps": step, "train_slice_accuracy": accuracy, "history": history}


MODEL_CARD = """# charlm: splitproof's built-in model

A {params:,}-parameter Llama (`LlamaForCausalLM`: {layers} layers, width {hidden}, {heads} heads, SwiGLU MLP
{mlp}, tied embeddings, float32) over splitproof's character tokenizer (vocabulary {vocab}: `<pad>`=0,
`<eos>`=1, `<unk>`=2, newline, printable ASCII; no BOS).

Starting competence: a supervised warm-up on `{train_task}`
(prompt as is, then the answer characters and `<eos>`; loss on the answer and `<eos>`), AdamW lr {lr},
batch {batch}, seed {seed}, stopped after {steps} steps, when the greedy exact-match rate on the first
{eval_rows} training rows reached {train_acc:.1%} (target {target:.0%}). The test split was never
trained on. `warmup.json` records the settings and the accuracy at each check.

Greedy exact-match rate on `{test_task}` (500 held-out problems): **{test_acc:.1%}**.

Rebuild: `python scripts/make_charlm.py --out splitproof/builtin/charlm` (one thread, deterministic
algorithms). Built with torch {torch}, transformers {transformers}, Python {python}.
"""


def save(model, tokenizer, out: str, card: str, record: dict) -> None:
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    os.chmod(os.path.join(out, "model.safetensors"), 0o644)  # readable by all, like the other files
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, "README.md"), "w") as fh:
        fh.write(card)
    with open(os.path.join(out, "warmup.json"), "w") as fh:
        json.dump(record, fh, indent=2)
        fh.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=WarmUp.seed)
    parser.add_argument("--target", type=float, default=WarmUp.target)
    parser.add_argument("--lr", type=float, default=WarmUp.lr)
    parser.add_argument("--batch-size", type=int, default=WarmUp.batch_size)
    parser.add_argument("--eval-every", type=int, default=WarmUp.eval_every)
    parser.add_argument("--steps", type=int, default=None, help="run exactly this many steps (no stopping rule)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)

    set_reproducible()
    transformers.utils.logging.disable_progress_bar()
    cfg = WarmUp(seed=args.seed, target=args.target, lr=args.lr, batch_size=args.batch_size, eval_every=args.eval_every)
    arch = Architecture()
    tokenizer = char_tokenizer()
    model = build_model(tokenizer, arch, cfg.seed)
    train_rows, test_rows = task_rows(TRAIN_TASK), task_rows(TEST_TASK)
    log = None if args.quiet else print
    start = time.perf_counter()
    result = warm_up(model, tokenizer, train_rows, cfg, steps=args.steps, log=log)
    seconds = time.perf_counter() - start
    if args.steps is not None:
        result["train_slice_accuracy"] = exact_match_rate(model, tokenizer, train_rows[: cfg.eval_rows])
    test_acc = exact_match_rate(model, tokenizer, test_rows)
    params = sum(p.numel() for p in model.parameters())
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
    }
    card = MODEL_CARD.format(
        params=params, layers=arch.num_hidden_layers, hidden=arch.hidden_size, heads=arch.num_attention_heads,
        mlp=arch.intermediate_size, vocab=len(tokenizer), train_task=TRAIN_TASK, test_task=TEST_TASK,
        lr=cfg.lr, batch=cfg.batch_size, seed=cfg.seed, steps=result["steps"], eval_rows=cfg.eval_rows,
        train_acc=result["train_slice_accuracy"], target=cfg.target, test_acc=test_acc, **versions,
    )  # fmt: skip
    record = {
        "architecture": asdict(arch),
        "warmup": asdict(cfg),
        "train_task": TRAIN_TASK,
        "test_task": TEST_TASK,
        "steps": result["steps"],
        "history": {str(step): accuracy for step, accuracy in result["history"]},
        "train_slice_accuracy": result["train_slice_accuracy"],
        "test_accuracy": test_acc,
        "parameters": params,
        "versions": versions,
    }
    save(model, tokenizer, args.out, card, record)
    if log:
        log(f"{params} parameters, {result['steps']} steps in {seconds:.1f} s; held-out greedy accuracy {test_acc:.3f}")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
