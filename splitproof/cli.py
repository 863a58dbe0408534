"""The ``splitproof`` command. ``splitproof diagnose --help`` explains the diagnosis.

Exit status: 0 when every verdict passes, 1 when one fails, 2 on bad usage (a one-line message on stderr,
never a traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

EXIT_PASS, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

DIAGNOSE_DESCRIPTION = """\
Rerun one policy update of the same optimizer minibatch under different splits (microbatches, token
budgets, orders, data-parallel ranks) and compare each with one microbatch on one rank: the accumulated
gradient, the parameter update, and the objective against an independent float64 reference, next to a
control that measures the floating-point floor of the same comparison.

scenarios:
  (none)   gmpo and klcov, the two seed bug reports (or a custom scenario when custom flags are given)
  gmpo     GMPO (geo_mean) + KL loss: 8 sequences x 16 tokens, one SGD step lr 0.02, clip 1.0;
           one microbatch of 8 vs eight of 1, uneven sizes, a token budget, a shuffled order, dp:2
  klcov    KL-Cov, kl_cov_ratio 2e-4: 64 sequences x 128 tokens (8,192 valid), SGD lr 0.02, clip 0.05;
           one microbatch vs eight dynamic microbatches of 1,024 response tokens; control = penalty off
  sweep    every loss mode x every aggregation mode x {even, uneven, tokens, shuffle, dp:2}
  audit    audit a third-party policy-loss function: --loss-fn package.module:function --convention verl

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

verdict: pass iff the gradient's and the update's relative differences are <= max(16 x the control's,
64 x eps(dtype)) and the objective is within the reference's precision floor. See docs/diagnose.md.
exit status: 0 all pass, 1 a verdict fails, 2 bad usage."""

# Flags that define a custom scenario, and those a named scenario may override.
CUSTOM_ONLY = ("loss_mode", "agg_mode", "sequences", "response_length", "prompt_length", "kl_cov_ratio",
               "clip_cov_ratio", "kl_loss_coef", "entropy_coeff")
OVERRIDES = ("split", "lr", "grad_clip", "optimizer", "cov_strategy", "statistics_scope")
AUDIT_ONLY = ("loss_fn", "convention")


class UsageError(Exception):
    """Bad usage: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump
        raise UsageError(message)


def _number(kind: type, check, expected: str):
    """An argparse type: ``kind(text)`` that must satisfy ``check``, else a one-line error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not check(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value
    return parse


_positive_int = _number(int, lambda v: v >= 1, "a positive integer")
_positive_float = _number(float, lambda v: 0 < v < float("inf"), "a positive finite number")
_nonnegative_int = _number(int, lambda v: v >= 0, "an integer >= 0")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="splitproof", description="Split-invariant RL policy updates for language models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    d = sub.add_parser("diagnose", help="check that splitting a minibatch does not change the update",
                       description=DIAGNOSE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    d.add_argument("scenario", nargs="?", choices=("gmpo", "klcov", "sweep", "audit"), metavar="SCENARIO",
                   help="gmpo | klcov | sweep | audit (default: gmpo and klcov)")

    m = d.add_argument_group("model and numerics")
    m.add_argument("--model", metavar="PATH", help="local Hugging Face checkpoint (default: embedded tiny random Llama)")
    m.add_argument("--trust-remote-code", action="store_true", help="allow the checkpoint's own modelling code")
    m.add_argument("--dtype", choices=("float32", "float64", "bfloat16"), default="float32",
                   help="model dtype (default float32; float64 is the exactness run)")
    m.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]; dp splits run on CPU")
    m.add_argument("--seed", type=_nonnegative_int, default=0, help="model init and rollout seed (default 0)")
    m.add_argument("--threads", type=_positive_int, default=None,
                   help="torch CPU threads (default: 1 for the embedded model, torch's default otherwise)")
    m.add_argument("--dp-wrapper", choices=("ddp", "fsdp2"), default="ddp", help="wrapper for dp:D splits (default ddp)")

    c = d.add_argument_group("custom scenario (no SCENARIO name; unset flags take the defaults shown)")
    c.add_argument("--loss-mode", metavar="MODE", help="policy loss (default vanilla)")
    c.add_argument("--agg-mode", metavar="MODE", help="loss_agg_mode (default token-mean)")
    c.add_argument("--sequences", type=_positive_int, help="sequences in the minibatch (default 8)")
    c.add_argument("--response-length", type=_positive_int, help="response tokens per sequence, max (default 16)")
    c.add_argument("--prompt-length", type=_positive_int, help="prompt tokens per sequence, max (default 8)")
    c.add_argument("--lr", type=_positive_float, help="learning rate (default 0.02)")
    c.add_argument("--grad-clip", type=_positive_float, help="gradient clipping by total norm (default 1.0)")
    c.add_argument("--optimizer", choices=("sgd", "adamw"), help="optimizer (default sgd)")
    c.add_argument("--split", action="append", metavar="SPEC", help="a split to compare (repeatable; see above)")
    c.add_argument("--kl-cov-ratio", type=_positive_float, help="kl_cov_ratio (default 2e-4)")
    c.add_argument("--clip-cov-ratio", type=_positive_float, help="clip_cov_ratio (default 2e-4)")
    c.add_argument("--cov-strategy", choices=("auto", "prepass", "deferred", "microbatch"),
                   help="how KL-Cov/Clip-Cov get their minibatch selection (default auto; microbatch = legacy)")
    c.add_argument("--kl-loss-coef", type=float, help="enable the KL loss with this coefficient")
    c.add_argument("--entropy-coeff", type=float, help="entropy bonus coefficient (default 0)")
    c.add_argument("--statistics-scope", choices=("minibatch", "microbatch"),
                   help="the candidate's statistics (microbatch reproduces other frameworks' behaviour, and fails)")

    o = d.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write the full record as JSON")
    o.add_argument("--plot", metavar="PATH", help="write a PNG of the update differences (needs matplotlib)")
    o.add_argument("--scope", choices=("minibatch", "microbatch"), default=None,
                   help="microbatch: add the legacy column (per-microbatch statistics); minibatch: leave it out "
                        "(default: shown for gmpo, klcov and sweep)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    a = d.add_argument_group("audit (SCENARIO = audit)")
    a.add_argument("--loss-fn", metavar="MODULE:FUNCTION", help="the policy-loss function to audit")
    a.add_argument("--convention", default=None, help="calling convention of the function (default verl)")
    return parser


def _given(args, names) -> list[str]:
    return [n for n in names if getattr(args, n) not in (None, False)]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


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


def _scenarios(args):
    from splitproof.config import AGG_MODES, LOSS_MODES
    from splitproof.diagnose import scenarios as sc

    custom_given = _given(args, CUSTOM_ONLY)
    override_given = _given(args, OVERRIDES)
    if args.scenario is None and not custom_given and not override_given:
        chosen = [sc.gmpo(args.seed), sc.klcov(args.seed)]
    elif args.scenario is None:
        if args.loss_mode is not None and args.loss_mode not in LOSS_MODES:
            raise UsageError(f"unknown loss mode {args.loss_mode!r}; expected one of {', '.join(LOSS_MODES)}")
        if args.agg_mode is not None and args.agg_mode not in AGG_MODES:
            raise UsageError(f"unknown aggregation mode {args.agg_mode!r}; expected one of {', '.join(AGG_MODES)}")
        values = {k: getattr(args, k) for k in CUSTOM_ONLY + OVERRIDES if getattr(args, k) is not None}
        values["splits"] = tuple(values.pop("split", ()) or ())
        values["legacy"] = args.scope == "microbatch"
        chosen = [sc.custom(seed=args.seed, **values)]
    else:
        if custom_given:
            raise UsageError(f"{_flag(custom_given[0])} defines a custom scenario; drop the scenario name "
                             f"{args.scenario!r} to use it")
        if args.scenario == "sweep":
            if override_given:
                raise UsageError(f"{_flag(override_given[0])} does not apply to the sweep (it runs fixed splits)")
            chosen = sc.sweep(args.seed)
        else:
            chosen = [sc.gmpo(args.seed) if args.scenario == "gmpo" else sc.klcov(args.seed)]
    settings = {k: getattr(args, k) for k in ("lr", "grad_clip", "optimizer", "cov_strategy", "statistics_scope")
                if getattr(args, k) is not None}
    chosen = [sc.with_overrides(s, splits=args.split, settings=settings) for s in chosen]
    if args.device != "cpu" and not args.split:
        chosen = [sc.without_dp(s, "dp splits skipped: they run as CPU gloo processes (use --device cpu)")
                  for s in chosen]
    if args.scope == "minibatch":
        from dataclasses import replace
        chosen = [replace(s, legacy=None) for s in chosen]
    return chosen


def _apply_wrapper(scenarios, wrapper: str):
    from dataclasses import replace
    return [replace(s, settings=s.settings.with_(wrapper=wrapper)) for s in scenarios]


def _diagnose(args) -> int:
    import torch

    from splitproof.batch import BatchError
    from splitproof.config import ConfigError
    from splitproof.diagnose import report as rep
    from splitproof.diagnose.context import ModelError, ModelSpec, check_device
    from splitproof.diagnose.diagnosis import Diagnosis
    from splitproof.diagnose.splits import SplitError

    from splitproof.diagnose.plot import PlotUnavailable, require_matplotlib

    try:
        if args.plot:
            require_matplotlib()  # fail before running when matplotlib is missing
        check_device(args.device)
        scenarios = _apply_wrapper(_scenarios(args), args.dp_wrapper)
        threads = args.threads or (1 if not args.model else None)
        if threads:
            torch.set_num_threads(threads)
        spec = ModelSpec(path=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
                         trust_remote_code=args.trust_remote_code)
        show = _progress_printer(not args.no_progress and (args.scenario == "sweep" or sys.stderr.isatty()))
        diagnosis = Diagnosis(scenarios, spec, progress=show)
    except (SplitError, ModelError, ConfigError, BatchError, PlotUnavailable) as exc:
        raise UsageError(str(exc)) from None
    from splitproof.engine.worker_exit import WorkerDied

    try:
        diagnosis.run()
    except WorkerDied as exc:  # one line naming the dead rank, exit 2
        raise UsageError(str(exc)) from None
    records = [diagnosis.results(s) for s in scenarios]
    settings = {"model": spec.describe(), "model_path": args.model, "dtype": args.dtype, "device": args.device,
                "seed": args.seed, "threads": torch.get_num_threads(), "dp_wrapper": args.dp_wrapper,
                "scenarios": [s.name for s in scenarios], "command": "splitproof diagnose " + " ".join(args.argv)}
    report = rep.build(records, settings)
    rep.print_text(report)
    if args.json:
        rep.write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        from splitproof.diagnose.plot import write_plot
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return EXIT_PASS if report["passed"] else EXIT_FAIL


def _audit(args) -> int:
    stray = _given(args, CUSTOM_ONLY + OVERRIDES)
    stray = [n for n in stray if n not in ("loss_mode", "agg_mode")]
    if stray:
        raise UsageError(f"{_flag(stray[0])} does not apply to audit (flags: --loss-fn, --convention, --loss-mode, "
                         "--agg-mode, --seed, --json)")
    if args.plot or args.model:
        raise UsageError(f"{'--plot' if args.plot else '--model'} does not apply to audit")
    if not args.loss_fn:
        raise UsageError("audit needs --loss-fn package.module:function")
    try:
        from splitproof.diagnose.audit import load_loss_fn, run_audit
    except ImportError as exc:
        raise UsageError(f"audit is not available in this installation ({exc})") from None
    try:
        fn = load_loss_fn(args.loss_fn)
        report = run_audit(fn, convention=args.convention or "verl", loss_mode=args.loss_mode,
                           agg_mode=args.agg_mode or "token-mean", seed=args.seed)
    except ValueError as exc:
        raise UsageError(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__) from None
    data = report.to_json()
    data = json.loads(data) if isinstance(data, str) else data
    if hasattr(report, "format_table"):
        print(report.format_table())
    else:
        for row in report.rows:
            print(f"{row['split']:<16} grad rel {row['grad_rel_diff']}  control {row['control_rel_diff']}  {row['verdict']}")
        print("PASS" if report.passed else "FAIL")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json}")
    return EXIT_PASS if report.passed else EXIT_FAIL


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import torch

    threads = torch.get_num_threads()
    try:
        with warnings.catch_warnings():
            # geo_mean/gspo/sapo fix their policy aggregation; the diagnosis documents it (docs/diagnose.md)
            warnings.filterwarnings("ignore", message=r"loss_mode .* aggregates its policy term")
            return _main(argv)
    finally:
        torch.set_num_threads(threads)  # in-process callers keep their own setting


def _main(argv: list[str]) -> int:
    parser = build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        args.argv = argv[1:]
        if args.scenario == "audit":
            return _audit(args)
        given = _given(args, AUDIT_ONLY)
        if given:
            raise UsageError(f"{_flag(given[0])} is for the audit scenario: splitproof diagnose audit {_flag(given[0])} ...")
        if args.json:
            _check_writable(args.json, "--json")
        if args.plot:
            _check_writable(args.plot, "--plot")
        return _diagnose(args)
    except UsageError as exc:
        print(f"splitproof: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("splitproof: interrupted", file=sys.stderr)
        return 130


def _check_writable(path: str, flag: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{flag} {path}: folder {folder} does not exist")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
