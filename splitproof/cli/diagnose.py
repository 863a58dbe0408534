"""``splitproof diagnose``: rerun one update under different splits and compare (see docs/diagnose.md).

Exit status: 0 when every verdict passes, 1 when one fails, 2 on bad usage (a one-line message on stderr,
never a traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from contextlib import contextmanager

from . import diagnose_options as opts
from .arguments import EXIT_FAIL, EXIT_PASS, STDOUT, UsageError, check_output_path, output_stream

DIAGNOSE_DESCRIPTION = """\
Rerun one policy (or critic) update of the same optimizer minibatch under different splits (microbatches, token
budgets, orders, data-parallel ranks) and compare each with one microbatch on one rank: the accumulated
gradient, the parameter update, and the objective against an independent float64 reference, next to a
control that measures the floating-point floor of the same comparison.

scenarios:
  (none)   gmpo and klcov: verl issues #7913 and #7829 (or a custom scenario when custom flags are given)
  gmpo     GMPO (geo_mean) + KL loss: 8 sequences x 16 tokens, one SGD step lr 0.02, clip 1.0;
           one microbatch of 8 vs eight of 1, uneven sizes, a token budget, a shuffled order, dp:2
  klcov    KL-Cov, kl_cov_ratio 2e-4: 64 sequences x 128 tokens (8,192 valid), SGD lr 0.02, clip 0.05;
           one microbatch vs eight dynamic microbatches of 1,024 response tokens; control = penalty off
  sweep    every loss mode x every aggregation mode x {even, uneven, tokens, shuffle, dp:2}
  value    the critic's clipped value loss (cliprange_value 0.2, token-mean) on a value model (the tiny
           model's body with a scalar head): microbatches, token budgets, packing, an order, dp:2;
           legacy = verl's per-microbatch normalisation before its PR #6957
  audit    audit a third-party policy-loss function: --loss-fn package.module:function --convention verl
A flag a scenario does not use is refused (exit 2); SCENARIO --help lists the ones it accepts.

split specs (--split, repeatable; parts joined by '+'):
  even:K        K microbatches per rank, as equal as possible     e.g. even:8
  sizes:a,b,c   microbatches of a, b, c sequences per rank         e.g. sizes:3,5
  tokens:B      token budget: rows x (longest prompt + longest response) <= B   e.g. tokens:512
  packed:B      token budget on packed rows (use_remove_padding)                  e.g. packed:512
  shuffle:S     permute the minibatch's rows with seed S first     e.g. shuffle:1+even:4
  dp:D          D data-parallel ranks (gloo processes on CPU)      e.g. dp:2+tokens:512

examples:
  splitproof diagnose
  splitproof diagnose sweep --dtype float64 --json sweep.json
  splitproof diagnose --loss-mode vanilla --agg-mode seq-mean-token-mean --split even:8 --split dp:2 --scope microbatch
  splitproof diagnose klcov --plot klcov.png
  splitproof diagnose audit --loss-fn mypkg.losses:my_policy_loss --convention verl --loss-mode my_loss
  splitproof diagnose gmpo --help          (a scenario's runs and the flags it accepts)

verdict: pass iff the gradient's and the update's relative differences are <= max(16 x the control's,
64 x eps(dtype)) and the objective is within the reference's precision floor. See docs/diagnose.md.
exit status: 0 all pass, 1 a verdict fails, 2 bad usage (nothing runs)."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``splitproof diagnose`` on the top-level parser's subparsers."""
    d = subparsers.add_parser(
        "diagnose",
        help="check that splitting a minibatch does not change the update",
        description=DIAGNOSE_DESCRIPTION,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument(
        "scenario",
        nargs="?",
        choices=opts.SCENARIOS,
        metavar="SCENARIO",
        help="gmpo | klcov | sweep | value | audit (default: gmpo and klcov)",
    )
    opts.add_options(d)
    d.set_defaults(run=run, help_text=d.format_help)
    return d


def run(args) -> int:
    """Run the parsed ``splitproof diagnose`` command; returns the exit status."""
    with warnings.catch_warnings():
        # geo_mean/gspo/sapo fix their policy aggregation; the diagnosis documents it (docs/diagnose.md)
        warnings.filterwarnings("ignore", message=r"loss_mode .* aggregates its policy term")
        if args.help:
            print(opts.scenario_help(args.scenario) if args.scenario else args.help_text(), end="")
            return EXIT_PASS
        _check_usage(args)
        import torch

        threads = torch.get_num_threads()
        try:
            return _audit(args) if args.scenario == "audit" else _diagnose(args)
        finally:
            torch.set_num_threads(threads)  # in-process callers keep their own setting


def _check_usage(args) -> None:
    """Everything about the flags that can be refused before any work."""
    opts.refuse_unaccepted(args)
    if args.trust_remote_code and not args.model:
        raise UsageError("--trust-remote-code applies only with --model PATH")
    if args.json:
        check_output_path(args.json, "--json", allow_stdout=True)
    if args.plot:
        from splitproof.diagnose.plot import FORMATS

        check_output_path(args.plot, "--plot", suffixes=tuple("." + f for f in FORMATS))
    if args.json and args.plot and os.path.abspath(args.json) == os.path.abspath(args.plot):
        raise UsageError(f"--json and --plot name the same file {args.json}")


def _progress_printer(enabled: bool):
    if not enabled:
        return None
    tty = sys.stderr.isatty()
    state = {"last": -1, "start": time.time()}

    def show(done: int, total: int, label: str) -> None:
        width = 30
        filled = int(width * done / max(1, total))
        if tty:
            bar = "#" * filled + "-" * (width - filled)
            sys.stderr.write(f"\r[{bar}] {done}/{total} {label[:40]:<40}")
            if done >= total:
                sys.stderr.write(f"\r[{bar}] {done}/{total} done in {time.time() - state['start']:.1f}s{' ' * 30}\n")
        else:  # a log file: a line every tenth
            tenth = 10 * done // max(1, total)
            if tenth != state["last"]:
                state["last"] = tenth
                sys.stderr.write(f"[{'#' * filled}{'-' * (width - filled)}] {done}/{total}\n")
        sys.stderr.flush()

    return show


@contextmanager
def _loading_bars(enabled: bool):
    """transformers' weight-loading progress bar on or off for the duration (restored afterwards)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


def _scenarios(args) -> list:
    """The scenarios the flags ask for, with their overrides; refuses what a scenario cannot honour."""
    from dataclasses import replace

    from splitproof.diagnose import scenarios as sc
    from splitproof.diagnose.splits import parse_split
    from splitproof.loss_config import AGG_MODES, COV_MODES, LOSS_MODES

    custom = opts.given(args, opts.CUSTOM_FLAGS + opts.STEP_FLAGS)
    if args.scenario is None and not custom:
        chosen = [sc.gmpo(args.seed), sc.klcov(args.seed)]
    elif args.scenario is None:
        loss_mode = args.loss_mode or "vanilla"
        if loss_mode not in LOSS_MODES:
            raise UsageError(f"unknown loss mode {loss_mode!r}; expected one of {', '.join(LOSS_MODES)}")
        if args.agg_mode is not None and args.agg_mode not in AGG_MODES:
            raise UsageError(f"unknown aggregation mode {args.agg_mode!r}; expected one of {', '.join(AGG_MODES)}")
        for option, needs in (
            ("kl_cov_ratio", ("kl_cov",)),
            ("clip_cov_ratio", ("clip_cov",)),
            ("cov_strategy", COV_MODES),
        ):
            if getattr(args, option) is not None and loss_mode not in needs:
                raise UsageError(
                    f"{opts.flag(option)} applies only with --loss-mode {' or '.join(needs)} (this run: {loss_mode})"
                )
        values = {k: getattr(args, k) for k in opts.CUSTOM_FLAGS + opts.STEP_FLAGS if getattr(args, k) is not None}
        values["splits"] = tuple(values.pop("split", ()) or ())
        values["legacy"] = args.scope == "microbatch"
        chosen = [sc.custom(seed=args.seed, **values)]
    elif args.scenario == "sweep":
        chosen = sc.sweep(args.seed)
    else:
        chosen = [{"gmpo": sc.gmpo, "klcov": sc.klcov, "value": sc.value}[args.scenario](args.seed)]
    settings = {
        k: getattr(args, k)
        for k in ("lr", "grad_clip", "optimizer", "cov_strategy", "statistics_scope")
        if getattr(args, k) is not None
    }
    chosen = [sc.with_overrides(s, splits=args.split, settings=settings) for s in chosen]
    if args.device != "cpu" and not args.split:
        chosen = [
            sc.without_dp(s, "dp splits skipped: they run as CPU gloo processes (use --device cpu)") for s in chosen
        ]
    if args.scope == "minibatch":
        chosen = [replace(s, legacy=None) for s in chosen]
    has_dp = any(parse_split(spec).ranks > 1 for s in chosen for spec in s.splits)
    if args.dp_wrapper is not None and not has_dp:
        raise UsageError("--dp-wrapper applies to dp:D splits, and none runs here")
    wrapper = args.dp_wrapper or "ddp"
    return [replace(s, settings=s.settings.with_(wrapper=wrapper)) for s in chosen]


def _diagnose(args) -> int:
    import torch

    from splitproof.batch import BatchError
    from splitproof.devices import deterministic
    from splitproof.diagnose import report as rep
    from splitproof.diagnose.context import ModelError, ModelSpec, check_device
    from splitproof.diagnose.diagnosis import Diagnosis
    from splitproof.diagnose.plot import PlotUnavailable, require_matplotlib
    from splitproof.diagnose.splits import SplitError
    from splitproof.loss_config import ConfigError

    args.dtype = args.dtype or "float32"
    args.device = args.device or "cpu"
    try:
        if args.plot:
            require_matplotlib()  # fail before running when matplotlib is missing
        check_device(args.device)
        scenarios = _scenarios(args)
        settings_note = deterministic(args.device)  # the trainer's determinism settings on a GPU
        if settings_note:
            print(f"splitproof: notice: {settings_note}", file=sys.stderr)
        threads = args.threads or (1 if not args.model else None)
        if threads:
            torch.set_num_threads(threads)
        spec = ModelSpec(
            path=args.model,
            dtype=args.dtype,
            device=args.device,
            seed=args.seed,
            trust_remote_code=args.trust_remote_code,
            lora_rank=args.lora_rank or 0,
        )
        show = _progress_printer(not args.no_progress and (args.scenario == "sweep" or sys.stderr.isatty()))
        with _loading_bars(not args.no_progress):
            diagnosis = Diagnosis(scenarios, spec, progress=show)
    except (SplitError, ModelError, ConfigError, BatchError, PlotUnavailable) as exc:
        raise UsageError(str(exc)) from None
    from splitproof.engine.worker_exit import WorkerDied

    try:
        diagnosis.run()
    except WorkerDied as exc:  # one line naming the dead rank, exit 2
        raise UsageError(str(exc)) from None
    records = [diagnosis.results(s) for s in scenarios]
    settings = {
        "model": spec.describe(),
        "model_path": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "seed": args.seed,
        "threads": torch.get_num_threads(),
        "dp_wrapper": scenarios[0].settings.wrapper,
        "scenarios": [s.name for s in scenarios],
        "command": "splitproof diagnose " + " ".join(args.argv),
    }
    report = rep.build(records, settings)
    written = []
    if args.json:
        with output_stream(args.json, "--json") as f:
            rep.dump_json(report, f)
        written.append(args.json)
    if args.plot:
        from splitproof.diagnose.plot import write_plot

        try:
            write_plot(report, args.plot)
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: cannot write ({exc.strerror or type(exc).__name__})") from None
        written.append(args.plot)
    _print_report(rep.text(report), written, args.json == STDOUT)
    return EXIT_PASS if report["passed"] else EXIT_FAIL


def _print_report(text: str, written: list[str], json_on_stdout: bool) -> None:
    """The human report and the files written: on stdout, or on stderr when stdout carries the JSON."""
    stream = sys.stderr if json_on_stdout else sys.stdout
    print(text, file=stream)
    for path in written:
        if path != STDOUT:
            print(f"wrote {path}", file=stream)


def _audit(args) -> int:
    import torch

    from splitproof.diagnose.audit import check_agg_mode, load_loss_fn, run_audit

    if not args.loss_fn:
        raise UsageError("audit needs --loss-fn package.module:function (or path/to/file.py:function)")
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        check_agg_mode(args.agg_mode or "token-mean")
        fn = load_loss_fn(args.loss_fn)
        report = run_audit(
            fn,
            convention=args.convention or "verl",
            loss_mode=args.loss_mode,
            agg_mode=args.agg_mode or "token-mean",
            seed=args.seed,
            name=args.loss_fn,
        )
    except ValueError as exc:
        raise UsageError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    if args.json:
        with output_stream(args.json, "--json") as f:
            f.write(report.to_json() + "\n")
    _print_report(report.format_table(), [args.json] if args.json else [], args.json == STDOUT)
    return EXIT_PASS if report.passed else EXIT_FAIL
