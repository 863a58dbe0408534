"""Tools that misbehave: a call that hangs past ``multi_turn.tool_timeout`` ends on time whatever the pool
size (and whichever result is awaited first), and the process exits when the run is done; a tool that calls
``sys.exit`` or raises ``KeyboardInterrupt`` is a counted tool failure with verl's error text, never the end
of the run; the user's Ctrl-C on the main thread still propagates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from splitproof.rl.rollout import tool_runner
from splitproof.rl.rollout.tool_runner import QUICK_CALLS, ToolRunner
from splitproof.rl.rollout.tools import ToolCall, call_tool, load_function_tools

from .rl_helpers import HERE

TOOL_FILE = '''import sys
import threading
import time


def wait(seconds: float) -> str:
    """Wait.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def where(seconds: float) -> str:
    """The thread the call ran on.

    Args:
        seconds: how long it takes
    """
    if seconds:
        time.sleep(seconds)
    return threading.current_thread().name


async def where_async(seconds: float) -> str:
    """The thread the call ran on (a coroutine function).

    Args:
        seconds: how long it takes
    """
    return threading.current_thread().name


def leave(how: str) -> str:
    """Leave.

    Args:
        how: exit or interrupt
    """
    if how == "exit":
        sys.exit(0)
    raise KeyboardInterrupt
'''


@pytest.fixture
def tools(tmp_path):
    path = tmp_path / "tools.py"
    path.write_text(TOOL_FILE)
    return {t.name: t for t in load_function_tools(str(path))}


def _wait(seconds: float) -> ToolCall:
    return ToolCall("wait", json.dumps({"seconds": seconds}))


@pytest.mark.parametrize("workers", [1, 8])
def test_hung_calls_end_on_time_whatever_the_pool_and_the_order_awaited(tools, workers):
    """Two calls that hang (60 s) and a quick one queued behind them, timeout 0.3 s: awaiting the quick one
    first still ends the hung ones at their deadline; each call gets its full timeout from its start."""
    runner = ToolRunner(tools, workers=workers, timeout=0.3)
    begin = time.monotonic()
    hung = [runner.submit(_wait(60)), runner.submit(_wait(60))]
    quick = runner.submit(_wait(0.01))
    assert runner.result(quick).text == "done"
    assert [(r.status, r.text) for r in map(runner.result, hung)] == [
        ("timeout", "Error when executing tool: timed out after 0.3 s")
    ] * 2
    elapsed = time.monotonic() - begin
    runner.close()
    assert elapsed < (0.6 if workers == 1 else 0.3) + 2.0, elapsed  # pool of 1: the two hung calls in turn


def test_a_call_that_finishes_after_its_deadline_is_a_timeout(tools):
    runner = ToolRunner(tools, workers=1, timeout=0.1)
    late = runner.submit(_wait(0.4))
    time.sleep(0.6)  # nobody waits while it runs: it finishes late, and is still a timeout
    assert runner.result(late).status == "timeout"
    runner.close()


def test_settling_waits_for_quick_calls_and_not_for_a_slow_one(tools):
    """The out-of-lockstep engine's pause after a forward (``settle``): quick calls all answer within it; a
    slow call ends it after the quiet time, still running; calls that keep answering end it at its limit."""
    runner = ToolRunner(tools, workers=2)
    quick = [[runner.submit(_wait(0.0))] for _ in range(6)]
    runner.settle(quick, 2.0, 10.0)
    assert all(h.outcome is not None for group in quick for h in group)
    begin = time.monotonic()
    slow = [[runner.submit(_wait(1.0))]]
    runner.settle(slow, 0.05, 10.0)
    assert time.monotonic() - begin < 0.5 and slow[0][0].outcome is None
    trickle = [[runner.submit(_wait(0.02))] for _ in range(40)]  # an answer every 10 ms on 2 workers: 0.4 s
    begin = time.monotonic()
    runner.settle(trickle, 0.2, 0.1)
    assert time.monotonic() - begin < 0.3 and not all(h.outcome is not None for group in trickle for h in group)
    runner.close()


def _threads(runner: ToolRunner, name: str, seconds: list[float]) -> list[str]:
    """The thread each call ran on: "main" (at submit) or "pool", the calls submitted and read one by one."""
    calls = [ToolCall(name, json.dumps({"seconds": s})) for s in seconds]
    return ["pool" if runner.result(runner.submit(c)).text == "splitproof-tool" else "main" for c in calls]


def test_a_quick_tools_calls_run_in_place_until_one_is_slow(tools, monkeypatch):
    """Without a timeout, after QUICK_CALLS calls each within QUICK_S a tool's calls run at submit on the
    caller's thread; a slow one sends it back to the pool until it has been quick QUICK_CALLS times again.
    With a timeout (a call in place could not be abandoned), a coroutine function, or ``quick_inline`` off,
    every call runs on the pool. A runner given ``quick_calls`` starts from the streaks an earlier one left.
    (QUICK_S raised to 0.2 s: a loaded machine can stall a quick call for milliseconds.)"""
    monkeypatch.setattr(tool_runner, "QUICK_S", 0.2)
    runner = ToolRunner(tools, workers=2, quick_inline=True)
    quick, slow = [0.0] * QUICK_CALLS, [0.3]
    assert _threads(runner, "where", quick + [0.0, 0.0]) == ["pool"] * QUICK_CALLS + ["main"] * 2
    assert _threads(runner, "where", slow + quick + [0.0]) == ["main"] + ["pool"] * QUICK_CALLS + ["main"]
    assert _threads(runner, "where_async", quick * 3) == ["pool"] * 3 * QUICK_CALLS
    runner.close()
    streaks: dict[str, int] = {}  # carried from runner to runner, as the episode engine does across rollouts
    for expected in (["pool"] * QUICK_CALLS + ["main"], ["main"] * (QUICK_CALLS + 1)):
        runner = ToolRunner(tools, workers=2, quick_inline=True, quick_calls=streaks)
        assert _threads(runner, "where", quick + [0.0]) == expected
        runner.close()
    for kwargs in ({"timeout": 5.0, "quick_inline": True}, {}):
        runner = ToolRunner(tools, workers=2, **kwargs)
        assert _threads(runner, "where", quick * 3) == ["pool"] * 3 * QUICK_CALLS
        runner.close()


@pytest.mark.parametrize("how, text", [("exit", "SystemExit(0)"), ("interrupt", "KeyboardInterrupt()")])
def test_a_tool_that_exits_or_interrupts_is_a_tool_failure(tools, how, text):
    """On the pool and in place (a quick tool's calls on the caller's thread) alike."""
    call = ToolCall("leave", json.dumps({"how": how}))
    results = []
    for kwargs in ({}, {"quick_inline": True, "quick_calls": {"leave": QUICK_CALLS}}):  # on the pool, in place
        runner = ToolRunner(tools, workers=2, **kwargs)
        results.append(runner.result(runner.submit(call)))
        runner.close()
    assert [(r.status, r.text) for r in results] == [("error", f"Error when executing tool: {text}")] * 2
    if how == "exit":
        assert call_tool(tools, call).status == "error"
    else:  # on the main thread a KeyboardInterrupt is the user's Ctrl-C
        with pytest.raises(KeyboardInterrupt):
            call_tool(tools, call)


RUN = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from multiturn_format import DigitFormat
    from splitproof.cli import main
    from splitproof.rl.rollout import tool_format
    tool_format.FORMATS["simple"] = DigitFormat  # every digit the model writes is a call
    code = main(sys.argv[1:])
    print("main returned", code, flush=True)
    sys.exit(code)
""")


def _train(tmp_path, tool_source: str, extra: list[str], timeout: float):
    (tmp_path / "tools.py").write_text(tool_source)
    (tmp_path / "run.py").write_text(RUN.format(tests=str(HERE)))
    out = tmp_path / "out"
    args = [
        "train",
        "actor_rollout_ref.model.path=builtin://charlm",
        "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "data.max_response_length=24",
        "data.val_files=null",
        "trainer.val_before_train=false",
        "trainer.total_training_steps=2",
        "trainer.logger=[file]",
        f"trainer.default_local_dir={out}",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=simple",
        f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tmp_path / 'tools.py'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
        *extra,
    ]
    begin = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(tmp_path / "run.py"), *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
        env=dict(os.environ, PYTHONPATH=str(HERE.parent)),
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return done, records, time.monotonic() - begin


HUNG = (
    'import time\n\n\ndef lookup(key: str) -> str:\n    """Hang.\n\n    Args:\n        key: a digit\n    """\n'
    "    time.sleep(3600)\n    return key\n"
)
EXITS = HUNG.replace("time.sleep(3600)", "sys.exit(0)").replace("import time", "import sys")


@pytest.mark.parametrize("workers", [1, 8])
def test_a_run_with_hung_tools_ends_and_the_process_exits(tmp_path, workers):
    done, records, elapsed = _train(
        tmp_path,
        HUNG,
        [
            "actor_rollout_ref.rollout.multi_turn.tool_timeout=0.2",
            f"actor_rollout_ref.rollout.agent.num_workers={workers}",
        ],
        240,
    )
    assert done.returncode == 0 and "main returned 0" in done.stdout, done.stderr[-2000:]
    timeouts = [r["multi_turn/tool_timeouts/mean"] for r in records if "multi_turn/tool_timeouts/mean" in r]
    assert len(timeouts) == 2 and min(timeouts) > 0, records
    print(f"pool {workers}: the whole run (2 steps, every call hung) took {elapsed:.1f} s")


def test_a_tool_that_calls_sys_exit_is_a_counted_failure_not_the_end_of_the_run(tmp_path):
    done, records, _ = _train(tmp_path, EXITS, [], 240)
    assert done.returncode == 0 and "main returned 0" in done.stdout, done.stderr[-2000:]
    failures = [
        (r["multi_turn/tool_failure_ratio"], r["multi_turn/tool_calls/mean"])
        for r in records
        if "multi_turn/tool_failure_ratio" in r
    ]
    assert len(failures) == 2 and all(ratio == 1.0 and calls > 0 for ratio, calls in failures), records


REFUSES_TOOL = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('unknown role: ' + m.role) }}"
    "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
    "{% endif %}"
)


def test_a_chat_template_that_refuses_the_tool_role_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    """format=hermes with a template that raises on a ``tool`` message: one line naming the template and the
    role, exit 2, before any model."""
    from omegaconf import OmegaConf

    from splitproof.cli import main
    from splitproof.rl import run as run_module

    from .rl_helpers import assert_usage_error, train_overrides

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the usage error")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    (tmp_path / "tools.py").write_text(TOOL_FILE)
    config = tmp_path / "run.yaml"
    OmegaConf.save({"actor_rollout_ref": {"model": {"custom_chat_template": REFUSES_TOOL}}}, config)
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--config",
            str(config),
            *train_overrides("builtin://charlm", out, 2),
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={tmp_path / 'tools.py'}",
        ]
    )
    assert_usage_error(
        code,
        capsys.readouterr().err,
        ["multi_turn.format", "custom_chat_template", "'tool'", "unknown role: tool"],
        out,
    )
