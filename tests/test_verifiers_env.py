"""verifiers environments (the classic API of verifiers 0.3.x, the ``verifiers`` extra): environments
written in verifiers' own API (a SingleTurnEnv with a Rubric over an XMLParser, a MultiTurnEnv with an
env_response) run unchanged; their own rollout loop drives the engine through the in-process client;
token in / token out (the trained ids are the generated ids, the environment's messages appended as the
chat template renders them after the model's EOS); the rubric's functions are metrics under their names;
trajectories are the same at any generation batch size and under 2 data-parallel ranks (float64, 3 steps,
environment turns happening);
a module without load_environment is one line, exit 2, before any model."""

from __future__ import annotations

import pytest

from splitproof.builtin.tokenizer import char_tokenizer

from .rl_helpers import HERE, assert_same_trajectory, run_trajectory, small_grpo
from .test_multiturn import _exit_2_before_any_model

try:
    import verifiers.legacy  # noqa: F401  (the classic API of verifiers 0.3.x)

    HAS_VERIFIERS = True
except ImportError:
    HAS_VERIFIERS = False
needs_verifiers = pytest.mark.skipif(
    not HAS_VERIFIERS, reason="the verifiers extra (pip install 'splitproof[verifiers]')"
)

ENVS = HERE / "vf_envs"
KEY = "actor_rollout_ref.rollout.multi_turn.verifiers_env"
STEPS = 3


def vf_config(env: str, extra=()):
    from splitproof.rl.config.load import load_train_config

    base = small_grpo("builtin://charlm", "fp64") + [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"{KEY}={ENVS / env}",
        "data.max_prompt_length=64",
        "data.max_response_length=24",
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=false",
        "trainer.logger=[]",
    ]
    return load_train_config(None, base + list(extra))


@pytest.fixture(scope="module")
def single_turn():
    return run_trajectory(vf_config("vf_reverse_text.py"))


MULTI = ["actor_rollout_ref.rollout.n=2", "data.max_response_length=48", "actor_rollout_ref.actor.optim.lr=0.002"]


@pytest.fixture(scope="module")
def multi_turn():
    return run_trajectory(vf_config("vf_guess.py", MULTI))


@needs_verifiers
def test_the_rubric_is_the_score_and_its_functions_are_metrics(single_turn):
    from splitproof.rl.environments.verifiers_env import load_verifiers_environment

    env = load_verifiers_environment(str(ENVS / "vf_reverse_text.py"))
    assert env.get_dataset()[0]["prompt"][0]["role"] == "system"  # its system_prompt reaches the rows
    for record in single_turn["records"]:
        assert "reward/vf/mean" in record  # the rubric's weighted sum
        for name in ("correct_answer", "format_reward_func", "answer_length", "num_turns"):
            assert f"reward/vf/{name}/mean" in record, sorted(record)
        assert record["reward/vf/num_turns/mean"] > 0
    for samples in single_turn["samples"]:
        for s in samples:
            weighted = s.metrics["correct_answer"] + 0.2 * s.metrics["format_reward_func"]
            assert s.environment_reward == pytest.approx(weighted, abs=1e-12)
            assert s.token_mask == [1] * len(s.response_ids)  # a single turn: every token the model's


@needs_verifiers
def test_load_environment_args_and_the_eval_dataset_as_held_out_rows():
    from splitproof.rl.run import prepare_inputs

    inputs = prepare_inputs(
        vf_config("vf_reverse_text.py", ["actor_rollout_ref.rollout.multi_turn.verifiers_env_args={num_examples: 4}"])
    )
    assert [r.columns["answer"] for r in inputs.train_data] == ["tac", "god", "nus", "pam"]
    assert [r.columns["answer"] for r in inputs.val_data] == ["tna", "eeb"]
    assert inputs.train_data[0].data_source == "verifiers"


@needs_verifiers
def test_single_turn_episodes_are_the_same_at_any_batch_size(single_turn):
    got = run_trajectory(vf_config("vf_reverse_text.py", ["actor_rollout_ref.rollout.max_num_seqs=1"]))
    assert_same_trajectory(got, single_turn)
    for a, b in zip(got["samples"], single_turn["samples"]):
        assert [(s.prompt_ids, s.token_mask, s.metrics) for s in a] == [
            (s.prompt_ids, s.token_mask, s.metrics) for s in b
        ]


@needs_verifiers
def test_multi_turn_token_in_token_out(multi_turn):
    """The response is the generated ids and the environment's messages as the template renders them
    after the model's EOS, never the conversation re-tokenized; environment turns happen at every step."""
    tok = char_tokenizer()
    for samples in multi_turn["samples"]:
        assert any(s.user_turns > 0 for s in samples)
        for s in samples:
            model = [t for t, m in zip(s.response_ids, s.token_mask) if m]
            environment = tok.decode([t for t, m in zip(s.response_ids, s.token_mask) if not m])
            assert len(model) > 0
            for reply in ("correct", "higher", "lower", "a digit"):
                environment = environment.replace(f"\nuser: {reply}\nassistant: ", "")
            assert environment == "", environment
            assert s.num_turns == s.user_turns + s.assistant_turns + 1


@needs_verifiers
def test_multi_turn_episodes_are_the_same_at_any_batch_size(multi_turn):
    got = run_trajectory(
        vf_config(
            "vf_guess.py",
            [
                *MULTI,
                "actor_rollout_ref.rollout.max_num_seqs=3",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            ],
        )
    )
    assert_same_trajectory(got, multi_turn)
    for a, b in zip(got["samples"], multi_turn["samples"]):
        assert [(s.token_mask, s.metrics, s.stop_condition) for s in a] == [
            (s.token_mask, s.metrics, s.stop_condition) for s in b
        ]


@needs_verifiers
def test_an_env_group_routes_each_row_to_its_environment():
    """vf.EnvGroup of a SingleTurnEnv and a MultiTurnEnv: the group's rows are both environments' rows,
    each episode runs its own environment's protocol and rubric (the union of the functions reported),
    and the episodes are the same at another generation batch size."""
    group = [*MULTI, "trainer.total_training_steps=2"]
    first = run_trajectory(vf_config("vf_group.py", group))
    again = run_trajectory(vf_config("vf_group.py", [*group, "actor_rollout_ref.rollout.max_num_seqs=3"]))
    assert_same_trajectory(again, first)
    tok = char_tokenizer()
    samples = [s for step in first["samples"] for s in step]
    reverse = [s for s in samples if "Reverse the word." in tok.decode(s.prompt_ids)]
    guess = [s for s in samples if "guess a digit" in tok.decode(s.prompt_ids)]
    assert len(reverse) == len(guess) == len(samples) // 2
    assert all(s.user_turns == 0 and s.metrics["format_reward_func"] > 0 for s in reverse)
    assert any(s.user_turns > 0 for s in guess) and all(s.metrics["format_reward_func"] == 0 for s in guess)
    for record in first["records"]:
        for name in ("reversed_word", "format_reward_func", "solved"):
            assert f"reward/vf/{name}/mean" in record


def _dp_worker(extra):
    return run_trajectory(vf_config("vf_guess.py", [*MULTI, *extra]))


@needs_verifiers
@pytest.mark.dist
def test_multi_turn_episodes_are_the_same_under_data_parallel_ranks(multi_turn):
    """2 ranks, each running its share of the episodes in its own event loop (and another generation
    batch size), against 1: the same episodes and metrics, the weights within 1e-10 of the update
    (measured: 9e-15 to 4e-14 for 2 and 3 ranks, AMD and Intel MKL paths). The environment's closeness
    reward keeps step 1's advantages non-zero: with every score 0 the only gradient is the KL loss's
    at the reference policy, round-off that AdamW scales up (1e-9 of that update apart)."""
    from splitproof.engine.launch import run_data_parallel

    layout = ["actor_rollout_ref.actor.strategy=ddp", "actor_rollout_ref.rollout.max_num_seqs=3"]
    for got in run_data_parallel(_dp_worker, 2, layout):
        assert_same_trajectory(got, multi_turn)
        for a, b in zip(got["samples"], multi_turn["samples"]):
            assert [(s.token_mask, s.metrics, s.stop_condition, s.environment_reward) for s in a] == [
                (s.token_mask, s.metrics, s.stop_condition, s.environment_reward) for s in b
            ]


@needs_verifiers
def test_killed_mid_episode_and_resumed_equals_an_uninterrupted_run(tmp_path):
    """SIGKILL at step 2's second generation batch (after the environment's first responses), resume from
    step 1's checkpoint: the same metrics, bitwise, as an uninterrupted run."""
    from splitproof.cli import main
    from splitproof.rl.tracking.loggers import read_metrics

    from .test_train_resume import _kill_at, _same_metrics

    def args(out):
        return small_grpo("builtin://charlm", "fp64") + [
            "actor_rollout_ref.rollout.multi_turn.enable=true",
            f"{KEY}={ENVS / 'vf_guess.py'}",
            *MULTI,
            "data.max_prompt_length=64",
            f"trainer.total_training_steps={STEPS}",
            "trainer.save_freq=1",
            "trainer.val_before_train=false",
            "trainer.logger=[file]",
            f"trainer.default_local_dir={out}",
        ]

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *args(whole)]) == 0
    _kill_at(args(killed), "step2:stream0:vf2", tmp_path / "paused")
    assert main(["train", *args(killed)]) == 0
    got, want = read_metrics(killed / "metrics.jsonl"), read_metrics(whole / "metrics.jsonl")
    assert any(r["num_turns/max"] > 2 for r in want)  # environment turns happen
    _same_metrics(got, want)


def test_a_module_without_load_environment_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    overrides = ["actor_rollout_ref.rollout.multi_turn.enable=true", f"{KEY}={ENVS / 'vf_no_loader.py'}"]
    _exit_2_before_any_model(overrides, [KEY, "load_environment", "make_env"], tmp_path, monkeypatch, capsys)


def test_a_missing_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    overrides = ["actor_rollout_ref.rollout.multi_turn.enable=true", f"{KEY}={tmp_path / 'nope.py'}"]
    _exit_2_before_any_model(overrides, [KEY, "nope.py"], tmp_path, monkeypatch, capsys)


@needs_verifiers
def test_turn_keys_are_not_read_with_a_verifiers_env(tmp_path, monkeypatch, capsys):
    overrides = [
        "actor_rollout_ref.rollout.multi_turn.enable=true",
        f"{KEY}={ENVS / 'vf_guess.py'}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
    ]
    _exit_2_before_any_model(overrides, ["max_assistant_turns", "max_turns"], tmp_path, monkeypatch, capsys)


class Scripted:
    """An engine that answers each episode's turns with the given texts (a protocol test: which ids go
    where), EOS-terminated, log-prob -1 per token."""

    max_num_seqs = 8

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, []

    def generate(self, requests, params, *, step, stream=0, positions=None, budgets=None):
        from splitproof.rl.rollout.hf import Sample

        out = []
        for uid, j, ids in requests:
            self.calls.append(list(ids))
            text = self.turns[min(len(self.calls) - 1, len(self.turns) - 1)]
            response = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
            out.append(Sample(uid, j, list(ids), response, [-1.0] * len(response), True))
        return out


@needs_verifiers
def test_a_tool_env_calls_its_tool_and_the_ids_are_the_generated_ones():
    from splitproof.rl.environments.verifiers_env import environment_rows, load_verifiers_environment
    from splitproof.rl.environments.vf_rollout import VerifiersRollout
    from splitproof.rl.rollout.hf import SamplingParams

    tok = char_tokenizer()
    env = load_verifiers_environment(str(ENVS / "vf_tools.py"))
    rows = environment_rows(env, tok)
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = Scripted(tok, [call, "5"])
    (episode,) = VerifiersRollout(engine, tok, env).generate(
        [(0, 0, rows[0].prompt_ids)], SamplingParams(max_response_length=200), step=0, records=[rows[0]]
    )
    eos = tok.eos_token_id
    first = tok.encode(call, add_special_tokens=False) + [eos]
    tool = tok.encode("\ntool: 5\nassistant: ", add_special_tokens=False)
    second = tok.encode("5", add_special_tokens=False) + [eos]
    assert episode.response_ids == first + tool + second
    assert episode.token_mask == [1] * len(first) + [0] * len(tool) + [1] * len(second)
    assert episode.log_probs == [-1.0] * len(first) + [0.0] * len(tool) + [-1.0] * len(second)
    assert engine.calls[1] == episode.prompt_ids + first + tool  # turn 2 continues the kept ids
    assert (episode.assistant_turns, episode.user_turns, episode.stop_condition) == (2, 1, "no_tools_called")
    assert episode.metrics["correct"] == 1.0 and episode.metrics["total_tool_calls"] == 1.0
    assert episode.environment_reward == 1.0
