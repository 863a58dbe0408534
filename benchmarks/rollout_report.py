"""The docs section of `benchmarks/rollout.py`, block by block: the setup, the generation table, the token
pick alone, the old-log-prob pass and its attribution, the layout drift."""

from __future__ import annotations

import benchlib as bl

GOAL = 1.05  # the largest ratio splitproof / plain a pass may cost


def setup_text(result: dict) -> str:
    models = "; ".join(f"{name}: {text}" for name, text in result["models"].items())
    w = result["workload"]
    return (
        f"Models — {models}. Generation: {w['prompts'] * w['n']} requests ({w['prompts']} prompts × {w['n']} "
        f"samples, prompts of {w['shortest']}–{w['longest']} random tokens), {w['length']} new tokens each, all "
        f"in one chunk (max_num_seqs 256), no EOS. Times are medians over the repeats; a ratio is the median of "
        f"the per-repeat ratios. {bl.clock_note(result['clock'])}"
    )


def generation_table(result: dict) -> str:
    return bl.table(
        [
            "model",
            "sampling",
            "counter-based ms",
            "multinomial ms",
            "counter-based / multinomial",
            "paired-ratio IQR",
            f"goal ≤ {GOAL}",
        ],
        [
            [
                r["model"],
                r["setting"],
                bl.ms(r["ours_s"]),
                bl.ms(r["plain_s"]),
                f"{r['ratio']:.3f}",
                f"{r['q1']:.3f}–{r['q3']:.3f}",
                bl.verdict(r["ratio"], GOAL),
            ]
            for r in result["generation"]
        ],
    )


def pick_blocks(result: dict) -> list[str]:
    pick_text = (
        "Token pick alone — one decode step's sampling (log-probs included) on random logits; "
        "the counter-based Gumbel-max draws one uniform per vocabulary entry."
    )
    picks = bl.table(
        ["model", "logits [R, V]", "token pick (incl. log_softmax)", "ms per decode step"],
        [[r["model"], r["shape"], r["pick"], f"{r['ms']:.3f}"] for r in result["picks"]],
    )
    return [pick_text, picks]


def old_log_prob_blocks(result: dict) -> list[str]:
    """The old-log-prob pass against the plain forward, then the stand-in model's attribution."""
    old_rows = result["old"]
    o = old_rows[0]
    old_text = (
        f"Old log-probs: {o['sequences']} sequences (prompts ≤ {o['prompt']}, responses ≤ {o['response']}, "
        f'{o["tokens"]} real tokens), microbatches of {o["micro"]} rows. "plain forward" is the model\'s own '
        "no-grad forward of the same padded microbatches (logits at every position, nothing else); "
        '"forward + log_softmax head" adds what a hand-written old-log-prob pass does with them.'
    )
    old = bl.table(
        ["model", "pass", "ms", "/ plain forward", "paired-ratio IQR", f"goal ≤ {GOAL}"],
        [
            [
                r["model"],
                r["variant"],
                f"{r['ms']:.1f}",
                f"{r['ratio'].median:.3f}",
                r["ratio"].spread(),
                bl.verdict(r["ratio"].median, GOAL) if r["variant"] == "compute_log_probs" else "",
            ]
            for r in old_rows
            if r["kind"] == "model"
        ],
    )
    stand_in = bl.table(
        ["model", "pass (no forward)", "ms", "extra over the plain loop, ms", "share of the plain forward"],
        [
            [
                r["model"],
                r["variant"],
                f"{r['ms']:.2f}",
                f"{r['ms'] - base['ms']:.2f}",
                f"{100 * (r['ms'] - base['ms']) / forward['ms']:.1f} %",
            ]
            for r in old_rows
            if r["kind"] != "model"
            for base in [
                next(
                    b
                    for b in old_rows
                    if b["kind"] == r["kind"] and b["model"] == r["model"] and b["variant"] == "plain forward"
                )
            ]
            for forward in [
                next(
                    b
                    for b in old_rows
                    if b["kind"] == "model" and b["model"] == r["model"] and b["variant"] == "plain forward"
                )
            ]
            if r["variant"] != "plain forward"
        ],
    )
    stand_in_text = (
        "Attribution (tiny model) — the same three loops with a stand-in model whose forward returns "
        "zero logits of the right shape: what each pass costs besides the model (the last column relates "
        "it to the model's plain forward above)."
    )
    return [old_text, old, stand_in_text, stand_in]


def drift_blocks(result: dict) -> list[str]:
    drift_text = (
        "Layout drift at T 1, no EOS: the same requests generated whole (the reference), in chunks of 5 "
        "in a shuffled order, and split in two halves generated separately in chunks of 8, as two "
        'data-parallel ranks would. "max |Δ log-prob|" is over the tokens before a sample\'s first '
        'differing token; "vs full forward" is the largest |rollout log-prob − compute_log_probs| over '
        "all response tokens of the reference. The second workload's sequences pass 512 keys, the CPU "
        "attention kernel's block."
    )
    drift = bl.table(
        [
            "dtype",
            "model",
            "workload",
            "layout",
            "samples",
            "samples whose tokens differ",
            "max |Δ log-prob|",
            "vs full forward",
        ],
        [
            [
                r["dtype"],
                r["model"],
                r["workload"],
                r["layout"],
                r["samples"],
                r["differ"],
                f"{r['max_logprob_gap']:.1e}",
                f"{r['vs_full']:.1e}",
            ]
            for r in result["drift"]
        ],
    )
    return [drift_text, drift]
