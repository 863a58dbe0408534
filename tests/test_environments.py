"""Environments in TRL's ``environment_factory`` shape: an episode is a function of the seed — the same
trajectory (tokens, masks, turns, calls, environment rewards, every metric) whatever the generation
batch size, the tool pool's size and random latency, the data-parallel size, and after kill -9 and a
resume; an environment that ignores its seed is named in a notice; one that raises mid-episode ends its
episode with a defined observation and a metric; bad environments are one line and exit 2 before any
model. TRL's documented example class runs unchanged. float64, the built-in model, the digit test format
(every digit the model writes is a call of its episode's tool)."""

from __future__ import annotations

import json
import math

import pytest

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.cli import main
from splitproof.engine.launch import run_data_parallel
from splitproof.rl.environments.seeds import episode_seed
from splitproof.rl.rollout import tool_format
from splitproof.rl.rollout.tools import ToolCall

from .rl_helpers import HERE, assert_same_trajectory, run_trajectory, train_overrides, trajectory_config
from .test_multiturn import _exit_2_before_any_model

STEPS = 3
ENVS = HERE / "environments_trl.py"
INCREMENT = HERE / "trl_increment_env.py"
KEY = "actor_rollout_ref.rollout.multi_turn.environment_factory"


def overrides(factory: str) -> list[str]:
    return [
        "actor_rollout_ref.model.path=builtin://charlm",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=simple",
        f"{KEY}={factory}",
        "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=48",
        "data.max_response_length=64",  # room for an error text (42 characters)
        "actor_rollout_ref.actor.optim.lr=0.002",
    ]


LOOKUP = overrides(f"{ENVS}:LookupEnv")
LAYOUTS = {
    "ones": [
        "actor_rollout_ref.rollout.max_num_seqs=1",
        "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
    ],
    "uneven": ["actor_rollout_ref.rollout.max_num_seqs=5", "actor_rollout_ref.rollout.agent.num_workers=8"],
}


class EpisodeDigits(tool_format.SimpleFormat):
    """Every digit of a turn is a call of the episode's first tool with the digit as its argument (an
    integer where the tool takes one)."""

    def parse(self, ids):
        if not self.tools:
            return [], 0
        tool = next(iter(self.tools.values()))
        (param, spec), *_ = tool.schema["function"]["parameters"]["properties"].items()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        value = (lambda c: int(c)) if spec.get("type") == "integer" else (lambda c: c)
        return [ToolCall(tool.name, json.dumps({param: value(c)})) for c in text if c.isdigit()], 0


def episode_digits(monkeypatch) -> None:
    monkeypatch.setitem(tool_format.FORMATS, "simple", EpisodeDigits)


@pytest.fixture(autouse=True)
def _digits(monkeypatch):
    episode_digits(monkeypatch)


@pytest.fixture(scope="module")
def baseline():
    with pytest.MonkeyPatch.context() as mp:
        episode_digits(mp)
        return run_trajectory(trajectory_config("builtin://charlm", STEPS, LOOKUP))


def episode_view(samples):
    return [
        (s.prompt_ids, s.token_mask, s.num_turns, s.tool_calls, s.tool_errors, s.environment, s.environment_reward)
        for s in samples
    ]


def assert_same_episodes(got, want):
    assert_same_trajectory(got, want)
    for a, b in zip(got["samples"], want["samples"]):
        assert episode_view(a) == episode_view(b)


def test_environment_turns_happen_at_every_step(baseline):
    """Not vacuous: tool turns on the environment at every step, its reward reported, its failures counted."""
    tokenizer = char_tokenizer()
    for record, samples in zip(baseline["records"], baseline["samples"]):
        assert record["multi_turn/tool_calls/mean"] > 0.2 and record["num_turns/max"] >= 4
        assert "reward/LookupEnv/mean" in record and math.isfinite(record["environment/errors/mean"])
        assert {s.environment for s in samples} == {"LookupEnv"}
        for s in samples:  # reset's observation (the secret digit) is appended to the prompt
            assert tokenizer.decode(s.prompt_ids)[-1].isdigit()
    assert any(r["environment/errors/mean"] > 0 for r in baseline["records"])  # key 7 raised mid-episode


def test_an_environment_that_raises_ends_its_episode_with_the_error_text(baseline):
    tokenizer = char_tokenizer()
    ended = [s for samples in baseline["samples"] for s in samples if s.environment_errors]
    shown = 0
    for s in ended:
        tool_text = tokenizer.decode([t for t, m in zip(s.response_ids, s.token_mask) if not m])
        if "Error when executing tool: key 7 is broken" in tool_text:  # else it did not fit the response budget
            shown += 1
            assert s.token_mask[-1] == 0  # the episode ended on the environment's error response
    assert shown > 0


def test_seeds_are_a_function_of_the_episode():
    assert episode_seed(42, 0, 3, 5, 1) == episode_seed(42, 0, 3, 5, 1)
    assert len({episode_seed(42, 0, 3, 5, j) for j in range(8)} | {episode_seed(42, 1, 3, 5, 0)}) == 9


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_batch_size_pool_and_latency_do_not_change_the_trajectory(baseline, layout):
    got = run_trajectory(trajectory_config("builtin://charlm", STEPS, LOOKUP + LAYOUTS[layout]))
    assert_same_episodes(got, baseline)


def _dp_worker(world_extra):
    episode_digits(pytest.MonkeyPatch())
    extra = ["actor_rollout_ref.rollout.max_num_seqs=3", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    return run_trajectory(trajectory_config("builtin://charlm", STEPS, LOOKUP + extra + list(world_extra)))


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_data_parallel_does_not_change_the_trajectory(baseline, world):
    for got in run_data_parallel(_dp_worker, world, ["actor_rollout_ref.actor.strategy=ddp"]):
        assert_same_episodes(got, baseline)


@pytest.mark.slow
def test_killed_mid_episode_and_resumed_equals_an_uninterrupted_run(tmp_path):
    from splitproof.rl.tracking.loggers import read_metrics

    from .test_train_resume import _kill_at, _same_metrics

    def args(out):
        extra = [*LOOKUP, "trainer.save_freq=1", "data.val_files=null"]
        return train_overrides("builtin://charlm", out, 3, extra=extra)

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *args(whole)]) == 0
    _kill_at(args(killed), "step2:stream0:tools1", tmp_path / "paused")
    assert main(["train", *args(killed)]) == 0
    _same_metrics(read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl"))


DOUBLED = LOOKUP + [f"custom_reward_function.path={ENVS}", "custom_reward_function.name=doubled_reward"]


def _scored(cfg) -> list[tuple]:
    """Every step's (samples, scores) of a run of ``cfg``."""
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    steps = []
    fit(build_parts(cfg), on_step=lambda step, out: steps.append((out.scored.samples, out.scored.rewards.scores)))
    return steps


def _dp_scored(world_extra):
    episode_digits(pytest.MonkeyPatch())
    return _scored(trajectory_config("builtin://charlm", 2, DOUBLED + list(world_extra)))


def _assert_environment_scores(steps):
    for samples, scores in steps:  # TRL sums its sources: get_reward() + doubled_reward's 2 × get_reward()
        assert len({s.environment_reward for s in samples}) > 1
        for s, score in zip(samples, scores.tolist()):
            assert math.isclose(score, 3.0 * s.environment_reward, rel_tol=1e-12, abs_tol=1e-12)


def test_a_reward_function_reads_each_episodes_environment():
    """TRL's ``environments=``: the function gets each episode's own instance, in the samples' order."""
    _assert_environment_scores(_scored(trajectory_config("builtin://charlm", 2, DOUBLED)))


@pytest.mark.dist
def test_the_environments_reach_the_reward_function_under_data_parallel():
    """The instances travel with their samples to the rank that scores them: the same scores as one process."""
    alone = _scored(trajectory_config("builtin://charlm", 2, DOUBLED))
    for got in run_data_parallel(_dp_scored, 2, ["actor_rollout_ref.actor.strategy=ddp"]):
        _assert_environment_scores(got)
        assert [scores.tolist() for _, scores in got] == [scores.tolist() for _, scores in alone]


def test_an_environment_that_does_not_pickle_is_refused_or_not_passed(tmp_path, monkeypatch, capsys):
    setup = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"{KEY}={ENVS}:LockedEnv",
        f"custom_reward_function.path={ENVS}",
        "custom_reward_function.name=doubled_reward",
    ]
    words = ["LockedEnv cannot be pickled", "doubled_reward", "takes environments=", "TypeError"]
    _exit_2_before_any_model(setup, words, tmp_path, monkeypatch, capsys)
    monkeypatch.undo()
    episode_digits(monkeypatch)
    extra = [*overrides(f"{ENVS}:LockedEnv"), f"custom_reward_function.path={ENVS}", "data.val_files=null"]
    args = train_overrides("builtin://charlm", tmp_path / "kwargs", 1, extra=extra)
    assert main(["train", *args, "custom_reward_function.name=any_reward"]) == 0
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if "notice:" in line and "LockedEnv cannot be pickled" in line]
    assert len(notices) == 1 and "which takes **kwargs, gets no environments=" in notices[0], err


def test_trls_documented_environment_runs_unchanged():
    """TRL's IncrementEnv (its module-level ``random``, no seed): reset's string appended to the prompt, its
    ``increment`` called, ``get_reward`` reported; the global generators are seeded per episode, so two
    layouts give the same episodes."""
    base = overrides(f"{INCREMENT}:IncrementEnv") + ["data.max_prompt_length=48"]
    first = run_trajectory(trajectory_config("builtin://charlm", 2, base))
    again = run_trajectory(trajectory_config("builtin://charlm", 2, base + LAYOUTS["uneven"]))
    assert_same_episodes(again, first)
    tokenizer = char_tokenizer()
    samples = first["samples"][0]
    targets = {tokenizer.decode(s.prompt_ids).rpartition("by ")[2] for s in samples}
    assert targets <= {f"{n}." for n in range(1, 7)} and len(targets) > 1
    assert sum(s.tool_calls for s in samples) > 0
    assert all("reward/IncrementEnv/mean" in r for r in first["records"])


def test_an_environment_that_ignores_its_seed_is_named(tmp_path, capsys):
    out = tmp_path / "out"
    args = train_overrides(
        "builtin://charlm",
        out,
        1,
        extra=[*overrides(f"{ENVS}:UnseededEnv"), "data.val_files=null", "data.max_prompt_length=32"],
    )
    assert main(["train", *args]) == 0
    err = capsys.readouterr().err
    notices = [line for line in err.splitlines() if "notice:" in line and "UnseededEnv" in line]
    assert len(notices) == 1 and "not a function of the run's seed" in notices[0], err


BAD = {
    "no such file": (f"{HERE}/nowhere_env.py:Env", ["environment_factory", "nowhere_env.py", "no such file"]),
    "no such class": (f"{ENVS}:Missing", ["environment_factory", "'Missing' not found", "LookupEnv"]),
    "no reset": (f"{ENVS}:NoReset", ["environment_factory", "NoReset has no reset method"]),
    "a tool without a type hint": (f"{ENVS}:Untyped", ["Untyped", "'lookup'", "type hint"]),
    "a tool without a docstring": (f"{ENVS}:Undocumented", ["Undocumented", "'lookup'", "docstring"]),
    "not a module path": ("LookupEnv", ["environment_factory", "path/to/file.py:Name"]),
}


@pytest.mark.parametrize("mistake", list(BAD))
def test_a_bad_environment_is_one_line_and_exit_2(mistake, tmp_path, monkeypatch, capsys):
    factory, words = BAD[mistake]
    setup = ["actor_rollout_ref.rollout.multi_turn.enable=true", f"{KEY}={factory}"]
    _exit_2_before_any_model(setup, words, tmp_path, monkeypatch, capsys)


def test_a_file_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "env.py").write_text("import not_a_module_anywhere\n")
    setup = ["actor_rollout_ref.rollout.multi_turn.enable=true", f"{KEY}={tmp_path / 'env.py'}:Env"]
    _exit_2_before_any_model(setup, ["failed to import", "not_a_module_anywhere"], tmp_path, monkeypatch, capsys)


def test_a_row_routed_to_no_environment_is_one_line(tmp_path, monkeypatch, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "environment": "lookup"}) + "\n" for i in range(7)))
    rows.write_text(rows.read_text() + json.dumps({"prompt": "9+1=", "environment": "chess"}) + "\n")
    setup = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"{KEY}={{lookup: {ENVS}:LookupEnv}}",
        f"data.train_files={rows}",
    ]
    words = ["rows.jsonl row 7", "environment='chess'", "lookup"]
    _exit_2_before_any_model(setup, words, tmp_path, monkeypatch, capsys)


class MulDigits(tool_format.SimpleFormat):
    """Every digit d of a turn is a call ``mul(d, d)``."""

    def parse(self, ids):
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return [ToolCall("mul", json.dumps({"a": int(c), "b": int(c)})) for c in text if c.isdigit()], 0


def test_an_environment_whose_reset_keeps_the_prompt_gives_the_function_tools_episodes(monkeypatch):
    """The built-in calculator as a function tool and as an environment (``CalculatorEnv``: reset returns
    None, ``mul`` a method): the same episodes, token for token, and the same weights after 2 steps."""
    from .rl_helpers import relative_update_difference

    monkeypatch.setitem(tool_format.FORMATS, "simple", MulDigits)
    common = [
        "actor_rollout_ref.model.path=builtin://charlm",
        "data.train_files=builtin://product/train",
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        "actor_rollout_ref.rollout.multi_turn.format=simple",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "data.max_response_length=32",
    ]
    tool = run_trajectory(
        trajectory_config(
            "builtin://charlm",
            2,
            common + ["actor_rollout_ref.rollout.multi_turn.function_tool_path=pkg://splitproof.builtin.calculator"],
        )
    )
    env = run_trajectory(
        trajectory_config("builtin://charlm", 2, common + [f"{KEY}=splitproof.builtin.calculator:CalculatorEnv"])
    )
    view = [[(s.prompt_ids, s.response_ids, s.token_mask, s.tool_calls) for s in step] for step in tool["samples"]]
    assert view == [
        [(s.prompt_ids, s.response_ids, s.token_mask, s.tool_calls) for s in step] for step in env["samples"]
    ]
    assert sum(s.tool_calls for step in env["samples"] for s in step) > 0
    assert relative_update_difference(env["weights"], tool["weights"], tool["initial"]) <= 1e-10


def test_rows_are_routed_to_their_environment_by_the_environment_column(tmp_path):
    """``{lookup: LookupEnv, inc: IncrementEnv}``: each episode plays its row's environment with that
    environment's tools only; the routing column is not passed to reset; each reward under its class."""
    rows = tmp_path / "rows.jsonl"
    lines = [{"prompt": f"{i}+{i % 7}=", "environment": ("lookup", "inc")[i % 2]} for i in range(16)]
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    factory = f"{{lookup: {ENVS}:LookupEnv, inc: {INCREMENT}:IncrementEnv}}"
    cfg = trajectory_config(
        "builtin://charlm",
        1,
        overrides(factory)
        + [f"data.train_files={rows}", "data.max_prompt_length=48"]
        + ["custom_reward_function.path=null", "custom_reward_function.name=null"],  # the environments' rewards alone
    )
    got = run_trajectory(cfg)
    tokenizer = char_tokenizer()
    samples, record = got["samples"][0], got["records"][0]
    labels = {"lookup": "LookupEnv", "inc": "IncrementEnv"}
    for s in samples:
        assert s.environment == labels[lines[s.uid]["environment"]] and s.environment_errors == 0
        prompt = tokenizer.decode(s.prompt_ids)
        assert prompt.endswith(".") if s.environment == "IncrementEnv" else prompt[-1].isdigit()
    assert "reward/LookupEnv/mean" in record and "reward/IncrementEnv/mean" in record
    by_env = {label: [s.environment_reward for s in samples if s.environment == label] for label in labels.values()}
    assert math.isclose(record["critic/score/mean"], sum(sum(v) for v in by_env.values()) / len(samples))
    assert {s.environment for s in samples if s.tool_calls} == {"LookupEnv", "IncrementEnv"}


def test_a_seed_column_that_reaches_reset_is_a_notice(tmp_path):
    from splitproof.rl.data.prompts import load_prompts
    from splitproof.rl.environments.session import EnvironmentSet
    from splitproof.rl.environments.setup import check_rows
    from splitproof.rl.environments.trl_factory import load_environments

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+1=", "seed": i}) + "\n" for i in range(4)))
    tokenizer = char_tokenizer()
    data = load_prompts(str(rows), tokenizer, max_prompt_length=16)
    envs = EnvironmentSet(classes=load_environments(f"{ENVS}:LookupEnv"), tokenizer=tokenizer, max_prompt_length=16)
    (notice,) = check_rows(envs, data)
    assert "'seed' column" in notice and "rows.jsonl row 0" in notice and "LookupEnv.reset receives it" in notice
