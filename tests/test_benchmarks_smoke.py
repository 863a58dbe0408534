"""Smoke test of benchmarks/: every script's main() in --quick mode, into a temporary docs file.

No timing asserts: only that each script runs, returns its rows, reports finite positive ratios and
writes its marked section (the real docs/benchmarks.md is never touched).
"""

from __future__ import annotations

import importlib.util
import math
import warnings
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"splitproof_bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCRIPTS = _load("run_all").SCRIPTS  # the benchmarks run_all runs: each is smoke-tested here


def _benchlib():
    import sys

    sys.path.insert(0, str(BENCH))
    import benchlib

    return benchlib


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    return tmp_path_factory.mktemp("bench") / "benchmarks.md"


@pytest.fixture(scope="module")
def results(docs):
    """Run every script once (quick, CPU) and keep what main() returned. `vs_trl` looks for TRL only in
    this interpreter (which the test environment does not need to have)."""
    import os

    threads = torch.get_num_threads()
    trl_python = os.environ.pop("SPLITPROOF_TRL_PYTHON", None)
    out = {}
    try:
        for name in SCRIPTS:
            with warnings.catch_warnings():
                out[name] = _load(name).main(["--quick", "--device", "cpu", "--docs", str(docs)])
    finally:
        torch.set_num_threads(threads)
        if trl_python is not None:
            os.environ["SPLITPROOF_TRL_PYTHON"] = trl_python
    return out


def test_engine_overhead(results):
    r = results["engine_overhead"]
    assert {(row["mode"], row["split"].split(",")[0].split(" ")[0]) for row in r["rows"]} == {
        ("token-mean", "fixed"),
        ("token-mean", "token"),
        ("seq-mean-token-mean", "fixed"),
        ("seq-mean-token-mean", "token"),
    }
    for row in r["rows"]:
        assert row["microbatches"] >= 1
        for key in ("engine_s", "plain_s", "engine_wall_s", "plain_wall_s", "ratio", "q1", "q3"):
            assert _positive(row[key]), (key, row)
    assert _positive(r["head"]["ratio"]) and _positive(r["head"]["engine_s"])
    assert math.isfinite(r["head"]["step_share"])


def test_cov_strategies(results):
    r = results["cov_strategies"]
    cells = {(row["loss"], row["ratio"]) for row in r["rows"]}
    assert cells == {(loss, ratio) for loss in ("kl_cov", "clip_cov") for ratio in (2e-4, 2e-3, 2e-2)}
    for row in r["rows"]:
        assert set(row["ratios"]) == {"prepass", "deferred", "auto"}
        assert all(_positive(v) for v in row["ratios"].values())
        assert all(_positive(v) for v in row["times"].values())
        assert row["auto_chose"] in ("prepass", "deferred")
        assert row["selected_tokens"] >= 1 and 1 <= row["touched_sequences"] <= row["sequences"]
        assert (row["deferred_ok"] is None) == (row["ratio"] != 2e-4)


def test_token_budget(results):
    r = results["token_budget"]
    assert r["rows"][0]["split"] == "fixed" and len(r["rows"]) >= 2
    real = r["rows"][0]["real"]
    for row in r["rows"]:
        assert row["real"] == real  # the same tokens, only split differently
        assert row["computed"] >= row["real"]
        assert 0 <= row["padding_share"] < 1 and 0 <= row["contiguous_share"] <= row["padding_share"] + 1e-12
        assert _positive(row["throughput_ratio"]) and _positive(row["tokens_per_s"])
    assert _positive(r["throughput_ratio"])


def test_memory(results):
    r = results["memory"]
    sweeps = {row["sweep"] for row in r["rows"]}
    assert sweeps == {"microbatch size", "minibatch size"}
    for row in r["rows"]:
        assert _positive(row["peak"]) and _positive(row["largest_activation"]) and _positive(row["relative"])
    assert all(_positive(v) for v in r["flat"].values())
    micro = [row for row in r["rows"] if row["sweep"] == "microbatch size"]
    assert micro[-1]["largest_activation"] > micro[0]["largest_activation"]  # bigger microbatch, bigger logits


def test_scaling(results):
    r = results["scaling"]
    assert len(r["rows"]) == 4
    for row in r["rows"]:
        assert _positive(row["step_s"]) and _positive(row["vs_linear"]) and _positive(row["per_sequence_s"])
    assert math.isfinite(r["slope"]) and math.isfinite(r["r2"])
    assert r["diagnose"]["status"] == "skipped"


def test_rollout(results):
    r = results["rollout"]
    assert {(row["model"], row["setting"]) for row in r["generation"]} == {
        (m, s) for m in ("tiny", "small") for s in ("T 1", "T 0.8, top-k 50, top-p 0.9")
    }
    for row in r["generation"]:
        assert all(_positive(row[k]) for k in ("ours_s", "plain_s", "ratio", "q1", "q3"))
    assert {row["pick"] for row in r["picks"]} == {
        "log_softmax only",
        "counter-based inverse CDF",
        "torch.multinomial",
        "counter-based Gumbel-max",
    }
    assert all(_positive(row["ms"]) for row in r["picks"])
    assert {row["variant"] for row in r["old"]} == {"compute_log_probs", "plain forward", "forward + log_softmax head"}
    assert all(_positive(row["ms"]) and _positive(row["ratio"].median) for row in r["old"])
    assert {(row["model"], row["kind"]) for row in r["old"]} == {
        ("tiny", "model"),
        ("tiny", "zero-logits stand-in"),
        ("small", "model"),
    }
    assert {row["dtype"] for row in r["drift"]} == {"float32", "float64"}
    for row in r["drift"]:
        assert 0 <= row["differ"] <= row["samples"] and math.isfinite(row["max_logprob_gap"])
        if row["dtype"] == "float64":  # layout-independent generation: identical, and equal to the full forward
            assert row["differ"] == 0 and row["max_logprob_gap"] == 0.0 and row["vs_full"] < 1e-12


def test_train_stages(results):
    r = results["train_stages"]
    for clock in ("wall", "cpu"):
        table = r["per_step"][clock]
        assert len(table["total"]) == r["steps"] == 2
        for key in ("total", "gen", "old_log_prob", "update"):
            assert all(_positive(x) for x in table[key]), (clock, key)
        assert 0 <= r["overhead"][clock]["run"] < 1 and math.isfinite(r["overhead"][clock]["median"])
    assert sum(r["per_step"]["wall"]["testing"]) > 0  # the quick run evaluates at its last step


def test_vs_trl(results):
    r = results["vs_trl"]
    rows = {row["key"]: row for row in r["rows"]}
    for key in ("total", "gen", "old_log_prob", "update", "tokens_per_s"):
        assert _positive(rows[key]["ours_cpu"]) and _positive(rows[key]["ours_wall"]), key
    assert len(r["summaries"]["ours"]) == 1 and _positive(r["summaries"]["ours"][0]["peak"])
    assert all(0 <= v <= 1 for v in r["scores"].values()) and set(r["scores"]) >= {"initial", "ours-0"}
    ours = [row for row in r["split_rows"] if row["side"] == "splitproof"]
    assert len(ours) == 1 and ours[0]["same_samples"]
    assert ours[0]["max_rel"] <= 1e-5 and ours[0]["norm_rel"] <= 1e-5  # the split leaves our update alone
    if r["trl_python"] is None:  # no TRL here: only our side ran
        assert r["summaries"]["trl"] == [] and {row["side"] for row in r["split_rows"]} == {"splitproof"}


def test_vs_trl_model(docs):
    """`vs_trl.py --model DIR` (here the built-in model's own directory, taken as a model one brings): each
    part of the step for the recompute and bypass_mode variants (no TRL in this interpreter)."""
    import os

    from splitproof.builtin import charlm_directory

    threads = torch.get_num_threads()
    trl_python = os.environ.pop("SPLITPROOF_TRL_PYTHON", None)
    try:
        r = _load("vs_trl").main(["--quick", "--device", "cpu", "--docs", str(docs), "--model", charlm_directory()])
    finally:
        torch.set_num_threads(threads)
        if trl_python is not None:
            os.environ["SPLITPROOF_TRL_PYTHON"] = trl_python
    assert r["variants"] == ["recompute", "bypass", "grouped", "grouped_bypass"] and r["trl_python"] is None
    rows = {row["key"]: row for row in r["rows"]}
    for name in r["variants"]:
        for key in ("gen", "update", "total", "tokens_per_s"):
            assert _positive(rows[key][f"{name}_cpu"]) and _positive(rows[key][f"{name}_wall"]), (name, key)
    assert _positive(rows["old_log_prob"]["recompute_cpu"])
    assert rows["old_log_prob"]["bypass_cpu"] == 0.0  # bypass_mode=true: no old-log-prob pass
    assert "| whole step |" in r["markdown"]


def test_vs_trl_reward_reads_chat_completions():
    """TRL hands a chat model's completions over as messages: the rule scores the assistant message's text."""
    _benchlib()
    from vs_trl_trl_side import addition_reward

    chat = [[{"role": "assistant", "content": "72"}], [{"role": "assistant", "content": "71"}]]
    assert addition_reward(None, chat, ["72", "72"]) == [1.0, 0.0]
    assert addition_reward(None, ["72", "7"], ["72", "72"]) == [1.0, 0.0]


def test_multi_turn(results):
    r = results["multi_turn"]
    assert [row["variant"].split(",")[0] for row in r["rows"]] == ["single-turn", "multi-turn", "multi-turn"]
    assert r["requests"] < r["turns"] <= 3 * r["requests"] and 0 < r["calls"] <= 2 * r["requests"]
    single, instant, slow = r["rows"]
    assert instant["tokens"] == slow["tokens"] == r["model_tokens"] > 0
    assert abs(single["tokens"] - r["model_tokens"]) <= r["requests"] / 2  # the same total, to the rounding
    for row in r["rows"]:
        assert all(_positive(row[k]) for k in ("wall_s", "cpu_s", "wall_tps", "cpu_tps"))
    assert 0 <= r["blocked"]["instant"] and 0 <= r["blocked"]["slow"]


def test_docs_sections(results, docs):
    text = docs.read_text()
    for name in SCRIPTS:
        begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        assert text.count(begin) == 1 and text.count(end) == 1
        body = text[text.index(begin) : text.index(end)]
        assert "| --- |" in body or "|---|" in body  # a generated table
        assert "CPU:" in body and "torch " in body and "threads" in body  # the machine description


def test_write_section_replaces_only_its_own_block(tmp_path):
    benchlib = _benchlib()

    path = tmp_path / "b.md"
    path.write_text("# T\n\nintro\n\n<!-- bench:a -->\nold a\n<!-- /bench:a -->\n\nprose about a\n")
    benchlib.write_section(path, "a", "new a")
    benchlib.write_section(path, "b", "new b")
    benchlib.write_section(path, "b", "newer b")
    text = path.read_text()
    assert "old a" not in text and "new a" in text and "prose about a" in text and "intro" in text
    assert text.count("<!-- bench:b -->") == 1 and "newer b" in text and "new b\n" not in text


def test_run_all_rejects_unknown_names():
    with pytest.raises(SystemExit) as err:
        _load("run_all").main(["--only", "nope", "--no-docs"])
    assert err.value.code == 2


def test_quick_runs_never_write_the_published_docs(capsys):
    bl = _benchlib()
    assert bl.docs_target(None, no_docs=False, quick=True) is None
    with pytest.raises(SystemExit) as err:
        bl.docs_target(str(bl.DEFAULT_DOCS), no_docs=False, quick=True)
    assert "--quick never writes" in str(err.value.code)


def test_published_docs_need_a_clean_tree(monkeypatch):
    bl = _benchlib()
    monkeypatch.setattr(bl, "tree_changes", lambda repo=None, ignore=None: ["splitproof/objective.py"])
    with pytest.raises(SystemExit) as err:
        bl.docs_target(None, no_docs=False, quick=False)
    assert "clean tree" in str(err.value.code) and "splitproof/objective.py" in str(err.value.code)
    monkeypatch.setattr(bl, "tree_changes", lambda repo=None, ignore=None: [])
    assert bl.docs_target(None, no_docs=False, quick=False) == bl.DEFAULT_DOCS
    assert bl.docs_target("elsewhere.md", no_docs=False, quick=True).name == "elsewhere.md"


def test_revision_names_the_commit_and_ignores_the_docs_it_writes(tmp_path):
    import subprocess

    bl = _benchlib()

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "bench.md").write_text("tables\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True
    ).stdout.strip()
    (tmp_path / "bench.md").write_text("new tables\n")  # what the run itself writes
    assert bl.tree_changes(tmp_path, ignore=tmp_path / "bench.md") == []
    assert bl.git_revision(tmp_path, ignore=tmp_path / "bench.md") == f"commit {head} (clean tree)"
    (tmp_path / "code.py").write_text("x = 2\n")
    assert bl.tree_changes(tmp_path, ignore=tmp_path / "bench.md") == ["code.py"]
    assert bl.git_revision(tmp_path, ignore=tmp_path / "bench.md") == f"commit {head} + uncommitted changes"


def test_refill_round(results, docs):
    r = results["refill_round"]
    assert len(r["dapo"]["rounds"]) == len(r["plain"]["rounds"]) == r["steps"]
    assert all(k >= 1 for k in r["dapo"]["rounds"]) and set(r["plain"]["rounds"]) == {1}
    assert all(_positive(x) for x in r["dapo"]["round_cpu"] + r["plain"]["step_cpu"])
    assert "<!-- bench:refill_round -->" in docs.read_text()


def test_lora(results):
    r = results["lora"]
    (cell,) = r["cells"]
    full, lora = cell["full"], cell["lora"]
    assert lora["trainable"] < full["trainable"] == full["parameters"] and lora["parameters"] > full["parameters"]
    for v in (full, lora):
        assert all(_positive(v[k]) for k in ("peak_rss_mb", "loaded_rss_mb", "step_s", "step_cpu_s", "state_mb"))
        assert 0 < v["saved_vocab_mb"] < v["saved_mb"]  # the logits are a part of what the backward keeps
    assert 3 <= full["state_mb"] / full["weights_mb"] < 3.01  # a gradient and two AdamW moments per weight
    assert lora["state_mb"] < full["state_mb"] and 0 < lora["adapter_share"] < 1
    assert _positive(cell["rss_ratio"]) and r["best_rss_ratio"] == cell["rss_ratio"]


def test_reward_models(results):
    r = results["reward_models"]
    for kind in ("classifier", "judge"):
        for clock in ("cpu", "wall"):
            row = r[kind][clock]
            assert all(_positive(row[k]) for k in ("gen", "old_log_prob", "update", "reward_model", "step")), row
            assert 0 < row["share"] < 1
    policy, judge = r["judge"]["policy"], r["judge"]["judge"]
    assert policy["tokens"] > 0 and 0 < judge["tokens"] <= 8 * judge["sequences"]  # at most 8 answer tokens
    assert judge["sequences"] == policy["sequences"]  # one question per sample
    assert r["classifier"]["judge"]["calls"] == 0  # the reward model's run never asks the judge
    assert _positive(r["judge_vs_policy_cpu"]) and _positive(r["judge_vs_policy_wall"])


def test_host_memory():
    """Hand-run (a few minutes at full size), so not in run_all: with freed memory kept a settled step maps
    no new pages; with glibc's defaults every step maps its large tensors again."""
    r = _load("host_memory").main(["--quick", "--device", "cpu", "--no-docs", "--steps", "6"])
    kept, defaults = r["runs"]["kept"][0], r["runs"]["defaults"][0]
    assert kept["kept"] and not defaults["kept"]
    # the heap may still grow in a step or two after step 2 (fragmentation), never in all of them
    assert min(kept["faults"][2:]) < 100 < 1000 < min(defaults["faults"][2:]), (kept["faults"], defaults["faults"])
    assert _positive(r["ratio"].median) and "| `true` |" in r["markdown"]
