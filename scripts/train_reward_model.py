"""Train a small reward model for the built-in addition task from the task's rule reward (seconds on a CPU).

    python scripts/train_reward_model.py --out runs/addition-rm [--steps 400] [--seed 0]

The model is a one-label sequence classifier with the built-in model's body (``builtin://charlm``) and a
head drawn from the seed (``rewards.reward_model.classifier_from_causal_lm``). Its training set: for every
prompt of ``builtin://addition/train``, ``--samples`` responses of the built-in model (sampled at
temperature 1, 4 tokens at most, the recipe's) and three written ones — the right answer and two wrong
ones close to it (one digit changed; the answer ± 1..10) — each with its EOS; the label of a response is
the rule's score (exact match, 1 or 0). The loss is the binary cross-entropy of sigmoid(r(x)) against the
label, Adam, minibatches drawn from a generator seeded by ``--seed``. The scores r(x) the run then trains on
are the logits. Evaluated on the built-in model's samples of ``builtin://addition/test`` (held out): how
often r(x) > 0 agrees with the rule. Writes a Hugging Face directory (model and the built-in tokenizer) and
``training.json`` (the settings and the measured agreement).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from splitproof.builtin import charlm_directory  # noqa: E402
from splitproof.hf_models import load_causal_lm  # noqa: E402
from splitproof.rl.data import tasks  # noqa: E402
from splitproof.rl.data.prompts import load_prompts  # noqa: E402
from splitproof.rl.rewards.functions import response_text  # noqa: E402
from splitproof.rl.rewards.reward_model import classifier_from_causal_lm, forward_scores  # noqa: E402
from splitproof.rl.rollout.hf import HFRollout, SamplingParams  # noqa: E402


def policy_samples(policy, tokenizer, dataset, n: int, seed: int) -> list:
    engine = HFRollout(policy, eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(n=n, temperature=1.0, max_response_length=4, seed=seed)
    requests = [(r.uid, j, list(r.prompt_ids)) for r in dataset for j in range(n)]
    return engine.generate(requests, params, step=0)


def near_misses(answer: str, rng: random.Random) -> list[str]:
    """Two wrong answers close to ``answer``: one digit changed, and the answer ± 1..10."""
    k = rng.randrange(len(answer))
    digit = rng.choice([d for d in "0123456789" if d != answer[k]])
    changed = answer[:k] + digit + answer[k + 1 :]
    if changed != "0" and changed.startswith("0"):
        changed = str(int(changed))
    offset = rng.choice([d for d in range(-10, 11) if d and int(answer) + d >= 0])
    return [w for w in (changed, str(int(answer) + offset)) if w != answer]


def examples(dataset, samples, tokenizer, seed: int, written: bool) -> tuple[list[list[int]], list[float]]:
    """(input ids, rule labels): the policy's samples and, with ``written``, the right answer and near misses."""
    rng = random.Random(seed)
    inputs, labels = [], []
    for s in samples:
        truth = dataset[s.uid].columns["reward_model"]["ground_truth"]
        inputs.append(list(s.prompt_ids) + list(s.response_ids))
        labels.append(tasks.score(response_text(tokenizer, s), truth))
    if written:
        for record in dataset:
            truth = str(record.columns["reward_model"]["ground_truth"])
            for text in [truth, *near_misses(truth, rng)]:
                ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                inputs.append(list(record.prompt_ids) + ids)
                labels.append(tasks.score(text, truth))
    return inputs, labels


def agreement(model, inputs, labels) -> float:
    with torch.no_grad():
        scores = torch.cat([forward_scores(model, inputs[i : i + 512]) for i in range(0, len(inputs), 512)])
    return float(((scores > 0).double() == torch.tensor(labels, dtype=torch.float64)).double().mean())


def train(model, inputs, labels, *, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    target = torch.tensor(labels, dtype=torch.float32)
    losses = []
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(inputs), (batch,), generator=generator).tolist()
        logits = forward_scores(model, [inputs[r] for r in rows]).float()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, target[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--samples", type=int, default=4, help="the built-in model's responses per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(charlm_directory())
    policy = load_causal_lm(charlm_directory())
    train_data = load_prompts(["builtin://addition/train"], tokenizer, max_prompt_length=16)
    test_data = load_prompts(["builtin://addition/test"], tokenizer, max_prompt_length=16)
    train_inputs, train_labels = examples(
        train_data, policy_samples(policy, tokenizer, train_data, args.samples, args.seed), tokenizer, args.seed, True
    )
    test_inputs, test_labels = examples(
        test_data, policy_samples(policy, tokenizer, test_data, args.samples, args.seed + 1), tokenizer, 0, False
    )
    model = classifier_from_causal_lm(policy, seed=args.seed)
    before = agreement(model, test_inputs, test_labels)
    losses = train(model, train_inputs, train_labels, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "train_examples": len(train_inputs),
        "train_positive_share": sum(train_labels) / len(train_labels),
        "test_examples": len(test_inputs),
        "test_positive_share": sum(test_labels) / len(test_labels),
        "test_agreement_before": before,
        "test_agreement": agreement(model, test_inputs, test_labels),
        "final_loss_mean_last_20": sum(losses[-20:]) / 20,
        "seconds": time.perf_counter() - start,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
