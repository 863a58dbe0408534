import json
import math
import sys
import textwrap
import types
from dataclasses import dataclass

import pytest
import torch

from splitproof.builtin import char_tokenizer
from splitproof.rl.data.prompts import PromptRecord, load_prompts
from splitproof.rl.rewards.functions import (
    RewardError,
    check_reward_sources,
    default_reward_for,
    detect_convention,
    load_reward_function,
    score,
)
from splitproof.rl.rewards.token_scores import token_level_scores

TOK = char_tokenizer()
EOS = TOK.eos_token_id


@dataclass
class Sample:  # the rollout's Sample, field for field
    uid: int
    sample_index: int
    prompt_ids: list
    response_ids: list
    log_probs: list
    finished: bool


def sample(uid, index, text, finished=True):
    ids = TOK.encode(text) + ([EOS] if finished else [])
    return Sample(uid, index, [], ids, [0.0] * len(ids), finished)


def record(uid, prompt, data_source="", **columns):
    columns = {"prompt": prompt, **columns}
    if data_source:
        columns["data_source"] = data_source
    return PromptRecord(
        uid, prompt, tuple(TOK.encode(prompt if isinstance(prompt, str) else "x")), data_source, columns
    )


def reward_file(tmp_path, body, name="reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def run(reward_fn, records, samples, step=3, max_steps=10):
    return score(reward_fn, records, samples, TOK, step=step, max_steps=max_steps)


VERL_BODY = """
    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        CALLS.append((data_source, solution_str, ground_truth, extra_info))
        return 1.0 if solution_str.strip() == ground_truth else 0.0
"""


def gsm_records():
    return [
        record(0, "1+1=", "arith", reward_model={"ground_truth": "2"}, extra_info={"index": 0}),
        record(1, "2+2=", "arith", reward_model={"ground_truth": "4"}, extra_info={"index": 1}),
    ]


def test_verl_function_from_a_file_path(tmp_path):
    fn = load_reward_function(reward_file(tmp_path, VERL_BODY))
    assert fn.convention == "verl"
    samples = [sample(0, 0, "2"), sample(0, 1, "3"), sample(1, 0, "4", finished=False)]
    result = run(fn, gsm_records(), samples)
    assert result.scores.dtype == torch.float64
    assert result.scores.tolist() == [1.0, 0.0, 1.0]
    assert result.responses == ["2", "3", "4"]  # EOS dropped, nothing else
    calls = sys.modules[fn.fn.__module__].CALLS
    assert calls[0] == ("arith", "2", "2", {"index": 0})
    assert result.extra == {}


def test_a_users_own_jsonl_task_with_a_compute_score_file(tmp_path):
    path = tmp_path / "sums.jsonl"
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(3, 4), (5, 6)]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = load_prompts(str(path), TOK)
    fn = load_reward_function(reward_file(tmp_path, VERL_BODY))
    check_reward_sources(data, fn)  # no data_source needed once a function is named
    result = run(fn, list(data), [sample(0, 0, "7"), sample(1, 0, "12")])
    assert result.scores.tolist() == [1.0, 0.0]
    assert sys.modules[fn.fn.__module__].CALLS == [("", "7", "7", {}), ("", "12", "11", {})]


def test_extra_info_is_a_copy(tmp_path):
    body = """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            extra_info["seen"] = True
            return 0.0
    """
    fn = load_reward_function(reward_file(tmp_path, body))
    records = gsm_records()
    run(fn, records, [sample(0, 0, "2")])
    assert records[0].columns["extra_info"] == {"index": 0}


def test_file_url_pkg_path_name_and_reward_kwargs(tmp_path, monkeypatch):
    body = """
        def my_score(data_source, solution_str, ground_truth, bonus=0.0):
            return float(solution_str == ground_truth) + bonus
    """
    path = reward_file(tmp_path, body)
    fn = load_reward_function("file://" + path, "my_score", reward_kwargs={"bonus": 0.5})
    assert run(fn, gsm_records(), [sample(0, 0, "2")]).scores.tolist() == [1.5]  # no extra_info: not passed
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    for spec in ("pkg://mypkg.scores", "pkg://mypkg/scores"):
        fn = load_reward_function(spec, "my_score")
        assert run(fn, gsm_records(), [sample(1, 0, "5")]).scores.tolist() == [0.0]


def test_reward_kwargs_win_over_the_calls_own_and_must_be_taken(tmp_path):
    """verl merges reward_kwargs over the call's keyword arguments: a reward_kwargs entry wins."""
    body = """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            return float(ground_truth)
    """
    fn = load_reward_function(reward_file(tmp_path, body), reward_kwargs={"ground_truth": "7"})
    assert run(fn, gsm_records(), [sample(0, 0, "2")]).scores.tolist() == [7.0]
    strict = "def compute_score(data_source, solution_str, ground_truth):\n    return 0.0\n"
    with pytest.raises(RewardError, match=r"reward_kwargs passes bonus, which it does not take"):
        load_reward_function(reward_file(tmp_path, strict, "strict.py"), reward_kwargs={"bonus": 1})


def test_dict_results_give_extra_metrics(tmp_path):
    body = """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            out = {"score": 2.0 if solution_str == ground_truth else -1.0, "acc": solution_str == ground_truth,
                   "pred": solution_str}
            if extra_info["index"] == 1:
                out["len"] = len(solution_str)
            return out
    """
    fn = load_reward_function(reward_file(tmp_path, body))
    result = run(fn, gsm_records(), [sample(0, 0, "2"), sample(1, 0, "44"), sample(0, 1, "x")])
    assert result.scores.tolist() == [2.0, -1.0, -1.0]
    assert result.extra["acc"] == [1.0, 0.0, 0.0]
    assert math.isnan(result.extra["len"][0]) and result.extra["len"][1] == 2.0
    assert "pred" not in result.extra  # text values are not metrics


TRL_BODY = """
    SEEN = {}

    def accuracy(prompts, completions, answer, completion_ids, trainer_state, **kwargs):
        SEEN.update(prompts=prompts, completions=completions, answer=answer, completion_ids=completion_ids,
                    step=(trainer_state.global_step, trainer_state.max_steps), kwargs=kwargs)
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [1.0 if t == a else 0.0 for t, a in zip(texts, answer)]
"""


def test_trl_function_with_plain_prompts(tmp_path):
    path = tmp_path / "trl.jsonl"
    path.write_text(json.dumps({"prompt": "3+4=", "answer": "7", "level": 1}) + "\n")
    data = load_prompts(str(path), TOK)
    fn = load_reward_function(reward_file(tmp_path, TRL_BODY), "accuracy")
    assert fn.convention == "trl"
    check_reward_sources(data, fn)
    result = run(fn, list(data), [sample(0, 0, "7"), sample(0, 1, "8", finished=False)], step=4, max_steps=9)
    assert result.scores.tolist() == [1.0, 0.0]
    seen = sys.modules[fn.fn.__module__].SEEN
    assert seen["prompts"] == ["3+4=", "3+4="]
    assert seen["completions"] == ["7", "8"]
    assert seen["answer"] == ["7", "7"]
    assert seen["completion_ids"] == [TOK.encode("7") + [EOS], TOK.encode("8")]
    assert seen["step"] == (4, 9)
    assert seen["kwargs"] == {"level": [1, 1]}  # every other column; 'prompt' is not one of them


def test_trl_function_with_chat_prompts(tmp_path):
    messages = [{"role": "user", "content": "3+4="}]
    fn = load_reward_function(reward_file(tmp_path, TRL_BODY), "accuracy")
    records = [record(5, messages, answer="7")]
    assert run(fn, records, [sample(5, 0, "7")]).scores.tolist() == [1.0]
    seen = sys.modules[fn.fn.__module__].SEEN
    assert seen["prompts"] == [messages]
    assert seen["completions"] == [[{"role": "assistant", "content": "7"}]]


def test_trl_none_scores_zero_with_a_warning(tmp_path):
    body = """
        def maybe(prompts, completions, **kwargs):
            return [None if c == "skip" else 1.0 for c in completions]
    """
    fn = load_reward_function(reward_file(tmp_path, body), "maybe")
    with pytest.warns(UserWarning, match=r"returned None for 1 samples \(first: sample \(uid=0, index=1\)\)"):
        result = run(fn, [record(0, "p")], [sample(0, 0, "a"), sample(0, 1, "skip")])
    assert result.scores.tolist() == [1.0, 0.0]


def test_trl_async_function(tmp_path):
    body = """
        async def slow(prompts, completions, **kwargs):
            return [float(len(c)) for c in completions]
    """
    fn = load_reward_function(reward_file(tmp_path, body), "slow")
    assert run(fn, [record(0, "p")], [sample(0, 0, "abc")]).scores.tolist() == [3.0]


def test_convention_detection_and_forcing(tmp_path):
    def verl(data_source, solution_str, ground_truth, extra_info=None): ...
    def trl(prompts, completions, **kwargs): ...
    def short_trl(completions, **kwargs): ...
    def neither(a, b): ...

    assert detect_convention(verl) == "verl"
    assert detect_convention(trl) == detect_convention(short_trl) == "trl"
    with pytest.raises(RewardError, match="cannot tell its calling convention"):
        detect_convention(neither)
    body = """
        def f(*args, **kwargs):
            return [0.5] * len(kwargs["completions"])
    """
    path = reward_file(tmp_path, body)
    with pytest.raises(RewardError, match="cannot tell its calling convention"):
        load_reward_function(path, "f")
    fn = load_reward_function(path, "f", convention="trl")
    assert run(fn, [record(0, "p")], [sample(0, 0, "a")]).scores.tolist() == [0.5]
    with pytest.raises(RewardError, match="convention must be one of verl, trl"):
        load_reward_function(path, "f", convention="openrlhf")


def test_loading_errors(tmp_path):
    with pytest.raises(RewardError, match=r"reward function file .*missing\.py: not found"):
        load_reward_function(tmp_path / "missing.py")
    with pytest.raises(RewardError, match=r"reward function file file://.*missing\.py: not found"):
        load_reward_function("file://" + str(tmp_path / "missing.py"))
    with pytest.raises(RewardError, match=r"cannot import no_such_pkg_xyz\.mod: ModuleNotFoundError"):
        load_reward_function("pkg://no_such_pkg_xyz.mod")
    broken = reward_file(tmp_path, "def compute_score(:\n", "broken.py")
    with pytest.raises(RewardError, match=r"broken\.py: importing it failed: SyntaxError"):
        load_reward_function(broken)
    raising = reward_file(tmp_path, "import no_such_module_xyz\n", "raising.py")
    with pytest.raises(RewardError, match=r"raising\.py: importing it failed: ModuleNotFoundError"):
        load_reward_function(raising)
    path = reward_file(tmp_path, VERL_BODY)
    with pytest.raises(
        RewardError, match=r"no function 'score_it' \(custom_reward_function.name\); it defines: compute_score"
    ):
        load_reward_function(path, "score_it")
    with pytest.raises(RewardError, match="'CALLS' is a list, not a function"):
        load_reward_function(path, "CALLS")
    bad_sig = reward_file(tmp_path, "def compute_score(data_source, solution_str):\n    return 0\n", "sig.py")
    with pytest.raises(RewardError, match="does not take ground_truth"):
        load_reward_function(bad_sig)
    for empty in ("", None):
        with pytest.raises(RewardError, match="custom_reward_function.path is empty"):
            load_reward_function(empty)


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise ValueError('boom')", r"raised ValueError: boom on sample \(uid=1, index=2\)"),
        ("return 'high'", r"returned str 'high' for sample \(uid=1, index=2\); expected a number"),
        ("return None", r"returned NoneType None for sample \(uid=1, index=2\)"),
        ("return float('nan')", r"returned nan for sample \(uid=1, index=2\); expected a finite number"),
        ("return float('inf')", r"returned inf for sample \(uid=1, index=2\)"),
        ("return {'acc': 1.0}", r"returned a dict without 'score' for sample \(uid=1, index=2\)"),
        ("return [1.0]", r"returned list \[1.0\] for sample"),
    ],
)
def test_verl_misbehaviour_names_the_function_and_sample(tmp_path, body, message):
    source = (
        "def judge(data_source, solution_str, ground_truth):\n"
        f"    if solution_str == '4':\n        {body}\n    return 0.0\n"
    )
    fn = load_reward_function(reward_file(tmp_path, source), "judge")
    samples = [sample(0, 0, "2"), sample(1, 2, "4")]  # only the second misbehaves
    with pytest.raises(RewardError, match=r"reward function judge \(.*reward\.py\) " + message):
        run(fn, gsm_records(), samples)


@pytest.mark.parametrize(
    "body, message",
    [
        ("return [1.0]", r"returned 1 values for a batch of 2 samples \(first: sample \(uid=0, index=0\)\)"),
        ("return 1.0", r"returned float for a batch of 2 samples"),
        ("return {'a': 1}", r"returned dict for a batch of 2 samples"),
        ("return [1.0, 'x']", r"returned str 'x' for sample \(uid=0, index=1\)"),
        ("return [1.0, float('nan')]", r"returned nan for sample \(uid=0, index=1\)"),
        ("raise KeyError('answer')", r"raised KeyError: 'answer' on a batch of 2 samples"),
    ],
)
def test_trl_misbehaviour(tmp_path, body, message):
    fn = load_reward_function(reward_file(tmp_path, f"def judge(prompts, completions, **kw):\n    {body}\n"), "judge")
    with pytest.raises(RewardError, match=message):
        run(fn, [record(0, "p")], [sample(0, 0, "a"), sample(0, 1, "b")])


def test_numeric_types_are_accepted(tmp_path):
    body = """
        import numpy as np, torch
        def judge(prompts, completions, **kw):
            return [True, np.float32(0.5), torch.tensor(2.0), np.array(3), 4]
    """
    fn = load_reward_function(reward_file(tmp_path, body), "judge")
    result = run(fn, [record(0, "p")], [sample(0, j, "a") for j in range(5)])
    assert result.scores.tolist() == [1.0, 0.5, 2.0, 3.0, 4.0]


def test_builtin_rules_by_data_source():
    records = [
        record(0, "37+45=", "addition", reward_model={"ground_truth": "82"}),
        record(1, "q", "openai/gsm8k", reward_model={"ground_truth": "18"}),
        record(2, "reverse: abc=", "reversal", reward_model={"ground_truth": "cba"}),
        record(3, "q", "last_number", answer="7"),  # TRL answer column as ground truth
    ]
    samples = [
        sample(0, 0, " 82"),
        sample(0, 1, "83"),
        sample(1, 0, "so #### 18"),
        sample(1, 1, "18"),
        sample(2, 0, "cba"),
        sample(3, 0, "it is 7.0"),
    ]
    assert run(None, records, samples).scores.tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert default_reward_for("addition").convention == "verl"


def test_unknown_or_missing_data_source_is_an_error_before_any_model(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"prompt": "a", "data_source": "addition", "reward_model": {"ground_truth": "1"}})
        + "\n"
        + json.dumps({"prompt": "b", "data_source": "my/set", "reward_model": {"ground_truth": "1"}})
        + "\n"
    )
    with pytest.raises(
        RewardError, match=r"d\.jsonl row 1: data_source 'my/set' has no built-in reward rule; name a reward function"
    ):
        check_reward_sources(load_prompts(str(path), TOK), None)
    path.write_text(json.dumps({"prompt": "a", "answer": "1"}) + "\n")
    with pytest.raises(RewardError, match=r"d\.jsonl row 0: rows without a data_source have no built-in reward rule"):
        check_reward_sources(load_prompts(str(path), TOK), None)
    with pytest.raises(RewardError, match=r"sample \(uid=0, index=0\): rows without a data_source"):
        run(None, [record(0, "a")], [sample(0, 0, "x")])


def test_builtin_rule_needs_a_ground_truth(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "data_source": "addition"}) + "\n")
    with pytest.raises(RewardError, match=r"d\.jsonl row 0: no ground truth for the built-in rule of 'addition'"):
        check_reward_sources(load_prompts(str(path), TOK), None)


def test_builtin_tasks_pass_the_check():
    data = load_prompts(["builtin://addition/test?size=5", "builtin://reversal/test?size=5"], TOK)
    check_reward_sources(data, None)


def test_math_sources_use_math_verify_when_installed(monkeypatch, tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(
        json.dumps(
            {"prompt": "q", "data_source": "HuggingFaceH4/MATH-500", "reward_model": {"ground_truth": "\\frac{1}{2}"}}
        )
        + "\n"
    )
    data = load_prompts(str(path), TOK)
    monkeypatch.setitem(sys.modules, "math_verify", None)  # not installed
    with pytest.raises(RewardError, match=r"m\.jsonl row 0: .*math-verify, which is not installed: pip install"):
        check_reward_sources(data, None)
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text: text.replace("\\boxed{", "").rstrip("}").strip()
    fake.verify = lambda gold, answer: gold == answer
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    check_reward_sources(data, None)
    result = run(None, list(data), [sample(0, 0, "\\boxed{\\frac{1}{2}}"), sample(0, 1, "\\boxed{2}")])
    assert result.scores.tolist() == [1.0, 0.0]


def test_trl_function_without_kwargs_must_take_every_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "a", "answer": "1", "level": 2}) + "\n")
    data = load_prompts(str(path), TOK)
    body = "def judge(prompts, completions, answer, completion_ids, trainer_state):\n    return [0.0] * len(prompts)\n"
    fn = load_reward_function(reward_file(tmp_path, body), "judge")
    with pytest.raises(RewardError, match=r"TRL passes it level for this dataset, which it does not take"):
        check_reward_sources(data, fn)


def test_token_level_scores_sit_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    out = token_level_scores(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64), mask)
    expected = torch.tensor([[0, 0, 0.5, 0], [-1.0, 0, 0, 0], [0, 0, 0, 2.0]], dtype=torch.float64)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="sequence 1 has no response token"):
        token_level_scores(torch.zeros(2), torch.tensor([[1, 0], [0, 0]]))
    with pytest.raises(ValueError, match="do not fit"):
        token_level_scores(torch.zeros(3), torch.ones(2, 4))


def test_missing_record_for_a_sample():
    with pytest.raises(RewardError, match=r"no prompt record for sample \(uid=9, index=0\)"):
        run(None, [record(0, "a", "addition")], [sample(9, 0, "x")])
