"""Train a small reward model for the built-in addition task from the task's rule reward (seconds on a CPU).

    python scripts/train_reward_model.py --out runs/addition-rm [--steps 400] [--seed 0]

The model is a one-label sequence classifier with the built-in model's body (``builtin://charlm``) and a
head drawn from the seed (``rewards.reward_model.classifier_from_causal_lm``). Its training set: for every
prompt of ``builtin://addition/train``, ``--samples`` responses of the built-in model (sampled at
temperature 1, 4 tokens at most, the recipe's) and three written ones — the right answer and two wrong
ones close to it (one digit changed; the answer ± 1..10) — each with its EOS; the label of a response is
the rule's score (exact match, 1 or 0). The loss is Bradley-Terry's over pairs of a right and a wrong
response to the same prompt, -log sigmoid(r(right) - r(wrong)) (as TRL's reward trainer), Adam, minibatches
drawn from a generator seeded by ``--seed``; the score r(x) a run trains on is the logit. Evaluated on 8
samples of the built-in model per prompt of ``builtin://addition/test`` (held out): the pairwise accuracy
(a right response scored above a wrong one of the same prompt) and how often r(x) > 0 agrees with the
rule. Writes a Hugging Face directory (model and the built-in tokenizer) and ``training.json`` (the
settings and those measurements).
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


def examples(dataset, samples, tokenizer, seed: int, written: bool) -> tuple[list[list[int]], list[float], list[int]]:
    """(input ids, rule labels, prompt uids): the policy's samples and, with ``written``, the right answer and
    two near misses of every prompt."""
    rng = random.Random(seed)
    inputs, labels, uids = [], [], []
    for s in samples:
        truth = dataset[s.uid].columns["reward_model"]["ground_truth"]
        inputs.append(list(s.prompt_ids) + list(s.response_ids))
        labels.append(tasks.score(response_text(tokenizer, s), truth))
        uids.append(s.uid)
    if written:
        for record in dataset:
            truth = str(record.columns["reward_model"]["ground_truth"])
            for text in [truth, *near_misses(truth, rng)]:
                ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
                inputs.append(list(record.prompt_ids) + ids)
                labels.append(tasks.score(text, truth))
                uids.append(record.uid)
    return inputs, labels, uids


def pairs(labels, uids) -> list[tuple[int, int]]:
    """(right, wrong) example pairs of the same prompt, by the rule."""
    by_prompt: dict[int, tuple[list[int], list[int]]] = {}
    for i, (label, uid) in enumerate(zip(labels, uids)):
        by_prompt.setdefault(uid, ([], []))[int(label > 0)].append(i)
    return [(right, wrong) for wrongs, rights in by_prompt.values() for right in rights for wrong in wrongs]


def scores_of(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([forward_scores(model, inputs[i : i + 512]) for i in range(0, len(inputs), 512)])


def evaluation(model, inputs, labels, uids) -> dict:
    """Pairwise accuracy (a right response above a wrong one of the same prompt) and the share of r(x) > 0
    agreeing with the rule, on held-out examples."""
    scores = scores_of(model, inputs)
    test_pairs = pairs(labels, uids)
    right = sum(float(scores[a] > scores[b]) for a, b in test_pairs) / max(len(test_pairs), 1)
    sign = float(((scores > 0).double() == torch.tensor(labels, dtype=torch.float64)).double().mean())
    return {"pairwise_accuracy": right, "sign_agreement": sign, "pairs": len(test_pairs)}


def train(model, inputs, train_pairs, *, steps: int, batch: int, lr: float, seed: int) -> list[float]:
    """Bradley-Terry: minimise -log sigmoid(r(right) - r(wrong)) over minibatches of pairs."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        rows = torch.randint(len(train_pairs), (batch,), generator=generator).tolist()
        scores = forward_scores(
            model, [inputs[train_pairs[r][0]] for r in rows] + [inputs[train_pairs[r][1]] for r in rows]
        )
        loss = -torch.nn.functional.logsigmoid(scores[:batch] - scores[batch:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=2400)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8, help="the built-in model's responses per prompt")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(charlm_directory())
    policy = load_causal_lm(charlm_directory())
    train_data = load_prompts(["builtin://addition/train"], tokenizer, max_prompt_length=16)
    test_data = load_prompts(["builtin://addition/test"], tokenizer, max_prompt_length=16)
    train_inputs, train_labels, train_uids = examples(
        train_data, policy_samples(policy, tokenizer, train_data, args.samples, args.seed), tokenizer, args.seed, True
    )
    test = examples(test_data, policy_samples(policy, tokenizer, test_data, 8, args.seed + 1), tokenizer, 0, False)
    model = classifier_from_causal_lm(policy, seed=args.seed)
    before = evaluation(model, *test)
    train_pairs = pairs(train_labels, train_uids)
    losses = train(model, train_inputs, train_pairs, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed)
    report = {
        "settings": vars(args) | {"out": str(args.out)},
        "train_examples": len(train_inputs),
        "train_pairs": len(train_pairs),
        "train_right_share": sum(train_labels) / len(train_labels),
        "test_examples": len(test[0]),
        "test_right_share": sum(test[1]) / len(test[1]),
        "test_before": before,
        "test": evaluation(model, *test),
        "loss_mean_last_50": sum(losses[-50:]) / len(losses[-50:]),
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
