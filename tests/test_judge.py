"""A generative judge: its answers (and so its verdicts) are identical across the judge's batch size, sample
order, DP sizes (real gloo processes) and a fresh load (a restart); greedy judging; the helper a reward
function calls; parsing as verl and verifiers do, an unparsed answer a defined score and a counted failure;
the bad-input lines."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.collective import default_collective
from splitproof.engine.launch import run_data_parallel
from splitproof.loss_config import ConfigError
from splitproof.rl.config.reward_models import reward_model_settings
from splitproof.rl.data.prompts import load_prompts
from splitproof.rl.rewards.dapo import RewardManager
from splitproof.rl.rewards.functions import RewardFunction
from splitproof.rl.rewards.judge import (
    JudgeCall,
    JudgeSettings,
    ask_all,
    check_template,
    load_judge,
    parse_answer,
)
from splitproof.rl.rollout.hf import SamplingParams
from splitproof.rl.run import Reward
from splitproof.rl.step import score_samples

from .config_helpers import load
from .reward_model_helpers import random_samples, save_tiny_reward_model
from .rl_helpers import save_tiny_char_model

TEMPLATE = "Is {response} the sum {prompt}? Answer yes or no, or give a number."


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("judge") / "judge", seed=7)


@pytest.fixture(scope="module")
def dataset():
    return load_prompts(["builtin://addition/train?size=10"], char_tokenizer(), max_prompt_length=32)


def _settings(judge_dir, **changes) -> JudgeSettings:
    sampling = SamplingParams(temperature=1.0, max_response_length=6, seed=5)
    return replace(JudgeSettings(path=judge_dir, template=TEMPLATE, sampling=sampling), **changes)


def _reward(judge_dir, fn=None, **changes) -> Reward:
    judge = load_judge(_settings(judge_dir, **changes))
    return Reward(fn, RewardManager(), char_tokenizer(), 10, model=judge, rule_metric=False)


def _answers(judge_dir, dataset, samples, step, **changes):
    rewards = score_samples(_reward(judge_dir, **changes), dataset, samples, step, default_collective())
    judge = load_judge(_settings(judge_dir, **changes))
    texts = [char_tokenizer().decode(s.response_ids, skip_special_tokens=True) for s in samples]
    verdicts = judge.score([dataset[s.uid] for s in samples], samples, texts, step=step)
    return rewards, [v.answer for v in verdicts]


def test_verdicts_do_not_depend_on_batch_size_order_or_a_restart(judge_dir, dataset):
    samples = random_samples(dataset, 14, seed=1)
    want, answers = _answers(judge_dir, dataset, samples, 3, max_num_seqs=256)
    assert len(set(answers)) > 10  # the judge samples: the answers differ
    for size in (1, 5):
        got, got_answers = _answers(judge_dir, dataset, samples, 3, max_num_seqs=size)
        assert got_answers == answers and got.scores.tolist() == want.scores.tolist()
    order = list(range(len(samples)))
    random.Random(2).shuffle(order)
    _, shuffled = _answers(judge_dir, dataset, [samples[i] for i in order], 3, max_num_seqs=4)
    assert shuffled == [answers[i] for i in order]
    _, other_step = _answers(judge_dir, dataset, samples, 4)
    assert other_step != answers  # the step keys the stream
    assert want.stats["judge/calls"] == 14 and want.stats["judge/parse_failures"] >= 0


def _dp_answers(judge_dir, dataset, samples):
    rewards = score_samples(_reward(judge_dir, max_num_seqs=3), dataset, samples, 2, default_collective())
    return rewards.scores, rewards.stats["judge/parse_failures"]


@pytest.mark.dist
def test_verdicts_do_not_depend_on_the_dp_size(judge_dir, dataset):
    samples = random_samples(dataset, 9, seed=4)
    scores, failures = _dp_answers(judge_dir, dataset, samples)
    for got_scores, got_failures in run_data_parallel(_dp_answers, 2, judge_dir, dataset, samples):
        assert got_scores.tolist() == scores.tolist() and got_failures == failures


def test_greedy_judging_is_the_argmax_answer(judge_dir, dataset):
    samples = random_samples(dataset, 6, seed=3)
    greedy = SamplingParams(do_sample=False, max_response_length=6, seed=5)
    _, one = _answers(judge_dir, dataset, samples, 1, sampling=greedy)
    _, other = _answers(judge_dir, dataset, samples, 9, sampling=replace(greedy, seed=77))
    assert one == other  # no randomness left: step and seed do not matter


def test_a_reward_function_calls_the_judge_with_the_same_guarantee(judge_dir, dataset):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, rm_score=0.0, judge=None):
        return float(len(judge(f"again: {solution_str}", call=1).answer)) + rm_score

    samples = random_samples(dataset, 8, seed=5)
    reward = _reward(judge_dir, fn=RewardFunction(compute_score, "asks", "verl"))
    want = score_samples(reward, dataset, samples, 2, default_collective())
    judge = reward.model
    calls = [JudgeCall(judge, 2, s.uid, s.sample_index) for s in samples]
    texts = [char_tokenizer().decode(s.response_ids[:-1] if s.finished else s.response_ids) for s in samples]
    batched = ask_all(calls, [f"again: {t}" for t in texts], call=1)
    one_by_one = [c(f"again: {t}", call=1) for c, t in zip(calls, texts)]
    assert batched == one_by_one
    rm = want.extra["rm_score"]
    assert want.scores.tolist() == [len(v.answer) + r for v, r in zip(batched, rm)]


def test_parsing_follows_verl_and_verifiers():
    assert parse_answer("The answer is correct.\n\n8", "score") == 8.0
    assert parse_answer("score: 3, then 7.5", "score") == 7.5
    assert parse_answer("no number here", "score") is None
    assert parse_answer("Yes, it is right.", "verdict") == 1.0
    assert parse_answer("No. yes would be wrong", "verdict") == 0.0
    assert parse_answer("eyes nod", "verdict") is None  # whole words only


def test_an_unparsed_answer_scores_failure_score_and_is_counted(judge_dir, dataset):
    samples = random_samples(dataset, 10, seed=6)
    rewards = score_samples(
        _reward(judge_dir, parser="verdict", failure_score=-1.0), dataset, samples, 1, default_collective()
    )
    failures = rewards.stats["judge/parse_failures"]
    assert failures == rewards.scores.tolist().count(-1.0) and failures > 0  # a random judge rarely says yes/no


def test_bad_judge_input_is_named(judge_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"no \{response\} placeholder"):
        check_template("Is {prompt} right?", "t")
    with pytest.raises(ConfigError, match=r"names \{answer\}"):
        check_template("{answer} {response}", "t")
    keys = ["reward.reward_model.enable=true", "reward.reward_model.kind=judge", "reward.reward_model.model_path"]

    def error(*overrides, path=judge_dir) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            reward_model_settings(load(*keys[:2], f"{keys[2]}={path}", *overrides)[0])
        return info.value

    assert error().field == "reward.reward_model.judge.template"
    assert error("reward.reward_model.judge.template='{prompt}'").field == "reward.reward_model.judge.template"
    assert error("reward.reward_model.judge.template='{response}'", "reward.reward_model.judge.parser=x").field == (
        "reward.reward_model.judge.parser"
    )
    classifier = error("reward.reward_model.judge.template='{response}'", path=save_tiny_reward_model(tmp_path))
    assert "not a causal LM" in str(classifier) and "ForSequenceClassification" in str(classifier)
    settings = reward_model_settings(
        load(
            *keys[:2],
            f"{keys[2]}={judge_dir}",
            "reward.reward_model.judge.template='{response}'",
            "reward.reward_model.rollout.do_sample=false",
            "reward.reward_model.rollout.response_length=9",
        )[0]
    )
    assert (settings.sampling.greedy, settings.sampling.max_response_length, settings.parser) == (True, 9, "score")
    with pytest.raises(ConfigError, match="is read with kind=classifier"):
        reward_model_settings(
            load(
                *keys[:2],
                f"{keys[2]}={judge_dir}",
                "reward.reward_model.judge.template='{response}'",
                "reward.reward_model.micro_batch_size_per_gpu=2",
            )[0]
        )
    with pytest.raises(ConfigError, match="is read with kind=judge or remote"):
        reward_model_settings(
            load(keys[0], f"{keys[2]}={save_tiny_reward_model(tmp_path / 'c')}", "reward.reward_model.rollout.top_k=5")[
                0
            ]
        )
