"""The flags of ``splitproof diagnose``: which scenario accepts which flag, and each scenario's help page.

One table (:data:`OPTIONS`) says, per flag, the scenarios that honour it; the parser, the refusal of a
flag a scenario does not honour, and ``splitproof diagnose SCENARIO --help`` are all built from it.
``default`` is a run without a scenario name (gmpo and klcov, or a custom scenario when any of the
custom or step flags is given).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from .arguments import (
    OneLineParser,
    UsageError,
    finite_float,
    flag,
    nonnegative_float,
    nonnegative_int,
    positive_float,
    positive_int,
)

SCENARIOS = ("gmpo", "klcov", "sweep", "value", "audit")
DIAGNOSIS = ("default", "gmpo", "klcov", "sweep", "value")  # the runs that update a model
STEP = ("default", "gmpo", "klcov", "value")  # the runs whose step settings and splits may be changed
EVERY = DIAGNOSIS + ("audit",)

MODEL = "model and numerics"
CUSTOM = "custom scenario (no SCENARIO name; unset flags take the defaults shown)"
STEP_GROUP = "step and splits (custom scenario, gmpo, klcov, value)"
OUTPUT = "output"
AUDIT = "audit (SCENARIO = audit)"
GROUPS = ("help", MODEL, CUSTOM, STEP_GROUP, OUTPUT, AUDIT)


@dataclass(frozen=True)
class Option:
    flags: tuple[str, ...]
    group: str
    accepted_by: tuple[str, ...]
    kwargs: dict = field(default_factory=dict)
    audit_help: str | None = None  # the audit reads some flags differently

    @property
    def dest(self) -> str:
        return self.flags[-1].lstrip("-").replace("-", "_")


def _opt(*flags: str, group: str, by: tuple[str, ...], audit_help: str | None = None, **kwargs) -> Option:
    return Option(flags, group, by, kwargs, audit_help)


OPTIONS = (
    _opt(
        "-h",
        "--help",
        group="help",
        by=EVERY,
        action="store_true",
        help="show this help; after a SCENARIO name, that scenario's runs and flags",
    ),
    _opt(
        "--model",
        group=MODEL,
        by=DIAGNOSIS,
        metavar="PATH",
        help="local Hugging Face checkpoint (default: embedded tiny random Llama)",
    ),
    _opt(
        "--trust-remote-code",
        group=MODEL,
        by=DIAGNOSIS,
        action="store_true",
        help="allow the checkpoint's own modelling code (only with --model)",
    ),
    _opt(
        "--dtype",
        group=MODEL,
        by=DIAGNOSIS,
        choices=("float32", "float64", "bfloat16"),
        help="model dtype (default float32; float64 is the exactness run)",
    ),
    _opt("--device", group=MODEL, by=DIAGNOSIS, help="cpu (default) or cuda[:N]; dp splits run on CPU"),
    _opt(
        "--seed",
        group=MODEL,
        by=EVERY,
        type=nonnegative_int,
        default=0,
        help="model init and rollout seed (default 0)",
        audit_help="seed of the synthetic minibatch (default 0)",
    ),
    _opt(
        "--threads",
        group=MODEL,
        by=EVERY,
        type=positive_int,
        help="torch CPU threads (default: 1 for the embedded model, torch's default otherwise)",
        audit_help="torch CPU threads (default: torch's default)",
    ),
    _opt(
        "--lora-rank",
        group=MODEL,
        by=("default", "gmpo", "klcov", "sweep"),
        type=positive_int,
        metavar="R",
        help="train a LoRA adapter of rank R on the model (all linear layers, lora_alpha 16, drawn from --seed; "
        "needs the extra 'lora') instead of every weight (default: full fine-tuning)",
    ),
    _opt(
        "--dp-wrapper",
        group=MODEL,
        by=DIAGNOSIS,
        choices=("ddp", "fsdp2"),
        help="wrapper for dp:D splits (default ddp; only where a dp:D split runs)",
    ),
    _opt(
        "--loss-mode",
        group=CUSTOM,
        by=("default", "audit"),
        metavar="MODE",
        help="policy loss (default vanilla)",
        audit_help="written into config.policy_loss.loss_mode (functions that dispatch on it read it there)",
    ),
    _opt(
        "--agg-mode",
        group=CUSTOM,
        by=("default", "audit"),
        metavar="MODE",
        help="loss_agg_mode (default token-mean)",
        audit_help="the loss_agg_mode argument and config field (default token-mean)",
    ),
    _opt(
        "--sequences", group=CUSTOM, by=("default",), type=positive_int, help="sequences in the minibatch (default 8)"
    ),
    _opt(
        "--response-length",
        group=CUSTOM,
        by=("default",),
        type=positive_int,
        help="response tokens per sequence, max (default 16)",
    ),
    _opt(
        "--prompt-length",
        group=CUSTOM,
        by=("default",),
        type=positive_int,
        help="prompt tokens per sequence, max (default 8)",
    ),
    _opt(
        "--kl-cov-ratio",
        group=CUSTOM,
        by=("default",),
        type=positive_float,
        help="kl_cov_ratio, in (0, 1] (default 2e-4; only with --loss-mode kl_cov)",
    ),
    _opt(
        "--clip-cov-ratio",
        group=CUSTOM,
        by=("default",),
        type=positive_float,
        help="clip_cov_ratio, in (0, 1] (default 2e-4; only with --loss-mode clip_cov)",
    ),
    _opt(
        "--kl-loss-coef",
        group=CUSTOM,
        by=("default",),
        type=nonnegative_float,
        help="KL loss (low_var_kl against the reference log-probs) with this coefficient, >= 0 "
        "(default: no KL loss; 0 turns it off)",
    ),
    _opt(
        "--entropy-coeff",
        group=CUSTOM,
        by=("default",),
        type=finite_float,
        help="entropy coefficient, any finite number as verl's entropy_coeff: the objective subtracts "
        "coeff x entropy, so > 0 rewards entropy (a bonus) and < 0 penalises it (default 0: no entropy term)",
    ),
    _opt(
        "--split",
        group=STEP_GROUP,
        by=STEP,
        action="append",
        metavar="SPLIT",
        help="a split to compare (repeatable; replaces the scenario's splits; see split specs)",
    ),
    _opt("--lr", group=STEP_GROUP, by=STEP, type=positive_float, help="learning rate (default 0.02)"),
    _opt(
        "--grad-clip",
        group=STEP_GROUP,
        by=STEP,
        type=positive_float,
        help="gradient clipping by total norm (default 1.0; klcov 0.05)",
    ),
    _opt("--optimizer", group=STEP_GROUP, by=STEP, choices=("sgd", "adamw"), help="optimizer (default sgd)"),
    _opt(
        "--cov-strategy",
        group=STEP_GROUP,
        by=("default", "klcov"),
        choices=("auto", "prepass", "deferred", "microbatch"),
        help="how KL-Cov/Clip-Cov get their minibatch selection (default auto; microbatch = legacy, fails); "
        "klcov or --loss-mode kl_cov/clip_cov only",
    ),
    _opt(
        "--statistics-scope",
        group=STEP_GROUP,
        by=STEP,
        choices=("minibatch", "microbatch"),
        help="the candidate's statistics (microbatch reproduces other frameworks' behaviour, and fails)",
    ),
    _opt(
        "--json",
        group=OUTPUT,
        by=EVERY,
        metavar="PATH",
        help="write the full record as JSON; '-' writes it to stdout (the report then goes to stderr)",
    ),
    _opt(
        "--plot",
        group=OUTPUT,
        by=DIAGNOSIS,
        metavar="PATH",
        help="plot the gradient and update differences with their bounds; .png, .pdf or .svg (needs matplotlib)",
    ),
    _opt(
        "--scope",
        group=OUTPUT,
        by=DIAGNOSIS,
        choices=("minibatch", "microbatch"),
        help="microbatch: add the legacy column (per-microbatch statistics); minibatch: leave it out "
        "(default: shown for gmpo, klcov, sweep and value)",
    ),
    _opt(
        "--no-progress",
        group=OUTPUT,
        by=EVERY,
        action="store_true",
        help="no progress bar on stderr (nor the model-loading bar of transformers)",
        audit_help="accepted (the audit shows no progress bar)",
    ),
    _opt(
        "--loss-fn",
        group=AUDIT,
        by=("audit",),
        metavar="MODULE:FUNCTION",
        help="the policy-loss function to audit: package.module:function or path/to/file.py:function",
    ),
    _opt(
        "--convention",
        group=AUDIT,
        by=("audit",),
        choices=("verl",),
        help="calling convention of the function (default verl)",
    ),
)

CUSTOM_FLAGS = tuple(o.dest for o in OPTIONS if o.group == CUSTOM)
STEP_FLAGS = tuple(o.dest for o in OPTIONS if o.group == STEP_GROUP)


def add_options(parser: argparse.ArgumentParser, scenario: str | None = None) -> None:
    """Add every option (``scenario`` None), or only those ``scenario`` accepts, grouped as in the table."""

    def group_of(o: Option) -> str:
        return AUDIT if scenario == "audit" and o.audit_help and o.group == CUSTOM else o.group

    for name in GROUPS:
        chosen = [o for o in OPTIONS if group_of(o) == name and (scenario is None or scenario in o.accepted_by)]
        if not chosen:
            continue
        group = parser if name == "help" else parser.add_argument_group(name)
        for o in chosen:
            kwargs = dict(o.kwargs)
            if scenario == "audit" and o.audit_help:
                kwargs["help"] = o.audit_help
            group.add_argument(*o.flags, **kwargs)


def given(args: argparse.Namespace, names) -> list[str]:
    """The destinations among ``names`` that were set on the command line."""
    defaults = {o.dest: o.kwargs.get("default") for o in OPTIONS}
    return [n for n in names if getattr(args, n) not in (None, False, defaults.get(n))]


_NO_MODEL = "the audit needs no model: it calls the function on float64 log-prob tensors on the CPU"


def refuse_unaccepted(args: argparse.Namespace) -> None:
    """A one-line :class:`UsageError` for the first flag that the chosen scenario does not honour."""
    scenario = args.scenario or "default"
    for o in OPTIONS:
        if scenario in o.accepted_by or o.dest == "help" or not given(args, [o.dest]):
            continue
        name = flag(o.dest)
        if scenario == "audit":
            why = (
                _NO_MODEL
                if o.group == MODEL
                else "it takes "
                + ", ".join(flag(x.dest) for x in OPTIONS if "audit" in x.accepted_by and x.dest != "help")
            )
            raise UsageError(f"{name} does not apply to audit ({why})")
        if "audit" in o.accepted_by and "default" not in o.accepted_by:
            raise UsageError(f"{name} is for the audit scenario: splitproof diagnose audit {name} ...")
        if o.group == CUSTOM:
            raise UsageError(f"{name} defines a custom scenario; drop the scenario name {scenario!r} to use it")
        if scenario == "sweep":
            raise UsageError(f"{name} does not apply to the sweep (it runs fixed splits and settings)")
        if o.dest == "cov_strategy":
            runs = "the critic's value loss" if scenario == "value" else "geo_mean"
            raise UsageError(
                f"{name} applies to KL-Cov/Clip-Cov (klcov, or --loss-mode kl_cov/clip_cov); {scenario} runs {runs}"
            )
        raise UsageError(f"{name} does not apply to {scenario}")  # pragma: no cover - every case is named above


# ------------------------------------------------------------------------------------------ help pages


def scenario_help(scenario: str) -> str:
    """``splitproof diagnose SCENARIO --help``: what the scenario runs, and the flags it accepts."""
    parser = OneLineParser(
        prog=f"splitproof diagnose {scenario}",
        add_help=False,
        description=_describe(scenario),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_options(parser, scenario)
    return parser.format_help()


def _describe(scenario: str) -> str:
    if scenario == "audit":
        return _describe_audit()
    from splitproof.diagnose import scenarios as sc

    if scenario == "sweep":
        runs = sc.sweep(0)
        first = runs[0]
        from splitproof.loss_config import AGG_MODES, LOSS_MODES

        lines = [
            f"Every loss mode x every aggregation mode ({len(LOSS_MODES)} x {len(AGG_MODES)} = {len(runs)} "
            "scenarios), one update each,",
            "rerun under each split and compared with one microbatch on one rank:",
            f"  loss modes:  {', '.join(LOSS_MODES)}",
            f"  aggregation: {', '.join(AGG_MODES)}",
            f"  batch:       {first.batch.sequences} sequences x {first.batch.response_length} response tokens, "
            "rollout IS weights,",
            "               prompt groups of 4 (the group ids group-mean-token-mean needs),",
            "               KL loss 0.01 and entropy 0.01 on (so every aggregation mode matters)",
            "  splits:      " + ", ".join(f"{kind}={spec}" for kind, spec in zip(first.columns, first.splits)),
            "  control:     per mode, the same comparison with the split-sensitive term disabled",
            f"  legacy:      {first.legacy_note} (--scope minibatch leaves it out)",
            "Only the model, numerics and output flags apply: the sweep's splits and settings are fixed.",
        ]
        return "\n".join(lines) + _FOOTER
    one = {"gmpo": sc.gmpo, "klcov": sc.klcov, "value": sc.value}[scenario](0)
    reruns = [f"Reruns {one.upstream.ref}: {one.upstream.summary}", f"  {one.upstream.url}"] if one.upstream else []
    lines = reruns + [
        f"{one.title}.",
        "One update, rerun under each split and compared with one microbatch on one rank:",
        f"  splits:  {', '.join(one.splits)} (--split replaces them)",
        f"  control: {one.control_note}",
        f"  legacy:  {one.legacy_note} — the verl convention, not splitproof's verdict (--scope minibatch "
        "leaves it out)",
        "The loss and batch are fixed (the custom-scenario flags need no scenario name); the step settings",
        "and the splits may be changed.",
    ]
    return "\n".join(lines) + _FOOTER


_FOOTER = (
    "\n\nverdict: pass iff the gradient's and the update's relative differences are <= max(16 x the "
    "control's, 64 x eps(dtype))\nand the objective is within the reference's precision floor. "
    "See docs/diagnose.md.\nexit status: 0 all pass, 1 a verdict fails, 2 bad usage."
)


def _describe_audit() -> str:
    from splitproof.diagnose.audit import SPLIT_KINDS

    return (
        "Audit a third-party policy-loss function written for verl's calling convention,\n"
        "  fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)"
        " -> (loss, metrics),\n"
        "called as verl's FSDP engine calls it: once per microbatch, with config.global_batch_info (dp_size,\n"
        "batch_num_tokens, global_batch_size, loss_scale_factor) filled for the whole minibatch, backward() on\n"
        "each loss, gradients averaged over DP ranks. It runs on a synthetic float64 minibatch (16 sequences x\n"
        "24 tokens, no model) and compares the gradient w.r.t. log_prob accumulated over each split\n"
        f"({', '.join(SPLIT_KINDS)}) with one call on the whole minibatch, next to an invariant control.\n\n"
        "A split-invariant loss normalises by the minibatch's figures in global_batch_info (batch_num_tokens\n"
        "for token means, global_batch_size for sequence means), never by the microbatch's own counts or a\n"
        "torch.mean, and multiplies by dp_size (DDP/FSDP average the ranks' gradients). See docs/audit-verl.md.\n\n"
        "exit status: 0 split-invariant, 1 not, 2 the function cannot be loaded or fails on the whole minibatch."
    )
