"""`splitproof diagnose`'s usage: user errors (exit 2, one line, before any work), output paths and formats
(--json, --plot), help, every flag honoured or refused, the console script and ``python -m splitproof``."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from splitproof.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _forbid_work(monkeypatch, diagnosis_step: str) -> None:
    """Make the diagnosis (from ``diagnosis_step`` on: ``__init__`` builds the model, ``run`` updates it) and
    the audit fail the test if they start."""
    from splitproof.diagnose import audit, diagnosis

    def no_work(*_args, **_kwargs):
        raise AssertionError("work started before the usage error")

    monkeypatch.setattr(diagnosis.Diagnosis, diagnosis_step, no_work)
    monkeypatch.setattr(audit, "run_audit", no_work)


@pytest.mark.parametrize(
    "argv",
    [
        ["--loss-mode", "nope"],
        ["--agg-mode", "token-median"],
        ["--split", "even:"],
        ["--split", "even:x"],
        ["--split", "sizes:3,4"],
        ["--split", "even:99"],
        ["--split", "dp:2+dp:2"],
        ["--split", "tokens:3"],
        ["--model", "MISSING"],
        ["nosuch"],
        ["gmpo", "--loss-mode", "vanilla"],
        ["--lr", "-1"],
        ["--kl-cov-ratio", "2"],
        ["--loss-mode", "kl_cov", "--kl-cov-ratio", "2"],
        ["--kl-cov-ratio", "0.1"],  # only with --loss-mode kl_cov
        ["--loss-mode", "kl_cov", "--clip-cov-ratio", "0.1"],
        ["--cov-strategy", "prepass"],  # vanilla has no selection
        ["gmpo", "--cov-strategy", "prepass"],
        ["sweep", "--lr", "0.1"],
        ["--kl-loss-coef", "-0.5"],
        ["--entropy-coeff", "nan"],
        ["--trust-remote-code"],
        ["--dp-wrapper", "fsdp2", "--split", "even:2"],  # no dp split to wrap
        ["audit"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--dtype", "bfloat16"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--device", "cuda"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--plot", "a.png"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--split", "even:2"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--convention", "trl"],
        ["audit", "--loss-fn", "tests.audit_examples:microbatch_mean", "--agg-mode", "group-mean-token-mean"],
        ["--loss-fn", "tests.audit_examples:microbatch_mean"],
    ],
    ids=lambda a: " ".join(a),
)
def test_user_errors_exit_2_with_one_line(argv, tmp_path, capsys, monkeypatch):
    _forbid_work(monkeypatch, "run")  # planning the splits (in __init__) is how some of them are refused
    argv = [str(tmp_path / "missing-model") if a == "MISSING" else a for a in argv]
    assert main(["diagnose", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("splitproof: error: ")


@pytest.mark.parametrize(
    "option, path",
    [
        ("--json", "."),
        ("--plot", "."),
        ("--json", "DIR"),
        ("--plot", "out.jpg"),
        ("--plot", "out"),
        ("--plot", "-"),
        ("--json", "nofolder/x.json"),
        ("--json", "/proc/splitproof-test.json"),
        ("--plot", "/proc/x.png"),
    ],
)
@pytest.mark.parametrize("scenario", ["gmpo", "audit"])
def test_bad_output_path_exits_2_before_any_work(option, path, scenario, tmp_path, monkeypatch, capsys):
    """A directory, an unsupported extension, a missing folder or an unwritable place: one line, nothing runs."""
    _forbid_work(monkeypatch, "__init__")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    extra = ["--loss-fn", "tests.audit_examples:correct_token_mean"] if scenario == "audit" else []
    assert main(["diagnose", scenario, *extra, option, path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitproof: error: ") and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "nofolder").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["DIR"]


def test_json_and_plot_cannot_share_a_file(tmp_path, capsys):
    assert main(["diagnose", "gmpo", "--json", str(tmp_path / "a.png"), "--plot", str(tmp_path / "a.png")]) == 2
    assert "same file" in capsys.readouterr().err


def test_json_dash_writes_the_record_to_stdout_and_the_report_to_stderr(capsys):
    argv = [
        "diagnose",
        "--loss-mode",
        "gpg",
        "--sequences",
        "4",
        "--response-length",
        "4",
        "--split",
        "even:2",
        "--entropy-coeff",
        "-0.01",
        "--json",
        "-",
        "--no-progress",
    ]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    record = json.loads(out)  # stdout holds the JSON record and nothing else
    assert record["passed"] is True and "overall: PASS" in err and not (Path.cwd() / "-").exists()
    # a negative entropy coefficient is honoured (verl's meaning: the entropy is penalised)
    assert record["scenarios"][0]["settings"]["loss"]["entropy_coeff"] == -0.01


def test_audit_json_dash(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["diagnose", "audit", "--loss-fn", "tests.audit_examples:correct_token_mean", "--json", "-"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["passed"] is True and "PASS on every split" in err


def test_a_closed_pipe_ends_quietly():
    """`splitproof ... | head`: the reader goes away; no traceback, exit status 141 (128 + SIGPIPE)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen(
        [sys.executable, "-m", "splitproof", "diagnose", "--help"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == "", err


def test_plot_formats_and_panels(tmp_path, monkeypatch):
    """The extension picks the format; each scenario gets a gradient and an update panel with their bounds."""
    from splitproof.diagnose import plot

    path = tmp_path / "g.json"  # GMPO with the legacy column, on one process (cheap)
    assert (
        main(
            [
                "diagnose",
                "--loss-mode",
                "geo_mean",
                "--agg-mode",
                "seq-mean-token-mean",
                "--sequences",
                "8",
                "--response-length",
                "8",
                "--split",
                "even:8",
                "--split",
                "sizes:3,5",
                "--scope",
                "microbatch",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
    record = json.loads(path.read_text())
    drawn = []
    original = plot._draw
    monkeypatch.setattr(
        plot,
        "_draw",
        lambda ax, labels, series, title, ylabel: (
            drawn.append((title, series)),
            original(ax, labels, series, title, ylabel),
        ),
    )
    plot.write_plot(record, str(tmp_path / "d.pdf"))
    plot.write_plot(record, str(tmp_path / "d.svg"))
    assert (tmp_path / "d.pdf").read_bytes()[:5] == b"%PDF-"
    assert b"<svg" in (tmp_path / "d.svg").read_bytes()[:2000]
    panels = dict(drawn[:2])
    assert set(panels) == {"custom: gradient (before clipping)", "custom: update (after clipping)"}
    # GMPO's legacy runs fail on the gradient: the plot shows them above the gradient bound
    grad = panels["custom: gradient (before clipping)"]
    assert all(leg > bound for leg, bound in zip(grad["legacy (per-microbatch)"], grad["bound"]))
    with pytest.raises(ValueError):
        plot.plot_format("x.jpg")


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["diagnose", "--split", "even:2", "--plot", str(tmp_path / "x.png"), "--no-progress"]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert main(["diagnose", "--help"]) == 0
    out = capsys.readouterr().out
    assert "sizes:a,b,c" in out and "klcov" in out
    assert "< 0 penalises it" in " ".join(out.split())  # what a negative --entropy-coeff means


@pytest.mark.parametrize(
    "scenario, shows, hides",
    [
        ("gmpo", ["geo_mean", "even:8", "--split", "--lr", "--dtype"], ["--loss-mode", "--cov-strategy", "--loss-fn"]),
        ("klcov", ["kl_cov_ratio 2e-4", "tokens:1088", "--cov-strategy"], ["--loss-mode", "--loss-fn"]),
        (
            "sweep",
            ["geo_mean", "seq-mean-token-sum-norm", "group-mean-token-mean", "--dtype", "--plot"],
            ["--split", "--lr", "--loss-fn"],
        ),
        (
            "value",
            ["cliprange_value 0.2", "packed:48", "PR #6957", "--split", "--statistics-scope"],
            ["--loss-mode", "--cov-strategy", "--loss-fn"],
        ),
        (
            "audit",
            ["--loss-fn", "global_batch_info", "dp_size", "--json"],
            ["--dtype", "--device", "--plot", "--split"],
        ),
    ],
)
def test_scenario_help_names_its_runs_and_flags(scenario, shows, hides, capsys):
    assert main(["diagnose", scenario, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: splitproof diagnose {scenario}")

    def present(text: str) -> bool:  # a flag as an entry of the option list; other text anywhere
        return bool(re.search(rf"^  {text}\b", out, re.M)) if text.startswith("--") else text in out

    for text in shows:
        assert present(text), text
    for text in hides:
        assert not present(text), text


@pytest.mark.parametrize("scenario", ["gmpo", "klcov", "sweep", "value", "audit"])
def test_every_flag_is_honoured_or_refused(scenario, tmp_path, monkeypatch, capsys):
    """A flag missing from a scenario's help page is refused, with one line, before any work."""
    from splitproof.cli.diagnose_options import OPTIONS

    _forbid_work(monkeypatch, "__init__")
    values = {"store_true": [], "append": ["even:2"]}
    refused = [o for o in OPTIONS if scenario not in o.accepted_by]
    assert refused
    for o in refused:
        value = values.get(o.kwargs.get("action"), [str((o.kwargs.get("choices") or ["1"])[-1])])
        extra = ["--loss-fn", "tests.audit_examples:correct_token_mean"] if scenario == "audit" else []
        assert main(["diagnose", scenario, *extra, o.flags[-1], *value]) == 2, o.flags
        err = capsys.readouterr().err
        assert err.startswith(f"splitproof: error: {o.flags[-1]}") and len(err.strip().splitlines()) == 1, err


def test_audit_bad_function_exits_2(capsys, monkeypatch):
    pytest.importorskip("splitproof.diagnose.audit")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(["diagnose", "audit", "--loss-fn", "tests.audit_examples:no_such_function"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _run_command(command: list[str], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300, env=env)


def test_console_script():
    exe = shutil.which("splitproof", path=str(Path(sys.executable).parent)) or shutil.which("splitproof")
    if exe is None:
        pytest.skip("the splitproof console script is not installed")
    done = _run_command([exe], "diagnose", "--loss-mode", "gpg", "--split", "sizes:3,5", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "overall: PASS" in done.stdout
    bad = _run_command([exe], "diagnose", "--split", "even:x")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().startswith("splitproof: error:")


def test_python_dash_m_runs_the_command():
    """`python -m splitproof` is the `splitproof` command (torchrun -m needs it): same report, same exit status."""
    done = _run_command(
        [sys.executable, "-m", "splitproof"], "diagnose", "--loss-mode", "gpg", "--split", "sizes:3,5", "--no-progress"
    )
    assert done.returncode == 0, done.stderr
    assert "overall: PASS" in done.stdout and "gpg x token-mean" in done.stdout


def test_overrides_on_both_sides_of_an_option_are_all_taken(tmp_path, capsys):
    """``train a=1 --config F b=2`` as Hydra takes it (argparse alone stops at the option and rejects ``b=2``);
    anything after it that is not an override is still argparse's usage error."""
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  total_training_steps: 3\n")
    code = main(["train", "data.train_batch_size=64", "--config", str(config), "trainer.test_freq=7", "--print-config"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "train_batch_size: 64" in printed and "test_freq: 7" in printed and "total_training_steps: 3" in printed
    assert main(["train", "data.train_batch_size=64", "--config", str(config), "--no-such-flag"]) == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err
