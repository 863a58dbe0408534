"""Multi-turn episodes with tool calls: the trajectory (tokens, masks, weights, every metric) is the same
whatever the generation batch size, the tool pool's size and the tools' random latency (so completion
order), and the data-parallel size; what is trained is exactly what was generated and appended; bad tool
setups are one line and exit 2 before any model. float64, the built-in model, a test format that makes it
call a tool at every digit it writes (tests/multiturn_format.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.cli import main
from splitproof.engine.launch import run_data_parallel
from splitproof.rl import run as run_module
from splitproof.rl.rollout.sampling import shift_keys, stream_keys, stream_uniforms, token_uniforms
from splitproof.rl.rollout.tool_format import plain_encoder
from splitproof.rl.rollout.tool_runner import ToolRunner
from splitproof.rl.rollout.tools import ToolCall, call_tool, load_function_tools, result_text, truncate

from .multiturn_format import DigitFormat, digit_calls
from .rl_helpers import (
    HERE,
    assert_same_trajectory,
    assert_usage_error,
    run_trajectory,
    train_overrides,
    trajectory_config,
)

STEPS = 3
TOOLS = HERE / "multiturn_tools.py"
MULTI_TURN = [
    "actor_rollout_ref.model.path=builtin://charlm",
    "actor_rollout_ref.rollout.multi_turn.enable=true",
    "actor_rollout_ref.rollout.multi_turn.format=simple",
    f"actor_rollout_ref.rollout.multi_turn.function_tool_path={TOOLS}",
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",  # a third digit in a turn is dropped
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=6",
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right",
    "data.max_response_length=32",
    "actor_rollout_ref.actor.optim.lr=0.002",  # the built-in model keeps calling tools for the 3 steps
]
LAYOUTS = {  # generation batch size and tool pool size: speed only
    "ones": [
        "actor_rollout_ref.rollout.max_num_seqs=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3",
    ],
    "uneven": ["actor_rollout_ref.rollout.max_num_seqs=5", "actor_rollout_ref.rollout.agent.num_workers=8"],
}


@pytest.fixture(autouse=True)
def _digit_format(monkeypatch):
    digit_calls(monkeypatch)


@pytest.fixture(scope="module")
def baseline():
    with pytest.MonkeyPatch.context() as mp:
        digit_calls(mp)
        return run_trajectory(trajectory_config("builtin://charlm", STEPS, MULTI_TURN))


def assert_same_episodes(got, want):
    """Identical tokens, masks, turns and calls; weights and metrics as ``assert_same_trajectory``; rollout
    log-probs within 1e-12 (after step 1 the weights may differ by the update's rounding, 1e-16 relative)."""
    assert_same_trajectory(got, want)
    for a, b in zip(got["samples"], want["samples"]):
        assert [(s.token_mask, s.num_turns, s.tool_calls, s.tool_errors) for s in a] == [
            (s.token_mask, s.num_turns, s.tool_calls, s.tool_errors) for s in b
        ]
        gap = max(abs(x - y) for s, t in zip(a, b) for x, y in zip(s.log_probs, t.log_probs))
        assert gap <= 1e-12, gap


def test_tools_are_called_at_every_step(baseline):
    """Not vacuous: every step has tool turns (episodes of 4 turns and more); the run has failed and
    dropped calls."""
    for record, samples in zip(baseline["records"], baseline["samples"]):
        assert record["multi_turn/tool_calls/mean"] > 0.5 and record["num_turns/max"] >= 4
        assert record["response_length/mean"] > record["response_length_model/mean"]
        assert any(0 in s.token_mask for s in samples)
    for name in ("multi_turn/dropped_calls/mean", "multi_turn/tool_failures/mean"):
        assert any(r[name] > 0 for r in baseline["records"]), name


def test_trained_tokens_are_the_generated_and_appended_ids(baseline):
    """Token in, token out: the rollout's log-probs of every model token equal the training forward's on
    the exact ids, tool tokens in context (float64: rollout_corr's log-ppl gap is 0 to rounding); a tool
    segment decodes to the formatted response of its calls."""
    tokenizer = char_tokenizer()
    for record in baseline["records"]:
        assert abs(record["rollout_corr/log_ppl_abs_diff"]) < 1e-12
    for sample in baseline["samples"][0]:
        mask = sample.token_mask
        assert len(mask) == len(sample.response_ids) == len(sample.log_probs)
        assert all(lp == 0.0 for lp, m in zip(sample.log_probs, mask) if not m)
        tool_text = tokenizer.decode([t for t, m in zip(sample.response_ids, mask) if not m])
        assert all(line.startswith("=") for line in tool_text.splitlines())
        assert mask[-1] == 1  # an episode ends on the model's turn


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_generation_batch_and_tool_pool_do_not_change_the_trajectory(baseline, layout):
    """max_num_seqs 1 / 5 / all, pool 1 / 8, with 0–50 ms random latency per call (completion order varies)."""
    assert_same_episodes(
        run_trajectory(trajectory_config("builtin://charlm", STEPS, MULTI_TURN + LAYOUTS[layout])), baseline
    )


def _dp_worker(world_extra):
    digit_calls(pytest.MonkeyPatch())
    overrides = MULTI_TURN + [
        "actor_rollout_ref.rollout.max_num_seqs=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        *world_extra,
    ]
    return run_trajectory(trajectory_config("builtin://charlm", STEPS, overrides))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_does_not_change_the_trajectory(baseline, world):
    for got in run_data_parallel(_dp_worker, world, ["actor_rollout_ref.actor.strategy=ddp"]):
        assert_same_episodes(got, baseline)


# ----------------------------------------------------------------------------------------- pieces


def test_a_turn_continues_its_stream():
    """Token t of a turn that starts at episode position p draws the uniform of position p + t."""
    keys = stream_keys(42, 0, 3, torch.tensor([5, 9]), torch.tensor([0, 2]))
    shifted = stream_uniforms(shift_keys(keys, torch.tensor([7, 11])), 4)
    for t in range(4):
        assert torch.equal(shifted[0, t], token_uniforms(keys, 7 + t)[0])
        assert torch.equal(shifted[1, t], token_uniforms(keys, 11 + t)[1])


def test_tool_results_errors_and_truncation():
    tools = {t.name: t for t in load_function_tools(str(TOOLS))}
    assert tools["lookup"].schema["function"]["parameters"]["required"] == ["key"]
    assert call_tool(tools, ToolCall("lookup", '{"key": "2"}')).text == "aaa"
    assert call_tool(tools, ToolCall("lookup", '{"key": "3"}')).text == '{"key": 3, "value": [1, 2]}'
    for call, words in (
        (ToolCall("lookup", '{"key": "7"}'), "key 7 is broken"),
        (ToolCall("nope", "{}"), "unknown tool"),
        (ToolCall("lookup", "[1]"), "JSON object"),
    ):
        result = call_tool(tools, call)
        assert (
            result.status == "error" and result.text.startswith("Error when executing tool: ") and words in result.text
        )
    assert result_text(3.5) == "3.5" and result_text(object).startswith("<class")
    assert truncate("abcdefgh", 4, "left") == "abcd...(truncated)"
    assert truncate("abcdefgh", 4, "right") == "(truncated)...efgh"
    assert truncate("abcdefgh", 4, "middle") == "ab...(truncated)...gh"


def test_a_slow_tool_times_out_with_a_defined_text(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text(
        'import asyncio\n\nasync def wait(seconds: float) -> str:\n    """Wait.\n\n    Args:\n'
        '        seconds: how long\n    """\n    await asyncio.sleep(seconds)\n    return "done"\n'
    )
    tools = {t.name: t for t in load_function_tools(str(slow))}
    runner = ToolRunner(tools, workers=2, timeout=0.2)
    fast, late = runner.submit(ToolCall("wait", '{"seconds": 0.01}')), runner.submit(ToolCall("wait", '{"seconds": 2}'))
    assert runner.result(fast).text == "done"
    assert (runner.result(late).status, runner.result(late).text) == (
        "timeout",
        "Error when executing tool: timed out after 0.2 s",
    )
    runner.close()


def test_digit_format_parses_in_order():
    tokenizer = char_tokenizer()
    calls, _ = DigitFormat(tokenizer, {}).parse(tokenizer.encode("4x2") + [tokenizer.eos_token_id])
    assert [json.loads(c.arguments)["key"] for c in calls] == ["4", "2"]


def test_simple_and_hermes_formats():
    from splitproof.rl.rollout.tool_format import HermesFormat, SimpleFormat
    from splitproof.rl.rollout.tools import function_tool

    def mul(a: int, b: int) -> int:
        """Multiply.

        Args:
            a: left
            b: right
        """
        return a * b

    tools = {"mul": function_tool(mul, "test")}
    tokenizer = char_tokenizer()
    simple = SimpleFormat(tokenizer, tools)
    calls, _ = simple.parse(tokenizer.encode(" mul(12, 34)") + [tokenizer.eos_token_id])
    assert calls == [ToolCall("mul", '{"a": 12, "b": 34}')] and call_tool(tools, calls[0]).text == "408"
    assert simple.parse(tokenizer.encode("mul 12"))[0] == []
    assert tokenizer.decode(simple.render(["408", "x"])) == "=408\n=x\n"
    hermes = HermesFormat(tokenizer, tools)
    text = 'ok <tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call><tool_call>{bad}</tool_call>'
    calls, malformed = hermes.parse(tokenizer.encode(text))
    assert calls == [ToolCall("mul", '{"a": 2, "b": 3}')] and malformed == 1
    # the template's text after an assistant turn (``assistant: ...\n``), then the generation prompt
    assert tokenizer.decode(hermes.render(["408", "x"])) == "\ntool: 408\ntool: x\nassistant: "


def test_the_plain_encoder_gives_the_tokenizers_ids(monkeypatch):
    """``plain_encoder``: the Rust tokenizer's ids are ``tokenizer.encode``'s (specials, unknown characters);
    a tokenizer whose backend truncates or that splits special tokens keeps ``tokenizer.encode``."""
    texts = ["=408\n", "<eos>x<pad>", "tab\there é", ""]
    tokenizer = char_tokenizer()
    expected = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    encode = plain_encoder(tokenizer)
    with monkeypatch.context() as m:
        m.setattr(tokenizer, "encode", None)  # the fast path never calls it
        assert [encode(t) for t in texts] == expected
    truncating = char_tokenizer()
    truncating.backend_tokenizer.enable_truncation(2)
    assert [plain_encoder(truncating)(t) for t in texts] == expected
    splitting = char_tokenizer()
    splitting.split_special_tokens = True
    assert plain_encoder(splitting)("<eos>") == splitting.encode("<eos>", add_special_tokens=False) != [1]


# ------------------------------------------------------------------------------------- bad setups

BAD_TOOLS = {
    "fails to import": (
        "import not_a_module_anywhere\n",
        ["function_tool_path", "failed to import", "not_a_module_anywhere"],
    ),
    "no type hint": (
        'def add(a, b: int) -> int:\n    """Add.\n\n    Args:\n        a: x\n        b: y\n    """\n    return a + b\n',
        ["'add'", "type hint", "Argument a"],
    ),
    "no docstring": ("def add(a: int) -> int:\n    return a\n", ["'add'", "docstring"]),
}
BAD_SETUPS = {
    "enable without a tool": (
        ["actor_rollout_ref.rollout.multi_turn.enable=true"],
        ["multi_turn.enable", "function_tool_path"],
    ),
    "unknown class in the YAML": (
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path={yaml}",
        ],
        ["tool_config_path", "tools[0]", "unknown class", "nowhere_pkg.Calc"],
    ),
    "a multi-turn key without enable": (
        ["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"],
        ["multi_turn.max_assistant_turns", "only read with", "enable=true"],
    ),
    "unknown format": (
        [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={TOOLS}",
            "actor_rollout_ref.rollout.multi_turn.format=xml",
        ],
        ["multi_turn.format", "'xml'"],
    ),
}


def _exit_2_before_any_model(overrides, words, tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    out = tmp_path / "out"
    code = main(["train", *train_overrides("builtin://charlm", out, 2), *overrides])
    assert_usage_error(code, capsys.readouterr().err, words, out)


@pytest.mark.parametrize("mistake", list(BAD_TOOLS))
def test_a_bad_tool_file_is_one_line_and_exit_2(mistake, tmp_path, monkeypatch, capsys):
    source, words = BAD_TOOLS[mistake]
    (tmp_path / "tools.py").write_text(source)
    overrides = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tmp_path / 'tools.py'}",
    ]
    _exit_2_before_any_model(overrides, words, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("mistake", list(BAD_SETUPS))
def test_a_bad_multi_turn_setup_is_one_line_and_exit_2(mistake, tmp_path, monkeypatch, capsys):
    overrides, words = BAD_SETUPS[mistake]
    yaml_file = tmp_path / "tools.yaml"
    yaml_file.write_text("tools:\n  - class_name: nowhere_pkg.Calc\n    config: {type: native}\n")
    _exit_2_before_any_model([o.format(yaml=yaml_file) for o in overrides], words, tmp_path, monkeypatch, capsys)


def test_metrics_are_finite(baseline):
    for record in baseline["records"]:
        assert all(math.isfinite(v) for v in record.values())


def test_the_builtin_tool_task():
    """builtin://product scores the last line (the answer after the tool's response); the built-in
    calculator loads by package path and answers the simple format's call."""
    from splitproof.rl.data.tasks import final_line_score, task_rows
    from splitproof.rl.rollout.tool_format import SimpleFormat
    from splitproof.rl.rollout.tools import load_tools

    row = task_rows("builtin://product/test?size=1")[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == f"{a}*{b}=" and row["reward_model"]["ground_truth"] == str(a * b) and 100 <= a < 1000
    tools = load_tools("pkg://splitproof.builtin.calculator", None)
    tokenizer = char_tokenizer()
    calls, _ = SimpleFormat(tokenizer, tools).parse(tokenizer.encode(f"mul({a},{b})"))
    answer = call_tool(tools, calls[0]).text
    assert answer == str(a * b)
    assert final_line_score(f"mul({a},{b})={answer}\n{answer}", answer) == 1.0
    assert final_line_score(f"mul({a},{b})={answer}\n", answer) == 0.0  # the tool's text is not the answer


@pytest.mark.slow
def test_killed_mid_episode_and_resumed_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL after step 2's first tool turn (checkpoint 1 on disk), then ``resume_mode=auto``: the same
    metrics, step for step, as a run never interrupted."""
    from splitproof.rl.tracking.loggers import read_metrics

    from .test_train_resume import _kill_at, _same_metrics

    def args(out):
        return train_overrides(
            "builtin://charlm", out, 3, extra=[*MULTI_TURN, "trainer.save_freq=1", "data.val_files=null"]
        )

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *args(whole)]) == 0
    _kill_at(args(killed), "step2:stream0:tools1", tmp_path / "paused")
    assert (killed / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert main(["train", *args(killed)]) == 0
    _same_metrics(read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl"))
