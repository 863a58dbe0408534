"""A discriminative reward model: float64 scores bitwise equal across micro-batch sizes, token budgets,
sample order and DP sizes (real gloo processes); the head on the last token; the two chat templates; the
combination with a reward function; verl's two spellings of the keys and the bad-input lines."""

from __future__ import annotations

import random

import pytest
import torch

from splitproof.builtin.tokenizer import char_tokenizer
from splitproof.collective import default_collective
from splitproof.engine.launch import run_data_parallel
from splitproof.loss_config import ConfigError
from splitproof.rl.config.reward_models import reward_model_settings
from splitproof.rl.data.prompts import load_prompts
from splitproof.rl.rewards.dapo import RewardManager
from splitproof.rl.rewards.functions import RewardError, RewardFunction
from splitproof.rl.rewards.model_scoring import check_function_takes_score
from splitproof.rl.rewards.reward_model import RewardModelSettings, last_token_scores, load_reward_model
from splitproof.rl.run import Reward
from splitproof.rl.step import score_samples

from .config_helpers import error_of, load
from .reward_model_helpers import random_samples, save_tiny_reward_model


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


@pytest.fixture(scope="module")
def dataset():
    return load_prompts(["builtin://addition/train?size=12"], char_tokenizer(), max_prompt_length=32)


def _reward(rm_dir, *, fn=None, rule_metric=True, **split) -> Reward:
    settings = RewardModelSettings(path=rm_dir, dtype=torch.float64, **split)
    tokenizer = char_tokenizer()
    model = load_reward_model(settings, tokenizer)
    return Reward(fn, RewardManager(), tokenizer, 10, model=model, rule_metric=rule_metric)


SPLITS = [
    {"micro_batch_size": 1},
    {"micro_batch_size": 3},
    {"micro_batch_size": 8},
    {"micro_batch_size": None},
    {"max_token_len": 40},
    {"max_token_len": 97},
    {"max_token_len": 1000},
]


def test_scores_are_bitwise_equal_across_micro_batches_budgets_and_order(rm_dir, dataset):
    samples = random_samples(dataset, 30)
    want = score_samples(_reward(rm_dir, **SPLITS[0]), dataset, samples, 1, default_collective())
    assert want.scores.dtype == torch.float64 and len(set(want.scores.tolist())) > 20
    for split in SPLITS[1:]:
        got = score_samples(_reward(rm_dir, **split), dataset, samples, 1, default_collective())
        assert torch.equal(got.scores, want.scores), split
        assert got.extra["rm_score"] == want.extra["rm_score"]
    order = list(range(len(samples)))
    random.Random(4).shuffle(order)
    shuffled = score_samples(
        _reward(rm_dir, micro_batch_size=4), dataset, [samples[i] for i in order], 1, default_collective()
    )
    assert torch.equal(shuffled.scores, want.scores[order])


def test_the_score_is_the_head_on_the_last_token(rm_dir):
    model = load_reward_model(RewardModelSettings(path=rm_dir, dtype=torch.float64), char_tokenizer()).model
    seqs = [[5, 9, 12, 40], [7, 7, 30, 31, 32, 33, 2]]
    got = last_token_scores(model, seqs, micro_batch_size=2, max_token_len=None)
    with torch.no_grad():
        for seq, score in zip(seqs, got.tolist()):  # Hugging Face's own pooled forward of an unpadded row
            reference = float(model(input_ids=torch.tensor([seq])).logits[0, 0])
            assert score == pytest.approx(reference, rel=1e-12, abs=1e-12)


def _dp_scores(rm_dir, dataset, samples, split):
    return score_samples(_reward(rm_dir, **split), dataset, samples, 1, default_collective()).scores


@pytest.mark.dist
@pytest.mark.parametrize("world_size", [2, 3])
def test_scores_are_bitwise_equal_across_dp_sizes(rm_dir, dataset, world_size):
    samples = random_samples(dataset, 13, seed=2)
    want = _dp_scores(rm_dir, dataset, samples, {"micro_batch_size": 5})
    for got in run_data_parallel(_dp_scores, world_size, rm_dir, dataset, samples, {"max_token_len": 50}):
        assert torch.equal(got, want)


def test_without_a_function_the_model_scores_and_the_rule_is_acc(rm_dir, dataset):
    samples = random_samples(dataset, 8)
    record = dataset[0]
    answer = str(record.columns["reward_model"]["ground_truth"])
    tokenizer = char_tokenizer()
    right = type(samples[0])(0, 9, list(record.prompt_ids), tokenizer.encode(answer) + [1], [], True)
    rewards = score_samples(_reward(rm_dir), dataset, samples + [right], 1, default_collective())
    assert rewards.scores.tolist() == rewards.extra["rm_score"]
    assert rewards.extra["acc"][-1] == 1.0 and set(rewards.extra["acc"]) <= {0.0, 1.0}
    assert "timing_s/reward_model" in rewards.stats
    no_rule = score_samples(_reward(rm_dir, rule_metric=False), dataset, samples, 1, default_collective())
    assert "acc" not in no_rule.extra


def test_a_function_combines_the_model_score(rm_dir, dataset):
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, rm_score=None):
        return 10.0 + 0.5 * rm_score

    def trl_reward(prompts, completions, rm_score, **kwargs):
        return [2.0 * v for v in rm_score]

    samples = random_samples(dataset, 9)
    plain = score_samples(_reward(rm_dir), dataset, samples, 1, default_collective()).scores
    verl = score_samples(
        _reward(rm_dir, fn=RewardFunction(compute_score, "combine", "verl")), dataset, samples, 1, default_collective()
    )
    assert torch.equal(verl.scores, 10.0 + 0.5 * plain) and verl.extra["rm_score"] == plain.tolist()
    trl = score_samples(
        _reward(rm_dir, fn=RewardFunction(trl_reward, "trl", "trl")), dataset, samples, 1, default_collective()
    )
    assert torch.equal(trl.scores, 2.0 * plain)

    def ignores_it(data_source, solution_str, ground_truth):
        return 1.0

    with pytest.raises(RewardError, match="does not take rm_score"):
        check_function_takes_score(RewardFunction(ignores_it, "ignores", "verl"))


def test_own_chat_template_renders_the_conversation(rm_dir, dataset):
    samples = random_samples(dataset, 6)
    own = _reward(rm_dir, chat_template="own")
    texts = ["12", "7", "x", "", "99", "3"]
    ids = own.model.inputs([dataset[s.uid] for s in samples], samples, texts)
    tokenizer = char_tokenizer()
    prompt = dataset[samples[0].uid].prompt
    content = prompt if isinstance(prompt, str) else prompt[-1]["content"]
    decoded = tokenizer.decode(ids[0])
    assert content in decoded and "12" in decoded[decoded.index(content) + len(content) :]
    assert all(len(i) > len(t) for i, t in zip(ids, texts))
    scores = score_samples(own, dataset, samples, 1, default_collective()).scores
    policy = score_samples(_reward(rm_dir), dataset, samples, 1, default_collective()).scores
    assert not torch.equal(scores, policy)


def test_keys_in_both_spellings(rm_dir):
    new = reward_model_settings(
        load(
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={rm_dir}",
            "reward.reward_model.micro_batch_size_per_gpu=3",
        )[0]
    )
    old = reward_model_settings(
        load(
            "reward_model.enable=true", f"reward_model.model.path={rm_dir}", "reward_model.micro_batch_size_per_gpu=3"
        )[0]
    )
    assert new == RewardModelSettings(path=rm_dir, micro_batch_size=3, key="reward.reward_model.model_path")
    assert old == RewardModelSettings(path=rm_dir, micro_batch_size=3, key="reward_model.model.path")
    budget = reward_model_settings(
        load(
            "reward.reward_model.enable=true",
            f"reward.reward_model.model_path={rm_dir}",
            "reward_model.use_dynamic_bsz=true",
            "reward_model.forward_max_token_len_per_gpu=77",
            "reward_model.model.input_tokenizer=/some/policy",
        )[0]
    )
    assert (budget.micro_batch_size, budget.max_token_len, budget.chat_template) == (None, 77, "own")
    assert reward_model_settings(load()[0]) is None


def test_bad_reward_model_input_is_named(rm_dir, tmp_path):
    def settings_error(*overrides) -> ConfigError:
        with pytest.raises(ConfigError) as info:
            reward_model_settings(load(*overrides)[0])
        return info.value

    assert settings_error("reward.reward_model.enable=true").field == "reward.reward_model.model_path"
    missing = settings_error("reward_model.enable=true", f"reward_model.model.path={tmp_path}/none")
    assert missing.field == "reward_model.model.path" and "not a local directory" in str(missing)
    from splitproof.builtin import charlm_directory

    causal = settings_error("reward.reward_model.enable=true", f"reward.reward_model.model_path={charlm_directory()}")
    assert "not a sequence classifier" in str(causal) and "LlamaForCausalLM" in str(causal)
    conflict = settings_error(
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={rm_dir}",
        "reward.reward_model.micro_batch_size_per_gpu=2",
        "reward_model.micro_batch_size_per_gpu=4",
    )
    assert conflict.field == "reward_model.micro_batch_size_per_gpu" and "conflicts" in str(conflict)
    template = settings_error(
        "reward.reward_model.enable=true",
        f"reward.reward_model.model_path={rm_dir}",
        "reward.reward_model.chat_template=theirs",
    )
    assert template.field == "reward.reward_model.chat_template"
    assert error_of("reward.reward_model.enabel=true").field == "reward.reward_model.enabel"


def test_the_built_in_reward_model_ranks_the_right_answer_first(dataset):
    from splitproof.builtin import addition_reward_model_directory

    tokenizer = char_tokenizer()
    model = load_reward_model(RewardModelSettings(path=addition_reward_model_directory()), tokenizer)
    better = 0
    for record in list(dataset)[:12]:
        truth = str(record.columns["reward_model"]["ground_truth"])
        wrong = str(int(truth) + 1)
        seqs = [list(record.prompt_ids) + tokenizer.encode(t, add_special_tokens=False) + [1] for t in (truth, wrong)]
        right_score, wrong_score = last_token_scores(model.model, seqs, micro_batch_size=2, max_token_len=None).tolist()
        better += right_score > wrong_score
    assert better >= 10
