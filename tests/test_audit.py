"""The audit of third-party policy-loss functions in verl's calling convention."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from splitproof.diagnose.audit import (
    SPLIT_KINDS,
    AuditError,
    AuditReport,
    VerlActorConfig,
    likely_cause,
    load_loss_fn,
    run_audit,
)
from splitproof.loss_config import LossConfig
from tests import audit_examples as ex

ROW_KEYS = {"split", "microbatches", "grad_max_abs_diff", "grad_rel_diff", "control_rel_diff", "verdict"}


@pytest.fixture(scope="module")
def reports() -> dict[str, AuditReport]:
    return {name: run_audit(getattr(ex, name)) for name in ("correct_token_mean", "microbatch_mean", "microbatch_topk")}


def _by_split(report: AuditReport) -> dict[str, dict]:
    return {row["split"]: row for row in report.rows}


def test_correct_function_passes_every_split(reports):
    report = reports["correct_token_mean"]
    assert report.passed
    rows = _by_split(report)
    assert set(rows) == set(SPLIT_KINDS)
    for row in rows.values():
        assert row["verdict"] == "pass", row
        assert row["grad_rel_diff"] <= max(16 * row["control_rel_diff"], 1e-12)


@pytest.mark.parametrize("name", ["microbatch_mean", "microbatch_topk"])
def test_split_dependent_functions_fail(reports, name):
    report = reports[name]
    assert not report.passed
    rows = _by_split(report)
    for split in ("uneven", "many_small"):
        assert rows[split]["verdict"] == "fail", rows[split]
        assert rows[split]["grad_rel_diff"] > 1e-3  # a real difference, far above the float floor


def test_missing_dp_size_fails_only_under_dp_and_says_why():
    report = run_audit(ex.missing_dp_size, name="my_losses.py:plain_sum")
    rows = _by_split(report)
    assert [k for k, r in rows.items() if r["verdict"] != "pass"] == ["dp2"]
    assert rows["dp2"]["grad_scale"] == pytest.approx(0.5, rel=1e-12)
    assert "dp_size" in rows["dp2"]["cause"] and rows["uneven"]["cause"] is None
    table = report.format_table()
    assert "FAIL dp2 (2 ranks" in table and "global_batch_info['dp_size']" in table
    assert report.settings["loss_fn"] == "my_losses.py:plain_sum" and "my_losses.py:plain_sum: FAIL on dp2" in table


def test_likely_cause_tells_rescaled_from_reweighted(reports):
    rows = _by_split(reports["microbatch_mean"])
    # one sequence per microbatch: every row weighs 1 instead of 1/16, a constant factor
    assert rows["many_small"]["grad_scale"] == pytest.approx(16.0, rel=1e-12)
    assert "constant multiple" in rows["many_small"]["cause"]
    # uneven microbatches: each row weighs 1/|microbatch|, a reweighting
    assert rows["uneven"]["grad_scale"] is None and "reweighted" in rows["uneven"]["cause"]
    text, factor = likely_cause(None, None, torch.zeros(1), torch.ones(1, dtype=torch.bool), 1e-12, error="boom")
    assert factor is None and "raises" in text


def test_microbatch_mean_fails_every_split(reports):
    # a local mean over the rows changes the weight of every sequence under any split
    assert all(row["verdict"] == "fail" for row in reports["microbatch_mean"].rows)


def test_report_json_schema(reports):
    report = reports["microbatch_topk"]
    data = json.loads(report.to_json())
    assert set(data) == {"passed", "rows", "settings"}
    assert data["passed"] is False
    assert [row["split"] for row in data["rows"]] == list(SPLIT_KINDS)
    for row in data["rows"]:
        assert ROW_KEYS <= set(row)
        assert row["verdict"] in ("pass", "fail", "error")
        assert isinstance(row["microbatches"], int) and row["microbatches"] >= 2
    settings = data["settings"]
    for key in (
        "convention",
        "loss_mode",
        "agg_mode",
        "seed",
        "sequences",
        "response_length",
        "dtype",
        "batch_num_tokens",
        "global_batch_size",
    ):
        assert key in settings
    assert settings["convention"] == "verl" and settings["dtype"] == "float64"
    assert settings["global_batch_size"] == 16
    assert 0 in settings["sequence_lengths"]  # one empty sequence
    by = _by_split(report)
    assert by["many_small"]["microbatches"] == 16
    assert by["dp2"]["ranks"] == 2
    assert max(by["token_budget"]["tokens_per_microbatch"]) <= settings["token_budget"]
    assert "FAIL" in report.format_table()


def test_global_batch_info_and_config_as_verl_fills_them():
    seen = []

    def spy(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        assert log_prob.dtype == torch.float64 and log_prob.requires_grad
        assert not old_log_prob.requires_grad and rollout_is_weights is None
        assert log_prob.shape == response_mask.shape == advantages.shape and log_prob.shape[-1] == 12
        seen.append(
            (
                dict(config.global_batch_info),
                loss_agg_mode,
                config.loss_agg_mode,
                config.policy_loss.loss_mode,
                int(response_mask.sum()),
            )
        )
        return ex.correct_token_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)

    report = run_audit(spy, loss_mode="kl_cov", agg_mode="seq-mean-token-mean", sequences=8, response_length=12)
    assert report.passed
    n = report.settings["batch_num_tokens"]
    assert sum(tokens for *_, tokens in seen[:1]) == n  # the first call is the whole minibatch
    for info, arg_mode, cfg_mode, loss_mode, _ in seen:
        assert info["batch_num_tokens"] == n and info["global_batch_size"] == 8
        assert info["dp_size"] in (1, 2) and info["loss_scale_factor"] is None
        assert arg_mode == cfg_mode == "seq-mean-token-mean" and loss_mode == "kl_cov"
    assert any(info["dp_size"] == 2 for info, *_ in seen)


def test_verl_actor_config_access():
    cfg = VerlActorConfig.from_loss_config(LossConfig(clip_ratio=0.3, kl_cov_ratio=0.01), dro_beta=0.5)
    assert cfg.clip_ratio == cfg.get("clip_ratio") == cfg["clip_ratio"] == 0.3
    assert cfg.clip_ratio_low == cfg.clip_ratio_high == 0.3  # None in LossConfig -> clip_ratio, as verl
    assert cfg.clip_ratio_c == 3.0 and cfg.tau_pos == 1.0 and cfg.tau_neg == 1.05
    assert cfg.loss_agg_mode == "token-mean" and cfg.loss_scale_factor is None
    assert cfg.get("no_such_field", 7) == 7 and "clip_ratio" in cfg and "nope" not in cfg
    pl = cfg.policy_loss
    assert pl.loss_mode == "vanilla" and pl.get("kl_cov_ratio") == 0.01 and pl["dro_beta"] == 0.5
    assert "ppo_kl_coef" in pl and pl.ppo_kl_coef == 0.1 and pl.clip_cov_lb == 1.0 and pl.clip_cov_ub == 5.0
    assert pl.clip_cov_ratio == 2e-4 and pl.get("rollout_correction").get("rollout_is_threshold") == 2.0
    assert isinstance(cfg.global_batch_info, dict)
    with pytest.raises(ValueError, match="unknown verl actor field"):
        VerlActorConfig.from_loss_config(None, no_such_field=1)


def test_errors_from_the_function_and_settings():
    def broken(*args):
        raise RuntimeError("boom\nsecond line")

    with pytest.raises(AuditError, match="boom") as info:
        run_audit(broken)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="convention"):
        run_audit(ex.correct_token_mean, convention="trl")
    with pytest.raises(ValueError, match="aggregation"):
        run_audit(ex.correct_token_mean, agg_mode="mean")
    with pytest.raises(ValueError, match="no group ids"):  # verl's convention has no uid argument
        run_audit(ex.correct_token_mean, agg_mode="group-mean-token-mean")

    def fails_on_small(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, w):
        if response_mask.shape[0] == 1:
            raise ValueError("needs two rows")
        return ex.correct_token_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config)

    report = run_audit(fails_on_small)
    rows = _by_split(report)
    assert not report.passed and rows["many_small"]["verdict"] == "error"
    assert "needs two rows" in rows["many_small"]["error"]


def test_load_loss_fn():
    assert load_loss_fn("tests.audit_examples:microbatch_mean") is ex.microbatch_mean
    assert load_loss_fn("splitproof.diagnose.audit:control_token_mean").__name__ == "control_token_mean"
    cases = {
        "no_colon_here": "malformed",
        "a:b:c": "malformed",
        ":fn": "malformed",
        "tests.audit_examples:": "malformed",
        "no_such_module_xyz.sub:fn": "cannot import",
        "tests.audit_examples:no_such_function": "no attribute",
        "tests.audit_examples:NOT_CALLABLE": "not callable",
    }
    for spec, message in cases.items():
        with pytest.raises(ValueError, match=message) as info:
            load_loss_fn(spec)
        assert "\n" not in str(info.value), spec


def _cli_exit(main, argv) -> int:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return 0 if code is None else int(code)


@pytest.mark.skipif(importlib.util.find_spec("splitproof.cli") is None, reason="splitproof.cli not written yet")
def test_cli_audit_exit_codes(capsys):
    from splitproof.cli import main

    base = ["diagnose", "audit", "--convention", "verl", "--loss-fn"]
    assert _cli_exit(main, base + ["tests.audit_examples:correct_token_mean"]) == 0
    assert _cli_exit(main, base + ["tests.audit_examples:microbatch_mean"]) == 1
    assert _cli_exit(main, base + ["tests.audit_examples:microbatch_topk"]) == 1
    capsys.readouterr()
    assert _cli_exit(main, base + ["tests.audit_examples:no_such_function"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
