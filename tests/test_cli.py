"""`splitproof diagnose`: exit codes, the JSON record, the plot, the seed scenarios, the split grammar and the
verdict rule, audit (its usage errors, output options and help are in tests/test_cli_usage.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitproof.cli import main
from splitproof.diagnose.compare import tolerance, verdict
from splitproof.diagnose.splits import SplitError, parse_split

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SPLIT_FIELDS = {
    "split",
    "grad_max_abs_diff",
    "grad_rel_diff",
    "update_max_abs_diff",
    "update_rel_diff",
    "objective",
    "objective_reference",
    "verdict",
    "control",
}
DIFF_FIELDS = {"grad_max_abs_diff", "grad_rel_diff", "update_max_abs_diff", "update_rel_diff"}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """`splitproof diagnose` (gmpo + klcov) once, with --json and --plot."""
    out = tmp_path_factory.mktemp("diagnose")
    code = main(["diagnose", "--json", str(out / "d.json"), "--plot", str(out / "d.png"), "--no-progress"])
    return code, json.loads((out / "d.json").read_text()), out / "d.png"


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
    code = main(
        [
            "diagnose",
            "--loss-mode",
            "kl_cov",
            "--cov-strategy",
            "microbatch",
            "--split",
            "even:4",
            "--json",
            str(path),
            "--no-progress",
        ]
    )
    assert code == 1
    record = json.loads(path.read_text())
    assert record["passed"] is False
    assert record["scenarios"][0]["splits"][0]["verdict"] == "fail"
    assert "FAIL" in capsys.readouterr().out


def test_legacy_statistics_scope_fails_and_scope_column(tmp_path):
    path = tmp_path / "g.json"
    assert (
        main(
            [
                "diagnose",
                "--loss-mode",
                "geo_mean",
                "--statistics-scope",
                "microbatch",
                "--split",
                "sizes:3,5",
                "--no-progress",
            ]
        )
        == 1
    )
    assert (
        main(
            [
                "diagnose",
                "--loss-mode",
                "vanilla",
                "--agg-mode",
                "seq-mean-token-mean",
                "--split",
                "sizes:1,7",
                "--split",
                "tokens:48",
                "--scope",
                "microbatch",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
    splits = json.loads(path.read_text())["scenarios"][0]["splits"]
    assert all(s["verdict"] == "pass" and s["legacy"]["verdict"] == "fail" for s in splits)


def test_group_mean_custom_run(tmp_path):
    """The synthetic batch carries group ids: group-mean-token-mean runs, exact across splits that cut the
    groups, and per-microbatch group counts (the legacy column) differ."""
    path = tmp_path / "g.json"
    assert (
        main(
            [
                "diagnose",
                "--loss-mode",
                "vanilla",
                "--agg-mode",
                "group-mean-token-mean",
                "--dtype",
                "float64",
                "--split",
                "sizes:3,5",
                "--split",
                "dp:2",
                "--scope",
                "microbatch",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
    splits = json.loads(path.read_text())["scenarios"][0]["splits"]
    assert all(s["update_rel_diff"] < 1e-12 and s["verdict"] == "pass" for s in splits)
    assert splits[0]["legacy"]["verdict"] == "fail"


def test_value_scenario_exact_and_legacy_differs(tmp_path):
    """The critic's value loss: exact across splits in float64; verl's per-microbatch normalisation before
    its PR #6957 (the legacy column) is not, and as the candidate it fails."""
    path = tmp_path / "v.json"
    assert (
        main(
            [
                "diagnose",
                "value",
                "--dtype",
                "float64",
                "--split",
                "even:8",
                "--split",
                "packed:48",
                "--split",
                "shuffle:1+sizes:3,5",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
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
    assert (
        main(
            [
                "diagnose",
                "--dtype",
                "float64",
                "--loss-mode",
                "geo_mean",
                "--split",
                "even:8",
                "--split",
                "shuffle:3+sizes:5,3",
                "--json",
                str(path),
                "--no-progress",
            ]
        )
        == 0
    )
    for s in json.loads(path.read_text())["scenarios"][0]["splits"]:
        assert s["grad_rel_diff"] < 1e-12 and s["update_rel_diff"] < 1e-12
        assert abs(s["objective"] - s["objective_reference"]) < 1e-12


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
    assert bounds["grad_rel_diff"] == pytest.approx(64 * 2.0**-23)  # the dtype floor wins over 16 x 1e-7
    assert verdict({"grad_rel_diff": 1e-6, "update_rel_diff": 1e-5}, bounds) == "pass"
    assert verdict({"grad_rel_diff": 1e-6, "update_rel_diff": 1e-4}, bounds) == "fail"
    assert verdict({"grad_rel_diff": float("nan"), "update_rel_diff": 0.0}, bounds) == "fail"


@pytest.mark.parametrize("fn, code", [("correct_token_mean", 0), ("microbatch_mean", 1), ("microbatch_topk", 1)])
def test_audit_exit_codes(fn, code, tmp_path, monkeypatch):
    pytest.importorskip("splitproof.diagnose.audit")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    path = tmp_path / "a.json"
    assert (
        main(
            [
                "diagnose",
                "audit",
                "--loss-fn",
                f"tests.audit_examples:{fn}",
                "--convention",
                "verl",
                "--loss-mode",
                "kl_cov",
                "--json",
                str(path),
            ]
        )
        == code
    )
    assert json.loads(path.read_text())["passed"] is (code == 0)


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
    code = main(
        [
            "diagnose",
            "--model",
            str(path),
            "--loss-mode",
            "geo_mean",
            "--sequences",
            "4",
            "--response-length",
            "6",
            "--split",
            "even:4",
            "--split",
            "sizes:1,3",
            "--dtype",
            "float64",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
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
    code = main(
        [
            "diagnose",
            "--loss-mode",
            "vanilla",
            "--sequences",
            "6",
            "--response-length",
            "8",
            "--split",
            "packed:40",
            "--dtype",
            "float64",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    record = json.loads(out.read_text())
    assert code == 0 and record["passed"]


def test_audit_of_a_file_shows_what_the_user_typed(tmp_path, monkeypatch, capsys):
    (tmp_path / "mylosses.py").write_text(
        "import torch\n\n"
        "def plain_sum(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, weights=None):\n"
        "    loss = -advantages * torch.exp(log_prob - old_log_prob)\n"
        "    loss = torch.where(response_mask.bool(), loss, torch.zeros_like(loss)).sum()\n"
        "    return loss / config.global_batch_info['batch_num_tokens'], {}\n"
    )
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", "audit", "--loss-fn", "mylosses.py:plain_sum"]) == 1
    out = capsys.readouterr().out
    assert "mylosses.py:plain_sum: FAIL on dp2" in out and "_splitproof_audit_" not in out
    assert "FAIL dp2 (2 ranks" in out and "global_batch_info['dp_size']" in out
