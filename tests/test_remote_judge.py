"""A remote judge against a stub endpoint on 127.0.0.1 that answers at random: every call recorded in the
run folder and replayed on a restart and a rerun (no new request, the same rewards); concurrency never
changes which answer goes to which sample; an unreachable endpoint is named with its attempts and fails the
step; a resumed training run gets the same rewards as an uninterrupted one."""

from __future__ import annotations

import json
import socket

import pytest

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.collective import default_collective
from splitproof.loss_config import ConfigError
from splitproof.rl.config.reward_models import reward_model_settings
from splitproof.rl.data.prompts import load_prompts
from splitproof.rl.rewards.dapo import RewardManager
from splitproof.rl.rewards.judge import JudgeSettings
from splitproof.rl.rewards.remote_judge import RemoteJudge, RemoteJudgeError, RemoteSettings
from splitproof.rl.rollout.hf import SamplingParams
from splitproof.rl.run import Reward
from splitproof.rl.step import score_samples

from .config_helpers import load
from .judge_stub import StubJudge
from .reward_model_helpers import random_samples

TEMPLATE = "Rate {response} as an answer to {prompt} from 0 to 9."


@pytest.fixture(scope="module")
def dataset():
    return load_prompts(["builtin://addition/train?size=10"], char_tokenizer(), max_prompt_length=32)


def _judge(url, folder, rank=0, **remote) -> RemoteJudge:
    settings = JudgeSettings(path=url, template=TEMPLATE, sampling=SamplingParams(max_response_length=16, seed=3))
    return RemoteJudge(settings, RemoteSettings(url=url, **remote), folder, rank)


def _score(judge, dataset, samples, step=1):
    reward = Reward(None, RewardManager(), char_tokenizer(), 10, model=judge, rule_metric=False)
    return score_samples(reward, dataset, samples, step, default_collective())


def test_calls_are_recorded_and_replayed_though_the_endpoint_answers_at_random(dataset, tmp_path):
    samples = random_samples(dataset, 12, seed=1)
    with StubJudge() as stub:
        first = _score(_judge(stub.url, tmp_path, max_concurrent=8), dataset, samples)
        assert len(stub.requests) == 12 and first.stats["judge/parse_failures"] == 0
        assert len({b["seed"] for b in stub.requests}) == 12  # each call its own seed
        fresh = _score(_judge(stub.url, tmp_path / "elsewhere"), dataset, samples)  # not recorded there
        assert len(stub.requests) == 24
        assert fresh.scores.tolist() != first.scores.tolist()  # the endpoint does not answer the same twice
        restarted = _judge(stub.url, tmp_path, rank=1, max_concurrent=1)  # a restart, another rank's file
        again = _score(restarted, dataset, samples)
        assert restarted.asked == 0 and len(stub.requests) == 24
        assert again.scores.tolist() == first.scores.tolist()
        new_step = _score(restarted, dataset, samples, step=2)  # another key: asked
        assert restarted.asked == 12 and len(new_step) == 12
    lines = [json.loads(line) for line in (tmp_path / "judge_calls.rank0.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and {"key", "step", "uid", "sample_index", "call", "request", "answer"} <= set(lines[0])
    by_key = {(e["uid"], e["sample_index"]): e for e in lines}
    for sample, value in zip(samples, first.scores.tolist()):  # concurrency kept each answer with its sample
        entry = by_key[(sample.uid, sample.sample_index)]
        assert float(entry["answer"].split()[-1]) == value
        assert entry["request"]["messages"][0]["content"].startswith("Rate ")


def test_an_unparsed_answer_is_a_defined_score_and_counted(dataset, tmp_path):
    samples = random_samples(dataset, 5, seed=2)
    with StubJudge(parseable=False) as stub:
        rewards = _score(_judge(stub.url, tmp_path), dataset, samples)
    assert rewards.scores.tolist() == [0.0] * 5 and rewards.stats["judge/parse_failures"] == 5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_endpoint_is_named_with_its_attempts(dataset, tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    with pytest.raises(RemoteJudgeError, match=r"no answer after 3 attempts") as info:
        _score(_judge(url, tmp_path, retries=2, timeout_s=2.0), dataset, random_samples(dataset, 3))
    assert url in str(info.value) and "remote.retries=2" in str(info.value)
    assert not (tmp_path / "judge_calls.rank0.jsonl").exists()


def test_remote_keys_are_checked():
    keys = ["reward.reward_model.enable=true", "reward.reward_model.kind=remote"]
    with pytest.raises(ConfigError) as info:
        reward_model_settings(load(*keys, "reward.reward_model.judge.template='{response}'")[0])
    assert info.value.field == "reward.reward_model.remote.url"
    with pytest.raises(ConfigError) as info:
        reward_model_settings(load(*keys, "reward.reward_model.remote.url=http://127.0.0.1:1/v1")[0])
    assert info.value.field == "reward.reward_model.judge.template"
    settings = reward_model_settings(
        load(
            *keys,
            "reward.reward_model.remote.url=http://127.0.0.1:1/v1",
            "reward.reward_model.judge.template='{response}'",
            "reward.reward_model.remote.retries=0",
        )[0]
    )
    assert settings.remote.retries == 0 and settings.judge.template == "{response}"


def _run_keys(url: str) -> list[str]:
    return [
        "custom_reward_function.path=null",
        "custom_reward_function.name=null",
        "reward.reward_model.enable=true",
        "reward.reward_model.kind=remote",
        f"reward.reward_model.remote.url={url}",
        "reward.reward_model.judge.template='{prompt} {response}: score 0-9'",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
    ]


def test_a_rerun_and_a_resume_replay_the_judges_answers(tmp_path):
    from splitproof.cli import main
    from splitproof.rl.checkpoint.resume import TRACKER
    from splitproof.rl.tracking.loggers import read_metrics
    from splitproof.rl.tracking.metrics import is_machine_dependent

    from .rl_helpers import save_tiny_char_model, train_overrides

    def same(got, want):
        assert [r["step"] for r in got] == [r["step"] for r in want]
        for a, b in zip(got, want):
            assert {k: v for k, v in a.items() if not is_machine_dependent(k)} == {
                k: v for k, v in b.items() if not is_machine_dependent(k)
            }

    policy, out = save_tiny_char_model(tmp_path / "policy"), tmp_path / "out"
    with StubJudge() as stub:
        args = ["train", *train_overrides(policy, out, 3), *_run_keys(stub.url)]
        assert main(args) == 0
        asked, first = len(stub.requests), read_metrics(out / "metrics.jsonl")
        assert asked == 3 * 16 and "reward/rm_score/mean" in first[-1] and "judge/parse_failures" in first[-1]
        assert main([*args, "trainer.resume_mode=disable"]) == 0  # a rerun in the same folder
        assert len(stub.requests) == asked
        same(read_metrics(out / "metrics.jsonl"), first)
        import shutil

        shutil.rmtree(out / "global_step_3")  # as if the run died after step 3 was scored, before its save
        (out / TRACKER).write_text("2")
        lines = (out / "metrics.jsonl").read_text().splitlines()
        (out / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n")
        assert main(args) == 0  # resumes at step 3: its calls are replayed
        assert len(stub.requests) == asked
        same(read_metrics(out / "metrics.jsonl"), first)


def test_an_unreachable_endpoint_fails_the_step_and_keeps_the_checkpoint(tmp_path, capsys):
    from splitproof.cli import main

    from .rl_helpers import save_tiny_char_model, train_overrides

    policy, out = save_tiny_char_model(tmp_path / "policy"), tmp_path / "out"
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    args = train_overrides(policy, out, 2) + _run_keys(url) + ["reward.reward_model.remote.retries=1"]
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert f"remote judge {url}/chat/completions: no answer after 2 attempts" in err
    assert "Nothing of step 1 was logged or saved" in err and not (out / "global_step_1").exists()
