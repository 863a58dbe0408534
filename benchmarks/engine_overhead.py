"""Engine overhead: one `update_policy` step against a plain hand-written loop over the same microbatches.

The plain loop is what anyone would write with no statistics and no bookkeeping: per microbatch the model
forward (trimmed to the microbatch's real width, logits only for the response positions, as the engine
does), log-softmax + gather, a simple importance-weighted PG loss (−A·exp(log π − log π_old)) normalised
by the minibatch's token count (token-mean) or by n_i·G (seq-mean-token-mean), backward; then clip and
step. The engine runs its full path: validation, plan, minibatch statistics, the PPO-clip loss with
its metric shares, metric reduction. Both see the same model (weights restored before every call), the
same rollout batch and the same microbatches (the engine's plan), interleaved within every repeat.

    python benchmarks/engine_overhead.py [--quick] [--device cuda] [--repeats N] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl

NAME = "engine_overhead"
GOAL = 1.05
MODES = ("token-mean", "seq-mean-token-mean")


def plain_step(model, optimizer, batch, microbatches, agg_mode: str, grad_clip: float) -> None:
    """The baseline: forward, log-softmax gather, PG loss, backward per microbatch; clip; step."""
    optimizer.zero_grad(set_to_none=True)
    mask = batch.response_mask.bool()
    lengths = mask.sum(dim=1)
    num_tokens = lengths.sum()
    num_seqs = (lengths > 0).sum()
    P = batch.prompt_width
    for rows in microbatches:
        idx = torch.as_tensor(rows, device=mask.device)
        att = batch.attention_mask.index_select(0, idx).bool()
        cols = att[:, :P].any(0).nonzero()
        p0 = int(cols[0])
        t1 = int(att[:, P:].any(0).nonzero()[-1]) + 1
        ids = torch.cat([batch.prompts.index_select(0, idx)[:, p0:], batch.responses.index_select(0, idx)[:, :t1]], 1)
        am = torch.cat([att[:, p0:P], att[:, P : P + t1]], 1).long()
        pos = (am.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids, attention_mask=am, position_ids=pos, use_cache=False, logits_to_keep=t1 + 1
        ).logits[:, :-1]
        logp = logits.log_softmax(-1).gather(-1, ids[:, -t1:].unsqueeze(-1)).squeeze(-1)
        m = mask.index_select(0, idx)[:, :t1]
        adv = batch.advantages.index_select(0, idx)[:, :t1]
        old = batch.old_log_probs.index_select(0, idx)[:, :t1]
        token_loss = -adv * torch.exp(logp - old)
        if agg_mode == "token-mean":
            weights = m / num_tokens
        else:
            weights = m / (lengths.index_select(0, idx)[:, None].clamp(min=1) * num_seqs)
        loss = torch.where(m, token_loss * weights, torch.zeros_like(token_loss)).sum()
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()


class _LogitsOnly(torch.nn.Module):
    """A stand-in model whose forward returns fixed logits: times the engine's log-prob head alone."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, use_cache=False, logits_to_keep=0):
        return self.logits[:, -logits_to_keep:] if logits_to_keep else self.logits


def head_timings(env: bl.Env, part) -> dict:
    """Forward+backward of the log-prob head on one microbatch's logits: the engine's
    ``response_log_probs`` against ``log_softmax`` + gather (what the plain loop does)."""
    from splitproof.engine.logprobs import response_log_probs

    t1 = int(part.response_mask.any(0).nonzero()[-1]) + 1
    g = torch.Generator(device="cpu").manual_seed(7)
    vocab = bm.bench_model_sizes(env)["vocab_size"]
    logits = torch.randn(len(part), t1 + 1, vocab, generator=g).to(device=env.device, dtype=env.dtype)
    fake = _LogitsOnly(logits)
    tokens = part.responses[:, :t1].unsqueeze(-1)

    def engine_head():
        fake.logits.grad = None
        lp, _ = response_log_probs(fake, part)
        lp.sum().backward()

    def plain_head():
        fake.logits.grad = None
        lp = fake.logits[:, :-1].log_softmax(-1).gather(-1, tokens).squeeze(-1)
        torch.where(part.response_mask[:, :t1], lp, torch.zeros_like(lp)).sum().backward()

    times = bl.interleaved({"engine": engine_head, "plain": plain_head}, repeats=max(5, 3 * env.repeats), env=env)
    return dict(
        shape=tuple(logits[:, :-1].shape),
        engine_s=bl.median(times["engine"]),
        plain_s=bl.median(times["plain"]),
        ratio=bl.Ratio.paired(times["engine"], times["plain"]).median,
    )


def run(env: bl.Env) -> dict:
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine.plan import plan_update
    from splitproof.engine.update import update_policy
    from splitproof.engine.update_config import UpdateConfig
    from splitproof.loss_config import LossConfig

    B, P, T, micro = (16, 8, 16, 4) if env.quick else (64, 32, 160, 8)
    budget = micro * (P + T)
    model = bm.bench_model(env)
    batch = synthetic_rollout(model, B, P, T, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = bm.WeightSnapshot(model)
    valid = batch.validate()
    splits = {
        f"fixed, {micro} sequences": dict(ppo_micro_batch_size_per_gpu=micro),
        f"token budget {budget}": dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=budget),
    }
    rows = []
    for mode in MODES:
        for split_name, split in splits.items():
            config = UpdateConfig(loss=LossConfig(loss_agg_mode=mode), ppo_mini_batch_size=B, **split)
            microbatches = [mb for mb in plan_update(valid, config, 1, 0)[0].microbatches if mb]
            variants = {
                "engine": lambda c=config: update_policy(model, optimizer, batch, c),
                "plain": lambda m=microbatches, a=mode, c=config: plain_step(
                    model, optimizer, valid, m, a, c.grad_clip
                ),
            }
            bl.log(f"[{NAME}] {mode} / {split_name}: {len(microbatches)} microbatches")
            times = bl.interleaved(variants, repeats=env.repeats, env=env, prepare=snapshot.restore)
            ratio = bl.Ratio.paired(times["engine"], times["plain"])
            rows.append(
                dict(
                    mode=mode,
                    split=split_name,
                    microbatches=len(microbatches),
                    engine_s=bl.median(times["engine"]),
                    plain_s=bl.median(times["plain"]),
                    engine_wall_s=bl.median(times.wall["engine"]),
                    plain_wall_s=bl.median(times.wall["plain"]),
                    ratio=ratio.median,
                    q1=ratio.q1,
                    q3=ratio.q3,
                    goal_met=ratio.median <= GOAL,
                    clock=times.clock,
                )
            )
    bl.log(f"[{NAME}] log-prob head alone")
    head = head_timings(env, valid.select(list(range(micro))))
    fixed = [r for r in rows if r["split"].startswith("fixed")]
    head["step_share"] = bl.median(
        [(head["engine_s"] - head["plain_s"]) * r["microbatches"] / r["plain_s"] for r in fixed]
    )
    return dict(
        rows=rows,
        head=head,
        model=bm.describe_model(model),
        sequences=B,
        prompt=P,
        response=T,
        valid_tokens=int(valid.response_mask.sum()),
        clock=rows[0]["clock"],
    )


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    headers = [
        "loss_agg_mode",
        "microbatches",
        "count",
        "engine ms",
        "plain ms",
        "engine / plain",
        "paired-ratio IQR",
        "engine ms (wall)",
        "plain ms (wall)",
        f"goal ≤ {GOAL}",
    ]
    body = [
        bl.table(
            headers,
            [
                [
                    r["mode"],
                    r["split"],
                    r["microbatches"],
                    bl.ms(r["engine_s"]),
                    bl.ms(r["plain_s"]),
                    f"{r['ratio']:.3f}",
                    f"{r['q1']:.3f}–{r['q3']:.3f}",
                    bl.ms(r["engine_wall_s"]),
                    bl.ms(r["plain_wall_s"]),
                    bl.verdict(r["ratio"], GOAL),
                ]
                for r in result["rows"]
            ],
        )
    ]
    setup = (
        f"Setup: {result['model']}; one optimizer step over {result['sequences']} sequences (prompts ≤ "
        f"{result['prompt']}, responses uniform in [1, {result['response']}], {result['valid_tokens']} "
        f"valid response tokens), loss_mode vanilla, SGD. Times are medians over the repeats; the ratio "
        f"is the median of the per-repeat engine/plain ratios. {bl.clock_note(result['clock'])}"
    )
    h = result["head"]
    head_table = bl.table(
        [
            "logits [b, T, V]",
            "engine head ms",
            "log_softmax + gather ms",
            "engine / log_softmax",
            "extra per step (share of a plain step, fixed split)",
        ],
        [
            [
                " × ".join(map(str, h["shape"])),
                f"{h['engine_s'] * 1e3:.2f}",
                f"{h['plain_s'] * 1e3:.2f}",
                f"{h['ratio']:.2f}",
                f"{100 * h['step_share']:.1f} %",
            ]
        ],
    )
    head_text = (
        "Attribution — the log-prob head alone, forward + backward on one fixed microbatch's logits: "
        "`splitproof.engine.logprobs.response_log_probs` (on a stand-in model that returns the logits) "
        "against `log_softmax` + `gather`."
    )
    return bl.section(NAME, "Engine overhead", command, env, load_before, [setup] + body + [head_text, head_table])


def main(argv: list[str] | None = None) -> dict:
    args = bl.parser(__doc__.splitlines()[0], repeats=9).parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
