"""vs_trl's report: the docs section of the side-by-side run — the setup, the loss mapping, the per-stage
table, the held-out scores, the split's times and updates, where splitproof is slower, and the goals."""

from __future__ import annotations

import math

import benchlib as bl
from vs_trl_summary import NAME, SPLIT, STAGE_ROWS, UNCHANGED


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def _ratio(r: dict | None) -> str:
    return "n/a" if not r or math.isnan(r["median"]) else f"{r['median']:.3f}"


def _range(r: dict | None) -> str:
    return "" if not r or math.isnan(r["median"]) else f"{r['low']:.3f}–{r['high']:.3f}"


def setup_table(result: dict) -> str:
    s = result["spec"]
    n, mini, B = s["n"], s["mini_batch_prompts"], s["prompts_per_step"]
    updates = B // mini
    rows = [
        ["model", "built-in charlm (LlamaForCausalLM, 107k parameters, vocabulary 99), float32", "the same directory"],
        ["task, reward", "builtin://addition/train, exact match", "the same rows and rule (a TRL reward function)"],
        [
            "prompts per step",
            f"data.train_batch_size {B}, our sampler's order (data.seed {s['data_seed']})",
            "the same prompts in the same order (shuffle_dataset false)",
        ],
        ["samples per prompt", f"rollout.n {n}", f"num_generations {n}"],
        [
            "optimizer steps per step",
            f"ppo_mini_batch_size {mini} ({updates} per step)",
            f"per_device_train_batch_size {mini * n}, steps_per_generation {updates}",
        ],
        [
            "minibatch composition",
            "actor.shuffle true: the rollout batch is permuted (seeded) before it is cut into minibatches",
            "the generation batch is shuffled before it is split (always)",
        ],
        [
            "response length, sampling",
            f"max_response_length {s['max_response_length']}, temperature {s['temperature']}, no top-k / top-p",
            f"max_completion_length {s['max_response_length']}, temperature {s['temperature']}, "
            "top_k 0, top_p 1.0 (HF generate, no vLLM)",
        ],
        [
            "optimizer",
            f"AdamW lr {s['lr']}, betas {tuple(s['betas'])}, eps 1e-8, weight decay {s['weight_decay']} "
            "(every weight), constant schedule",
            "the same AdamW object, passed as `optimizers=`; constant schedule",
        ],
        ["clipping", f"grad_clip {s['grad_clip']}, PPO clip 0.2", f"max_grad_norm {s['grad_clip']}, epsilon 0.2"],
        [
            "loss",
            f"loss_agg_mode {s['ours_loss_agg_mode']}, grpo advantages / group std",
            f"loss_type {s['trl_loss_type']}, scale_rewards {s['scale_rewards']}",
        ],
        [
            "KL, precision, memory",
            "no KL, fp32, no gradient checkpointing",
            "beta 0, bf16 false, gradient_checkpointing false",
        ],
        [
            "steps, seeds",
            f"{s['steps']} steps; seeds {', '.join(map(str, result['seeds']))} (rollout.seed)",
            f"{s['steps'] * updates} optimizer steps (max_steps); the same seeds (seed)",
        ],
        ["threads, processes", "one torch thread, one process per run", "the same"],
    ]
    return bl.table(["setting", "splitproof (`splitproof train`)", f"TRL {result['trl_version'] or '(not run)'}"], rows)


MAPPING = bl.table(
    ["TRL loss_type", "normalisation (TRL)", "splitproof / verl equivalent", "split-invariant in TRL"],
    [
        [
            "dapo (default)",
            "Σ token losses / tokens of the generation batch × GA / steps_per_generation",
            "token-mean (÷ tokens of the optimizer minibatch); equal when each generation batch is one optimizer step",
            "yes (global count)",
        ],
        [
            "dr_grpo",
            "Σ token losses / (micro-batch rows × max_completion_length) / GA",
            'seq-mean-token-sum-norm (its constant defaults to max_response_length); scale_rewards="none" ≈ '
            "norm_adv_by_std_in_grpo=false",
            "yes",
        ],
        [
            "grpo",
            "mean over micro-batch rows of each row's token mean / GA",
            "seq-mean-token-mean",
            "yes, with equal micro-batches",
        ],
        [
            "bnpo",
            "Σ token losses / tokens of the micro-batch / GA",
            "none: the per-micro-batch token mean splitproof replaces",
            "no (depends on the local batch)",
        ],
    ],
)


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    s = result["spec"]
    have_trl = bool(result["summaries"]["trl"])
    intro = (
        f"Setup — both sides train the same model on the same prompts with the same settings for {s['steps']} "
        f"steps, once per seed, each run a fresh process with one torch thread; the sides alternate "
        f"(ours, TRL, TRL, ours, ...). Figures are medians over steps 2–{s['steps']} (step 1 holds one-time "
        "warm-up) and then over the seeds; a ratio is the median over the seeds of the per-seed ratio "
        "splitproof / TRL (range beside it). The machine is shared with other jobs (2 cores). "
        + bl.clock_note("cpu")
        + " TRL's stage times come from wrappers around its methods (`_generate`, "
        "`_calculate_rewards`, the no-grad `_get_per_token_logps_and_entropies`, `training_step` minus its "
        "`_prepare_inputs`, `_clip_grad_norm`, the optimizer step); ours from the same kind of wrappers around "
        "`splitproof.rl.step`'s stage functions, whose wall times agree with the `timing_s/*` of metrics.jsonl "
        f"to {100 * max(x['timing_gap'] for x in result['summaries']['ours']):.1f} % at worst (the update also "
        "holds the scheduler step)."
    )
    blocks = [intro, setup_table(result), "Loss mapping (the comparison uses the first row):", MAPPING]
    if not have_trl:
        blocks.append("TRL was not available in this run: splitproof's side only.")
    blocks += stage_block(result) + held_out_block(env, result) + split_block(result) + update_block(result)
    blocks += causes(result)
    blocks += ["Goals:", bl.table(["goal", "measured", "verdict"], goal_rows(result))]
    return bl.section(NAME, "Side by side with TRL", command, env, load_before, blocks)


def stage_block(result: dict) -> list[str]:
    """The per-step table: each stage's CPU ms on both sides, their ratio, tokens per second, memory."""
    s = result["spec"]
    have_trl = bool(result["summaries"]["trl"])
    headers = ["stage", "splitproof ms", "TRL ms", "splitproof / TRL", "range over seeds", "wall: splitproof / TRL"]
    body = []
    for row in result["rows"]:
        if row["key"] == "tokens_per_s":
            continue
        body.append(
            [
                row["stage"],
                _ms(row["ours_cpu"]),
                _ms(row["trl_cpu"]) if have_trl else "n/a",
                _ratio(row.get("ratio")),
                _range(row.get("ratio")),
                _ratio(row.get("ratio_wall")),
            ]
        )
    tok = next(r for r in result["rows"] if r["key"] == "tokens_per_s")
    body.append(
        [
            "tokens per second (prompt + response)",
            f"{tok['ours_cpu']:.0f}",
            f"{tok['trl_cpu']:.0f}" if have_trl else "n/a",
            _ratio(tok.get("ratio")),
            _range(tok.get("ratio")),
            _ratio(tok.get("ratio_wall")),
        ]
    )
    ours_s, trl_s = result["summaries"]["ours"], result["summaries"]["trl"]
    peak_o = bl.median([x["peak"] for x in ours_s])
    grow_o = bl.median([x["growth"] for x in ours_s])
    if have_trl:
        peak_t, grow_t = bl.median([x["peak"] for x in trl_s]), bl.median([x["growth"] for x in trl_s])
        body.append(
            ["peak RSS, MiB (whole process)", f"{peak_o:.0f}", f"{peak_t:.0f}", f"{peak_o / peak_t:.3f}", "", ""]
        )
        body.append(
            [
                "RSS growth during training, MiB",
                f"{grow_o:.1f}",
                f"{grow_t:.1f}",
                f"{grow_o / grow_t:.3f}" if grow_t > 0 else "n/a",
                "",
                "",
            ]
        )
    else:
        body.append(["peak RSS, MiB (whole process)", f"{peak_o:.0f}", "n/a", "n/a", "", ""])
    return [
        f"Per training step ({s['prompts_per_step']} prompts × {s['n']} samples, "
        f"{s['prompts_per_step'] // s['mini_batch_prompts']} optimizer steps), CPU ms; a time ratio below 1 "
        "means splitproof is faster (for tokens per second, above 1 does):",
        bl.table(headers, body),
    ]


def held_out_block(env: bl.Env, result: dict) -> list[str]:
    """The held-out score of the initial model and of each side's final models."""
    s, sc = result["spec"], result["score"]
    held = [["initial model", f"{sc['initial']:.3f}", "", "", ""]]
    for side, label in (
        ("ours", "splitproof"),
        ("trl", "TRL"),
        ("ours_contiguous", "splitproof, contiguous minibatches (actor.shuffle false)"),
    ):
        if side in sc:
            held.append(
                [
                    f"{label} after {s['steps']} steps",
                    f"{sc[side]['mean']:.3f}",
                    f"{sc[side]['sd']:.3f}",
                    ", ".join(f"{v:.3f}" for v in sc[side]["values"]),
                    f"{sc[side]['train']:.3f}",
                ]
            )
    contiguous = (
        " The contiguous row is our side with verl's default minibatches — the rollout batch cut in "
        "order, so each optimizer step sees whole prompt groups — everything else as in the first row."
        if "ours_contiguous" in sc
        else ""
    )
    return [
        f"Held-out score — greedy exact match on builtin://addition/test "
        f"({'40 problems, quick' if env.quick else '500 problems'}), both final models scored by splitproof's "
        "own validation code (the last column: the mean training reward over the run's steps, for context)."
        + contiguous,
        bl.table(["model", "mean", "sd over seeds", "per seed", "training reward"], held),
    ]


def split_block(result: dict) -> list[str]:
    """The stage times at the ``SPLIT``-way micro-batch split (none when the split was not run)."""
    s, split = result["spec"], result["split_summaries"]
    if not split:
        return []
    srows = []
    for key, label in STAGE_ROWS:
        o = split["ours"]["cpu"][key]
        t = split["trl"]["cpu"][key] if "trl" in split else None
        at1 = next(r for r in result["rows"] if r["key"] == key).get("ratio")
        srows.append([label, _ms(o), _ms(t) if t is not None else "n/a", f"{o / t:.3f}" if t else "n/a", _ratio(at1)])
    micro = s["mini_batch_prompts"] * s["n"] // SPLIT
    return [
        f"At a {SPLIT}-way micro-batch split — splitproof ppo_micro_batch_size_per_gpu "
        f"{micro} (of {s['mini_batch_prompts'] * s['n']}); TRL "
        f"per_device_train_batch_size {micro} × gradient_accumulation_steps "
        f"{SPLIT} — one seed, {s['split_steps']} steps:",
        bl.table(["stage", "splitproof ms", "TRL ms", "splitproof / TRL", "ratio without the split"], srows),
    ]


def update_block(result: dict) -> list[str]:
    """How much one update moves when only the split changes, per side and loss."""
    s, rows = result["spec"], result["split_rows"]
    if not rows:
        return []
    text = (
        f"Which update changes when only the split changes — one optimizer step from the built-in model "
        f"on one rollout batch of {s['prompts_per_step']} prompts × {s['n']} samples (the whole batch is "
        "the minibatch), SGD with learning rate 1, no weight decay and no clipping, so that the update is minus "
        "the gradient (Adam's first step is sign-like and would hide a rescaling), float32; Δw at split 1 "
        "against Δw at split "
        f'{SPLIT}. "Unchanged" means below {UNCHANGED:g} relative, the float32 floor of re-ordered sums.'
    )
    headers = ["side", "loss", "layout", "same samples", "max |Δw₄ − Δw₁| / max |Δw₁|", "‖Δw₄ − Δw₁‖ / ‖Δw₁‖", "update"]
    body = [
        [
            r["side"],
            r["loss"],
            r["layout"],
            "yes" if r["same_samples"] else "NO",
            f"{r['max_rel']:.1e}",
            f"{r['norm_rel']:.1e}",
            update_word(r),
        ]
        for r in rows
    ]
    return [text, bl.table(headers, body)]


def causes(result: dict) -> list[str]:
    """Where splitproof's side is slower, attributed with numbers measured in this run."""
    g = result.get("generation")
    if not g:
        return []
    t = g["seconds"]
    rows = {r["key"]: r for r in result["rows"]}
    excess = t["ours"] - t["hf_generate"]
    padding = t["prefill_canonical"] - t["prefill_longest"]
    table = bl.table(
        ["generation of one step's samples (CPU, median over interleaved repeats)", "ms"],
        [
            ["splitproof's rollout (`HFRollout.generate`, counter-based sampling, canonical padding)", _ms(t["ours"])],
            [
                "`model.generate` on the same prompts (what TRL's `_generate` calls), left-padded to the longest",
                _ms(t["hf_generate"]),
            ],
            [
                f"prefill forward alone, prompts padded to the canonical width ({g['canonical_width']} columns)",
                _ms(t["prefill_canonical"]),
            ],
            [
                f"prefill forward alone, prompts padded to the batch's longest ({g['longest']} columns)",
                _ms(t["prefill_longest"]),
            ],
        ],
    )
    text = (
        f"Generation, attributed ({g['samples']} samples, chunks of {g['chunk']}): our rollout pads every prompt "
        f"of fewer than {g['canonical_width']} tokens to {g['canonical_width']} columns (the layout rule that makes "
        "a row's logits, and so its tokens, independent of which prompts share its batch — docs/rollout.md), "
        f"where `generate` pads to the batch's longest prompt ({g['longest']}). The prefill at the canonical width "
        f"costs {_ms(padding)} ms more than at the batch's width: {100 * padding / excess:.0f} % of our rollout's "
        f"{_ms(excess)} ms over plain `generate`; the rest is the longer KV cache in the decode steps and the "
        "per-sample bookkeeping. "
        if excess > 0
        else "Generation: our rollout is not slower than plain `generate`. "
    )
    if rows["gen"].get("ratio"):
        text += (
            f"Against TRL's whole generation stage (which also tokenizes prompts and decodes completions — our "
            f"decoding is in the reward stage, so compare generation + reward) the ratio is "
            f"{_ratio(rows['gen_reward']['ratio'])}."
        )
    return [text, table]


def update_word(row: dict) -> str:
    if math.isnan(row["max_rel"]):
        return "no update (every advantage is zero)"
    return "unchanged" if row["max_rel"] <= UNCHANGED else "changed"


def goal_rows(result: dict) -> list[list[str]]:
    rows = []
    step = next(r for r in result["rows"] if r["key"] == "total").get("ratio")
    if step:
        rows.append(
            [
                "step time splitproof / TRL ≤ 1.0",
                f"{step['median']:.3f} ({step['low']:.3f}–{step['high']:.3f})",
                bl.verdict(step["median"], 1.0),
            ]
        )
    sc = result["score"]
    if "trl" in sc:
        spread = max(sc["ours"]["sd"], sc["trl"]["sd"])
        gap = sc["ours"]["mean"] - sc["trl"]["mean"]
        rows.append(
            [
                "held-out score not lower than TRL's beyond the seed spread",
                f"{gap:+.3f} (larger sd {spread:.3f})",
                "met" if gap >= -spread else f"missed by {-gap - spread:.3f}",
            ]
        )
    ours = [r for r in result["split_rows"] if r["side"] == "splitproof"]
    if ours:
        rows.append(
            [
                f"our update unchanged by the split (≤ {UNCHANGED:g} relative)",
                f"{ours[0]['max_rel']:.1e}",
                "missed (the samples differ)"
                if not ours[0]["same_samples"]
                else "met"
                if update_word(ours[0]) == "unchanged"
                else f"missed ({update_word(ours[0])})",
            ]
        )
    return rows
