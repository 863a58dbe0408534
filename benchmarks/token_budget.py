"""Token budget vs fixed microbatches on a long-tailed length mix: padding share and throughput.

The rollout batch has log-normal response lengths (a few long answers, many short ones) and prompts of
varying length. `fixed` cuts the minibatch into consecutive microbatches of a fixed row count (the rows
in rollout order); `budget` is the engine's token budget (use_dynamic_bsz) set to the same worst case,
rows × longest possible sequence. Computed tokens are what the engine feeds the model: per microbatch,
rows × its trimmed width (prompt columns from the first non-padding one, response columns up to the last
non-padding one). Throughput counts the real tokens (prompt + response) per second of an update step.

    python benchmarks/token_budget.py [--quick] [--device cuda] [--repeats N] [--threads N]
"""

from __future__ import annotations

import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl

NAME = "token_budget"
GOAL_PADDING = 0.05
GOAL_THROUGHPUT = 1.3


def long_tailed_rollout(
    model, num: int, prompt_width: int, response_width: int, *, median: float, sigma: float, seed: int
):
    """A RolloutBatch with log-normal response lengths (clipped to [1, response_width]) and prompt
    lengths uniform in [prompt_width // 2, prompt_width]; old log-probs are the model's plus noise."""
    from splitproof.batch import RolloutBatch
    from splitproof.diagnose.synthetic import group_advantages
    from splitproof.engine.logprobs import compute_log_probs
    from splitproof.hf_models import vocab_size_of

    g = torch.Generator().manual_seed(seed)
    B, P, T = num, prompt_width, response_width
    vocab = vocab_size_of(model)
    param = next(model.parameters())
    dtype, device = param.dtype, param.device
    resp_len = torch.exp(math.log(median) + sigma * torch.randn(B, generator=g, dtype=torch.float64))
    resp_len = resp_len.round().clamp(1, T).long()
    prompt_len = torch.randint(max(1, P // 2), P + 1, (B,), generator=g)
    prompt_att = torch.arange(P)[None, :] >= (P - prompt_len)[:, None]
    resp_att = torch.arange(T)[None, :] < resp_len[:, None]
    rewards = torch.randint(0, 2, (B,), generator=g).double()
    advantages = torch.where(resp_att, group_advantages(rewards, 4)[:, None].expand(B, T), 0.0)
    batch = RolloutBatch(
        prompts=(torch.randint(0, vocab, (B, P), generator=g) * prompt_att).to(device),
        responses=(torch.randint(0, vocab, (B, T), generator=g) * resp_att).to(device),
        attention_mask=torch.cat([prompt_att, resp_att], 1).long().to(device),
        response_mask=resp_att.long().to(device),
        old_log_probs=torch.zeros(B, T, dtype=dtype, device=device),
        advantages=advantages.to(dtype=dtype, device=device),
    )
    logp, _ = compute_log_probs(model, batch, micro_batch_size=min(B, 16))
    noise = 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    batch.old_log_probs = torch.where(resp_att, logp.double().cpu() + noise, 0.0).to(dtype=dtype, device=device)
    return batch


def computed_tokens(batch, microbatches) -> dict:
    """Rows × trimmed width per microbatch, split into real tokens, prompt padding and response padding."""
    att = batch.attention_mask.bool().cpu()
    P = batch.prompt_width
    total = prompt_pad = resp_pad = real = contiguous = 0
    largest = 0
    for rows in microbatches:
        a = att[rows]
        cols = a[:, :P].any(0).nonzero()
        p_width = P - int(cols[0]) if len(cols) else 0
        rcols = a[:, P:].any(0).nonzero()
        r_width = int(rcols[-1]) + 1 if len(rcols) else 0
        n = len(rows)
        total += n * (p_width + r_width)
        prompt_real = int(a[:, :P].sum())
        resp_real = int(a[:, P:].sum())
        prompt_pad += n * p_width - prompt_real
        resp_pad += n * r_width - resp_real
        real += prompt_real + resp_real
        largest = max(largest, n * (p_width + r_width))
        contiguous += n * int(a.sum(1).max())  # rows stored as [prompt, response, padding]
    return dict(
        computed=total,
        real=real,
        prompt_padding=prompt_pad,
        response_padding=resp_pad,
        padding_share=1 - real / total,
        largest_microbatch=largest,
        contiguous_share=1 - real / contiguous,
    )


def packed_tokens(batch, microbatches) -> dict:
    """Packed rows × their width per microbatch (use_remove_padding): padding is what bin packing leaves."""
    from splitproof.engine.packing import packed_cost

    lengths = batch.attention_mask.sum(1).tolist()
    costs = [packed_cost([int(lengths[r]) for r in rows]) for rows in microbatches]
    real = sum(int(lengths[r]) for rows in microbatches for r in rows)
    total = sum(costs)
    return dict(
        computed=total,
        real=real,
        prompt_padding=None,
        response_padding=None,
        padding_share=1 - real / total,
        largest_microbatch=max(costs),
        contiguous_share=1 - real / total,
    )


BUDGET_FRACTIONS = (1.0, 0.5, 0.25)


def split_rows(configs: dict, stats: dict, times, micro: int) -> list[dict]:
    """One row per split: its microbatches and tokens (``stats``), its step time and throughput against the
    fixed split (``times``, interleaved)."""
    rows = []
    for name, config in configs.items():
        s = stats[name]
        ratio = bl.Ratio.paired(times["fixed"], times[name])  # t_fixed / t_variant = throughput ratio
        label = (
            f"fixed, {micro} sequences"
            if name == "fixed"
            else f"{'packed, ' if config.use_remove_padding else ''}token budget {config.ppo_max_token_len_per_gpu}"
        )
        rows.append(
            dict(
                split=name,
                label=label,
                packed=config.use_remove_padding,
                budget=None if name == "fixed" else config.ppo_max_token_len_per_gpu,
                microbatches=s["microbatches"],
                computed=s["computed"],
                real=s["real"],
                prompt_padding=s["prompt_padding"],
                response_padding=s["response_padding"],
                padding_share=s["padding_share"],
                largest=s["largest_microbatch"],
                contiguous_share=s["contiguous_share"],
                step_s=bl.median(times[name]),
                wall_s=bl.median(times.wall[name]),
                tokens_per_s=s["real"] / bl.median(times[name]),
                throughput_ratio=ratio.median,
                q1=ratio.q1,
                q3=ratio.q3,
            )
        )
    return rows


def run(env: bl.Env) -> dict:
    from splitproof.engine.plan import plan_update
    from splitproof.engine.update import update_policy
    from splitproof.engine.update_config import UpdateConfig
    from splitproof.loss_config import LossConfig

    if env.quick:
        B, P, T, micro, median, sigma = 16, 8, 32, 4, 6.0, 1.0
    else:
        B, P, T, micro, median, sigma = 64, 32, 256, 8, 48.0, 1.0
    worst = micro * (P + T)
    budgets = [max(P + T, int(worst * f)) for f in BUDGET_FRACTIONS]
    model = bm.bench_model(env)
    batch = long_tailed_rollout(model, B, P, T, median=median, sigma=sigma, seed=3)
    valid = batch.validate()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = bm.WeightSnapshot(model)
    loss = LossConfig()
    configs = {"fixed": UpdateConfig(loss=loss, ppo_mini_batch_size=B, ppo_micro_batch_size_per_gpu=micro)}
    for budget in budgets:
        configs[f"budget {budget}"] = UpdateConfig(
            loss=loss, ppo_mini_batch_size=B, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget
        )
    for budget in budgets:
        configs[f"packed {budget}"] = UpdateConfig(
            loss=loss,
            ppo_mini_batch_size=B,
            use_dynamic_bsz=True,
            ppo_max_token_len_per_gpu=budget,
            use_remove_padding=True,
        )
    stats = {}
    for name, config in configs.items():
        mbs = [mb for mb in plan_update(valid, config, 1, 0)[0].microbatches if mb]
        count = computed_tokens if not config.use_remove_padding else packed_tokens
        stats[name] = count(valid, mbs) | dict(microbatches=len(mbs))
    bl.log(f"[{NAME}] microbatches: " + ", ".join(f"{n} {s['microbatches']}" for n, s in stats.items()))
    variants = {name: (lambda c=config: update_policy(model, optimizer, batch, c)) for name, config in configs.items()}
    times = bl.interleaved(variants, repeats=env.repeats, env=env, prepare=snapshot.restore)
    rows = split_rows(configs, stats, times, micro)
    same = rows[1]  # the padded budget with the fixed split's worst case
    packed = rows[1 + len(budgets)]  # the packed budget with the same worst case
    lengths = valid.response_mask.sum(1).float()
    return dict(
        rows=rows,
        worst=worst,
        micro=micro,
        model=bm.describe_model(model),
        sequences=B,
        prompt=P,
        response=T,
        median=median,
        sigma=sigma,
        length_stats=dict(
            mean=float(lengths.mean()),
            median=float(lengths.median()),
            p90=float(lengths.quantile(0.9)),
            max=int(lengths.max()),
            clipped=int((lengths == T).sum()),
        ),
        throughput_ratio=same["throughput_ratio"],
        padding_share=same["padding_share"],
        padding_ok=packed["padding_share"] <= GOAL_PADDING,
        throughput_ok=packed["throughput_ratio"] >= GOAL_THROUGHPUT,
        clock=times.clock,
        budgets=len(budgets),
    )


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    headers = [
        "microbatches",
        "count",
        "computed tokens",
        "real tokens",
        "prompt padding",
        "response padding",
        "padding share",
        "padding share if rows were contiguous",
        "largest microbatch (computed tokens)",
        "largest / budget",
        "step ms",
        "step ms (wall)",
        "real tokens / s",
        "throughput vs fixed",
    ]
    dash = lambda v: "—" if v is None else v  # noqa: E731
    rows = [
        [
            r["label"],
            r["microbatches"],
            r["computed"],
            r["real"],
            dash(r["prompt_padding"]),
            dash(r["response_padding"]),
            f"{100 * r['padding_share']:.1f} %",
            f"{100 * r['contiguous_share']:.1f} %",
            r["largest"],
            "—" if r["budget"] is None else f"{r['largest'] / r['budget']:.3f}",
            bl.ms(r["step_s"]),
            bl.ms(r["wall_s"]),
            f"{r['tokens_per_s']:.0f}",
            f"{r['throughput_ratio']:.2f} ({r['q1']:.2f}–{r['q3']:.2f})",
        ]
        for r in result["rows"]
    ]
    goal_rows = []
    for kind, row in (("padded", result["rows"][1]), ("packed", result["rows"][1 + result["budgets"]])):
        goal_rows += [
            [
                f"{kind}: padding share ≤ {100 * GOAL_PADDING:.0f} %",
                f"{100 * row['padding_share']:.1f} %",
                bl.verdict(row["padding_share"], GOAL_PADDING, digits=1, scale=100, unit=" percentage points"),
            ],
            [
                f"{kind}: throughput budget / fixed ≥ {GOAL_THROUGHPUT}",
                f"{row['throughput_ratio']:.2f} (IQR {row['q1']:.2f}–{row['q3']:.2f})",
                bl.verdict(row["throughput_ratio"], GOAL_THROUGHPUT, at_most=False, digits=2),
            ],
        ]
    goals = bl.table(["goal (budget = the fixed split's worst case)", "measured", "verdict"], goal_rows)
    ls = result["length_stats"]
    setup = (
        f"Setup: {result['model']}; one optimizer step over {result['sequences']} sequences; prompts "
        f"uniform in [{result['prompt'] // 2}, {result['prompt']}] tokens; response lengths log-normal "
        f"(median {result['median']:g}, σ {result['sigma']:g}, clipped to [1, {result['response']}]): "
        f"mean {ls['mean']:.1f}, median {ls['median']:.0f}, 90th percentile {ls['p90']:.0f}, max {ls['max']} "
        f"({ls['clipped']} at the cap). The first budget equals the fixed split's worst case "
        f"({result['micro']} × {result['prompt'] + result['response']} = {result['worst']}), the others are "
        f"half and a quarter of it. Throughput vs fixed = median of the per-repeat t_fixed / t_budget "
        f"(IQR in brackets). 'If rows were contiguous': the padding share the same microbatches would have if each "
        f"row held its prompt and response back to back, right-padded to the microbatch's longest sequence "
        f"(computed, not timed). 'packed': use_remove_padding, the microbatch's sequences first-fit into rows "
        f"twice as wide as its longest sequence, block-diagonal attention; computed tokens = packed rows × width. "
        f"{bl.clock_note(result['clock'])}"
    )
    return bl.section(
        NAME, "Token budget vs fixed microbatches", command, env, load_before, [setup, bl.table(headers, rows), goals]
    )


def main(argv: list[str] | None = None) -> dict:
    args = bl.parser(__doc__.splitlines()[0], repeats=7).parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
