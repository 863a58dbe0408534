"""`splitproof diagnose`: exit codes, the JSON record, user errors, the plot, the seed scenarios, audit."""

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
from splitproof.diagnose.compare import tolerance, verdict
from splitproof.diagnose.splits import SplitError, parse_split

ROOT = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPLIT_FIELDS = {"split", "grad_max_abs_diff", "grad_rel_diff", "update_max_abs_diff", "update_rel_diff", "objective",
                "objective_reference", "verdict", "control"}
DIFF_FIELDS = {"grad_max_abs_diff", "grad_rel_diff", "update_max_abs_diff", "update_rel_diff"}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`splitproof diagnose` (gmpo + klcov) once, with --json and --plot."""
    out = tmp_path_factory.mktemp("diagnose")
    code = main(["diagnose", "--json", str(out / "d.json"), "--plot", str(out / "d.png"), "--no-progress"])
    return code, json.loads((out / "d.json").read_text()), out / "d.png"


def _forbid_work(monkeypatch, diagnosis_step: str) -> None:
    """Make the diagnosis (from ``diagnosis_step`` on: ``__init__`` builds the model, ``run`` updates it) and
    the audit fail the test if they start."""
    from splitproof.diagnose import audit, diagnosis

    def no_work(*_args, **_kwargs):
        raise AssertionError("work started before the usage error")

    monkeypatch.setattr(diagnosis.Diagnosis, diagnosis_step, no_work)
    monkeypatch.setattr(audit, "run_audit", no_work)


def _scenario(record: dict, name: str) -> dict:
    return next(s for s in record["scenarios"] if s["name"] == name)


@pytest.mark.dist
def test_default_run_passes_both_seeds(default_run):
    code, record, _ = default_run
    assert code == 0
    assert record["passed"] is True
    assert [s["name"] for s in record["scenarios"]] == ["gmpo", "klcov"]


@pytest.mark.dist
def test_json_schema(default_run):
    _, record, _ = default_run
    assert {"passed", "versions", "settings", "scenarios", "verdict_rule"} <= set(record)
    assert {"splitproof", "torch", "transformers", "python"} <= set(record["versions"])
    for scenario in record["scenarios"]:
        assert {"name", "passed", "settings", "baseline", "splits"} <= set(scenario)
        for split in scenario["splits"]:
            assert SPLIT_FIELDS <= set(split)
            assert split["verdict"] in ("pass", "fail")
            assert DIFF_FIELDS <= set(split["control"])
            assert DIFF_FIELDS | {"verdict"} <= set(split["legacy"])
            assert isinstance(split["objective_reference"], float)


@pytest.mark.dist
def test_report_fits_100_columns_and_names_the_verl_issues(default_run):
    from splitproof.diagnose import report

    _, record, _ = default_run
    text = report.text(record)
    assert max(len(line) for line in text.splitlines()) <= report.WIDTH
    for number, words in (("7913", "geo_mean loss changes"), ("7829", "token selection changes")):
        assert f"reruns verl #{number}: " in text and words in text
        assert f"https://github.com/verl-project/verl/issues/{number}" in text
        assert f"DIFFERS: verl #{number} reproduced" in text
    assert "verl convention (legacy, not splitproof)" in text
    assert [s["upstream"]["ref"] for s in record["scenarios"]] == ["verl #7913", "verl #7829"]


@pytest.mark.dist
def test_gmpo_seed(default_run):
    _, record, _ = default_run
    gmpo = _scenario(record, "gmpo")
    assert gmpo["passed"]
    assert gmpo["settings"]["valid_tokens"] == 128
    splits = {s["split"]: s for s in gmpo["splits"]}
    assert {"even:8", "sizes:3,5", "sizes:1,2,5", "dp:2"} <= set(splits)
    assert splits["even:8"]["microbatches"] == 8
    assert splits["dp:2"]["ranks"] == 2
    for s in gmpo["splits"]:
        assert s["verdict"] == "pass" and s["legacy"]["verdict"] == "fail"
        assert s["objective"] == pytest.approx(s["objective_reference"], rel=1e-4, abs=1e-6)


@pytest.mark.dist
def test_klcov_seed_selects_one_token_and_legacy_eight(default_run):
    _, record, _ = default_run
    klcov = _scenario(record, "klcov")
    assert klcov["passed"]
    assert klcov["settings"]["valid_tokens"] == 8192
    split = klcov["splits"][0]
    assert split["microbatches"] == 8 and split["ranks"] == 1
    assert split["selected_tokens"] == {"baseline": 1, "split": 1}
    assert split["mask_agreement"] == 1.0
    assert split["legacy"]["selected_tokens"]["split"] == 8
    assert split["legacy"]["verdict"] == "fail"
    assert split["legacy"]["update_rel_diff"] > 100 * split["control"]["update_rel_diff"]
    # the objective check is informative: its measured floor is far below |J|, and it sees the legacy selection
    assert klcov["baseline"]["objective_tolerance"] < abs(klcov["baseline"]["objective_reference"]) / 100
    assert split["objective_abs_diff"] <= split["tolerance"]["objective_abs_diff"]
    assert split["legacy"]["objective_abs_diff"] > 10 * split["tolerance"]["objective_abs_diff"]


@pytest.mark.dist
def test_plot_writes_png(default_run):
    _, _, png = default_run
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_failing_verdict_exits_1(tmp_path, capsys):
    # the candidate itself selects per microbatch (the second seed's bug): it must fail
    path = tmp_path / "f.json"
    code = main(["diagnose", "--loss-mode", "kl_cov", "--cov-strategy", "microbatch", "--split", "even:4",
                 "--json", str(path), "--no-progress"])
    assert code == 1
    record = json.loads(path.read_text())
    assert record["passed"] is False
    assert record["scenarios"][0]["splits"][0]["verdict"] == "fail"
    assert "FAIL" in capsys.readouterr().out


def test_legacy_statistics_scope_fails_and_scope_column(tmp_path):
    path = tmp_path / "g.json"
    assert main(["diagnose", "--loss-mode", "geo_mean", "--statistics-scope", "microbatch", "--split", "sizes:3,5",
                 "--no-progress"]) == 1
    assert main(["diagnose", "--loss-mode", "vanilla", "--agg-mode", "seq-mean-token-mean", "--split", "sizes:1,7",
                 "--split", "tokens:48", "--scope", "microbatch", "--json", str(path), "--no-progress"]) == 0
    splits = json.loads(path.read_text())["scenarios"][0]["splits"]
    assert all(s["verdict"] == "pass" and s["legacy"]["verdict"] == "fail" for s in splits)


def test_group_mean_custom_run(tmp_path):
    """The synthetic batch carries group ids: group-mean-token-mean runs, exact across splits that cut the
    groups, and per-microbatch group counts (the legacy column) differ."""
    path = tmp_path / "g.json"
    assert main(["diagnose", "--loss-mode", "vanilla", "--agg-mode", "group-mean-token-mean", "--dtype", "float64",
                 "--split", "sizes:3,5", "--split", "dp:2", "--scope", "microbatch", "--json", str(path),
                 "--no-progress"]) == 0
    splits = json.loads(path.read_text())["scenarios"][0]["splits"]
    assert all(s["update_rel_diff"] < 1e-12 and s["verdict"] == "pass" for s in splits)
    assert splits[0]["legacy"]["verdict"] == "fail"


def test_value_scenario_exact_and_legacy_differs(tmp_path):
    """The critic's value loss: exact across splits in float64; verl's per-microbatch normalisation before
    its PR #6957 (the legacy column) is not, and as the candidate it fails."""
    path = tmp_path / "v.json"
    assert main(["diagnose", "value", "--dtype", "float64", "--split", "even:8", "--split", "packed:48",
                 "--split", "shuffle:1+sizes:3,5", "--json", str(path), "--no-progress"]) == 0
    record = _scenario(json.loads(path.read_text()), "value")
    assert record["passed"] and record["settings"]["loss"]["cliprange_value"] == 0.2
    for s in record["splits"]:
        assert s["grad_rel_diff"] < 1e-12 and s["update_rel_diff"] < 1e-12
        assert abs(s["objective"] - s["objective_reference"]) < 1e-12
        assert s["legacy"]["verdict"] == "fail" and s["legacy"]["grad_rel_diff"] > 1.0
    assert main(["diagnose", "value", "--statistics-scope", "microbatch", "--split", "even:4", "--no-progress"]) == 1


@pytest.mark.dist
def test_value_scenario_default_splits(tmp_path):
    path = tmp_path / "v.json"
    assert main(["diagnose", "value", "--json", str(path), "--no-progress"]) == 0
    splits = {s["split"]: s for s in _scenario(json.loads(path.read_text()), "value")["splits"]}
    assert {"dp:2", "dp:2+even:4", "tokens:48", "packed:48"} <= set(splits)
    assert all(s["verdict"] == "pass" and s["legacy"]["verdict"] == "fail" for s in splits.values())


def test_float64_is_exact(tmp_path):
    path = tmp_path / "e.json"
    assert main(["diagnose", "--dtype", "float64", "--loss-mode", "geo_mean", "--split", "even:8",
                 "--split", "shuffle:3+sizes:5,3", "--json", str(path), "--no-progress"]) == 0
    for s in json.loads(path.read_text())["scenarios"][0]["splits"]:
        assert s["grad_rel_diff"] < 1e-12 and s["update_rel_diff"] < 1e-12
        assert abs(s["objective"] - s["objective_reference"]) < 1e-12


@pytest.mark.parametrize("argv", [
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
], ids=lambda a: " ".join(a))
def test_user_errors_exit_2_with_one_line(argv, tmp_path, capsys, monkeypatch):
    _forbid_work(monkeypatch, "run")  # planning the splits (in __init__) is how some of them are refused
    argv = [str(tmp_path / "missing-model") if a == "MISSING" else a for a in argv]
    assert main(["diagnose", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("splitproof: error: ")


@pytest.mark.parametrize("option, path", [
    ("--json", "."), ("--plot", "."), ("--json", "DIR"), ("--plot", "out.jpg"), ("--plot", "out"), ("--plot", "-"),
    ("--json", "nofolder/x.json"), ("--json", "/proc/splitproof-test.json"), ("--plot", "/proc/x.png"),
])
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
    argv = ["diagnose", "--loss-mode", "gpg", "--sequences", "4", "--response-length", "4", "--split", "even:2",
            "--entropy-coeff", "-0.01", "--json", "-", "--no-progress"]
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
    proc = subprocess.Popen([sys.executable, "-m", "splitproof", "diagnose", "--help"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert err == "", err


def test_plot_formats_and_panels(tmp_path, monkeypatch):
    """The extension picks the format; each scenario gets a gradient and an update panel with their bounds."""
    from splitproof.diagnose import plot

    path = tmp_path / "g.json"  # GMPO with the legacy column, on one process (cheap)
    assert main(["diagnose", "--loss-mode", "geo_mean", "--agg-mode", "seq-mean-token-mean", "--sequences", "8",
                 "--response-length", "8", "--split", "even:8", "--split", "sizes:3,5", "--scope", "microbatch",
                 "--json", str(path), "--no-progress"]) == 0
    record = json.loads(path.read_text())
    drawn = []
    original = plot._draw
    monkeypatch.setattr(plot, "_draw", lambda ax, labels, series, title, ylabel: (
        drawn.append((title, series)), original(ax, labels, series, title, ylabel)))
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


@pytest.mark.parametrize("scenario, shows, hides", [
    ("gmpo", ["geo_mean", "even:8", "--split", "--lr", "--dtype"], ["--loss-mode", "--cov-strategy", "--loss-fn"]),
    ("klcov", ["kl_cov_ratio 2e-4", "tokens:1088", "--cov-strategy"], ["--loss-mode", "--loss-fn"]),
    ("sweep", ["geo_mean", "seq-mean-token-sum-norm", "group-mean-token-mean", "--dtype", "--plot"],
     ["--split", "--lr", "--loss-fn"]),
    ("value", ["cliprange_value 0.2", "packed:48", "PR #6957", "--split", "--statistics-scope"],
     ["--loss-mode", "--cov-strategy", "--loss-fn"]),
    ("audit", ["--loss-fn", "global_batch_info", "dp_size", "--json"], ["--dtype", "--device", "--plot", "--split"]),
])
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


def test_split_grammar():
    assert parse_split(" dp:2 + tokens:512 ").spec == "dp:2+tokens:512"
    s = parse_split("shuffle:7+sizes:1,2,5")
    assert s.micro == ("sizes", (1, 2, 5)) and s.shuffle == 7 and s.ranks == 1
    for bad in ("", "even", "even:0", "sizes:1,,2", "tokens:-3", "even:2+sizes:1,1", "foo:1"):
        with pytest.raises(SplitError):
            parse_split(bad)


def test_verdict_rule():
    control = {"grad_rel_diff": 1e-7, "update_rel_diff": 1e-6}
    bounds = tolerance(control, "float32")
    assert bounds["update_rel_diff"] == pytest.approx(1.6e-5)
    assert bounds["grad_rel_diff"] == pytest.approx(64 * 2.0 ** -23)  # the dtype floor wins over 16 x 1e-7
    assert verdict({"grad_rel_diff": 1e-6, "update_rel_diff": 1e-5}, bounds) == "pass"
    assert verdict({"grad_rel_diff": 1e-6, "update_rel_diff": 1e-4}, bounds) == "fail"
    assert verdict({"grad_rel_diff": float("nan"), "update_rel_diff": 0.0}, bounds) == "fail"


@pytest.mark.parametrize("fn, code", [("correct_token_mean", 0), ("microbatch_mean", 1), ("microbatch_topk", 1)])
def test_audit_exit_codes(fn, code, tmp_path, monkeypatch):
    pytest.importorskip("splitproof.diagnose.audit")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    path = tmp_path / "a.json"
    assert main(["diagnose", "audit", "--loss-fn", f"tests.audit_examples:{fn}", "--convention", "verl",
                 "--loss-mode", "kl_cov", "--json", str(path)]) == code
    assert json.loads(path.read_text())["passed"] is (code == 0)


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
    done = _run_command([sys.executable, "-m", "splitproof"], "diagnose", "--loss-mode", "gpg", "--split", "sizes:3,5",
                        "--no-progress")
    assert done.returncode == 0, done.stderr
    assert "overall: PASS" in done.stdout and "gpg x token-mean" in done.stdout


def test_local_checkpoint_with_model_flag(tmp_path, capfd):
    """--model PATH: a Hugging Face checkpoint saved as safetensors, loaded locally (Qwen2 here)."""
    import torch
    from transformers.utils import logging as hf_logging

    from splitproof.hf_models import tiny_causal_lm

    path = tmp_path / "ckpt"
    tiny_causal_lm("qwen2", dtype=torch.float32, seed=2).save_pretrained(path, safe_serialization=True)
    assert any(p.suffix == ".safetensors" for p in path.iterdir())
    out = tmp_path / "m.json"
    capfd.readouterr()
    code = main(["diagnose", "--model", str(path), "--loss-mode", "geo_mean", "--sequences", "4",
                 "--response-length", "6", "--split", "even:4", "--split", "sizes:1,3", "--dtype", "float64",
                 "--json", str(out), "--no-progress"])
    record = json.loads(out.read_text())
    assert code == 0 and record["passed"]
    assert str(path) in json.dumps(record)
    # --no-progress silences transformers' weight-loading bar too, and leaves its setting as it was
    assert "Loading weights" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()


def test_packed_split_passes(tmp_path):
    """`packed:B` runs the engine with use_remove_padding: the same update as one padded microbatch."""
    assert parse_split("packed:64").micro == ("packed", 64)
    out = tmp_path / "p.json"
    code = main(["diagnose", "--loss-mode", "vanilla", "--sequences", "6", "--response-length", "8",
                 "--split", "packed:40", "--dtype", "float64", "--json", str(out), "--no-progress"])
    record = json.loads(out.read_text())
    assert code == 0 and record["passed"]


def test_audit_of_a_file_shows_what_the_user_typed(tmp_path, monkeypatch, capsys):
    (tmp_path / "mylosses.py").write_text(
        "import torch\n\n"
        "def plain_sum(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, weights=None):\n"
        "    loss = -advantages * torch.exp(log_prob - old_log_prob)\n"
        "    loss = torch.where(response_mask.bool(), loss, torch.zeros_like(loss)).sum()\n"
        "    return loss / config.global_batch_info['batch_num_tokens'], {}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "audit", "--loss-fn", "mylosses.py:plain_sum"]) == 1
    out = capsys.readouterr().out
    assert "mylosses.py:plain_sum: FAIL on dp2" in out and "_splitproof_audit_" not in out
    assert "FAIL dp2 (2 ranks" in out and "global_batch_info['dp_size']" in out
