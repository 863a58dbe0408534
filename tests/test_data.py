import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from splitproof.builtin import char_tokenizer
from splitproof.rl.data.prompts import DataError, load_prompts, truncate

TOK = char_tokenizer()


def ids(text):
    return tuple(TOK.encode(text, add_special_tokens=False))


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "1+1? #### answer"}],
        "ability": "math",
        "reward_model": {"ground_truth": "2", "style": "rule"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
        "ability": "math",
        "reward_model": {"ground_truth": "4", "style": "rule"},
        "extra_info": {"split": "train", "index": 1},
    },
]
TRL_ROWS = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "5+5=", "answer": "10"}, {"prompt": "1+0=", "answer": "1"}]


def test_verl_parquet_and_trl_jsonl_concatenate_with_uids_in_order(tmp_path):
    verl = write_parquet(tmp_path / "train.parquet", VERL_ROWS)
    trl = write_jsonl(tmp_path / "more.jsonl", TRL_ROWS)
    data = load_prompts([verl, trl], TOK)
    assert len(data) == 5
    assert [r.uid for r in data] == [0, 1, 2, 3, 4]
    first = data[0]
    assert first.prompt == VERL_ROWS[0]["prompt"]
    assert first.prompt_ids == ids("user: 1+1? #### answer\nassistant: ")
    assert data[1].prompt_ids == ids("system: Be brief.\nuser: 2+2?\nassistant: ")
    assert first.data_source == "openai/gsm8k"
    assert first.columns["reward_model"] == {"ground_truth": "2", "style": "rule"}
    assert first.columns["extra_info"] == {"split": "train", "index": 0}
    assert first.columns["ability"] == "math"
    assert data[2].prompt == "3+4=" and data[2].prompt_ids == ids("3+4=")
    assert data[2].data_source == "" and data[2].columns == {"prompt": "3+4=", "answer": "7"}
    assert data.origin(3) == f"{trl} row 1"
    assert data.data_sources == {"openai/gsm8k": 0, "": 2}
    assert set(data.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info", "answer"}


def test_trl_conversational_prompts_and_prompt_key(tmp_path):
    rows = [{"question": [{"role": "user", "content": "hi"}], "solution": "x"}]
    data = load_prompts(write_jsonl(tmp_path / "c.jsonl", rows), TOK, prompt_key="question")
    assert data[0].prompt == rows[0]["question"]
    assert data[0].prompt_ids == ids("user: hi\nassistant: ")


def test_json_array_file_and_single_path(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(TRL_ROWS))
    data = load_prompts(path, TOK)
    assert [r.prompt for r in data] == ["3+4=", "5+5=", "1+0="]


def test_chat_template_kwargs_reach_the_template(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = (
        "{{ hint }}|{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    rows = [{"prompt": [{"role": "user", "content": "q"}]}]
    data = load_prompts(write_jsonl(tmp_path / "k.jsonl", rows), tok, apply_chat_template_kwargs={"hint": "H"})
    assert data[0].prompt_ids == ids("H|q>")


def test_reward_fn_key_selects_the_data_source_column(tmp_path):
    rows = [{"prompt": "a", "data_source": "x", "task": "addition"}]
    data = load_prompts(write_jsonl(tmp_path / "r.jsonl", rows), TOK, reward_fn_key="task")
    assert data[0].data_source == "addition"


def test_max_samples_keeps_the_first_rows_of_the_concatenation(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", TRL_ROWS[:2])
    b = write_jsonl(tmp_path / "b.jsonl", TRL_ROWS[2:])
    data = load_prompts([a, b], TOK, max_samples=3)
    assert [r.prompt for r in data] == ["3+4=", "5+5=", "1+0="]
    assert [r.prompt for r in load_prompts([a, b], TOK, max_samples=1)] == ["3+4="]


@pytest.mark.parametrize(
    "mode, expected",
    [("left", "56789"), ("right", "01234"), ("middle", "01789")],
)
def test_truncation_modes(tmp_path, mode, expected):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "0123456789"}, {"prompt": "abc"}])
    data = load_prompts(path, TOK, max_prompt_length=5, truncation=mode)
    assert data[0].prompt_ids == ids(expected)
    assert data[1].prompt_ids == ids("abc")
    assert data[0].prompt == "0123456789"


def test_truncate_keeps_exactly_max_length():
    for n in range(1, 12):
        for mode in ("left", "right", "middle"):
            out = truncate(list(range(11)), n, mode)
            assert len(out) == n and set(out) <= set(range(11))


def test_overlong_prompt_with_truncation_error_names_file_row_and_lengths(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "ok"}, {"prompt": "0123456789"}])
    with pytest.raises(DataError, match=r"t\.jsonl row 1: the prompt is 10 tokens, longer than max_prompt_length=5"):
        load_prompts(path, TOK, max_prompt_length=5)


def test_chat_prompt_length_counts_the_rendered_template(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": [{"role": "user", "content": "ab"}]}])
    n = len(ids("user: ab\nassistant: "))
    assert len(load_prompts(path, TOK, max_prompt_length=n)[0].prompt_ids) == n
    with pytest.raises(DataError, match=f"is {n} tokens"):
        load_prompts(path, TOK, max_prompt_length=n - 1)


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"prompt": "a"}, {"other": "b"}], r"row 1: the row has no 'prompt' \(missing or null\)"),
        ([{"prompt": "a"}, {"prompt": "   "}], r"row 1: 'prompt' is empty"),
        ([{"prompt": []}], r"row 0: 'prompt' is an empty message list"),
        ([{"prompt": [{"role": "user"}]}], r"row 0: message 0 of 'prompt' has no 'content' string"),
        ([{"prompt": [{"content": "x"}]}], r"row 0: message 0 of 'prompt' has no 'role' string"),
        ([{"prompt": [{"role": "user", "content": ""}]}], r"row 0: every message of 'prompt' is empty"),
        ([{"prompt": 5}], r"row 0: 'prompt' is int; it must be a string or a list of chat messages"),
        ([{"prompt": "a", "data_source": 3}], r"row 0: 'data_source' must be a string"),
    ],
)
def test_bad_rows_name_the_file_and_row(tmp_path, rows, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"bad\.jsonl " + message):
        load_prompts(str(path), TOK)


def test_message_that_is_not_a_dict(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"prompt": [{"role": "user", "content": "x"}]}, {"prompt": ["x"]}]))
    with pytest.raises(DataError, match=r"bad\.json: cannot read it as JSON Lines"):
        load_prompts(path, TOK)  # pyarrow cannot mix a list of structs with a list of strings
    write_parquet(tmp_path / "m.parquet", [{"prompt": [["user", "x"]]}])
    with pytest.raises(DataError, match=r"row 0: message 0 of 'prompt' is list, not a dict"):
        load_prompts(tmp_path / "m.parquet", TOK)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: prompt file not found"):
        load_prompts(tmp_path / "nope.parquet", TOK)
    (tmp_path / "dir.jsonl").mkdir()
    with pytest.raises(DataError, match=r"dir\.jsonl: prompt file is a directory"):
        load_prompts(tmp_path / "dir.jsonl", TOK)
    (tmp_path / "rows.csv").write_text("prompt\na\n")
    with pytest.raises(DataError, match=r"rows\.csv: unsupported file type '\.csv'"):
        load_prompts(tmp_path / "rows.csv", TOK)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"junk\.parquet: cannot read it as Parquet"):
        load_prompts(tmp_path / "junk.parquet", TOK)
    (tmp_path / "junk.jsonl").write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    with pytest.raises(DataError, match=r"junk\.jsonl: cannot read it as JSON Lines"):
        load_prompts(tmp_path / "junk.jsonl", TOK)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: cannot read it as JSON Lines: the file is empty"):
        load_prompts(tmp_path / "empty.jsonl", TOK)
    write_parquet(tmp_path / "cols.parquet", [{"question": "a"}])
    with pytest.raises(DataError, match=r"cols\.parquet: no column 'prompt' \(data.prompt_key\); columns: question"):
        load_prompts(tmp_path / "cols.parquet", TOK)
    with pytest.raises(DataError, match="no prompt files given"):
        load_prompts([], TOK)


def test_chat_prompt_needs_a_chat_template(tmp_path):
    tok = char_tokenizer()
    tok.chat_template = None
    path = write_jsonl(tmp_path / "c.jsonl", [{"prompt": [{"role": "user", "content": "x"}]}])
    with pytest.raises(
        DataError, match="row 0: 'prompt' is a chat-message list but the tokenizer has no chat template"
    ):
        load_prompts(path, tok)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"truncation": "drop"}, "truncation must be one of error, left, right, middle"),
        ({"max_samples": 0}, "max_samples must be -1"),
        ({"max_prompt_length": 0}, "max_prompt_length must be a positive integer"),
        ({"prompt_key": ""}, "prompt_key must be a column name"),
    ],
)
def test_bad_options(tmp_path, options, message):
    path = write_jsonl(tmp_path / "a.jsonl", TRL_ROWS)
    with pytest.raises(DataError, match=message):
        load_prompts(path, TOK, **options)


def test_builtin_task_names_load_like_files():
    data = load_prompts(["builtin://addition/test?size=20", "builtin://reversal?size=10"], TOK, max_prompt_length=64)
    assert len(data) == 30
    assert data[0].data_source == "addition" and data[25].data_source == "reversal"
    assert data[0].prompt_ids == ids(data[0].prompt)
    assert data.origin(25) == "builtin://reversal?size=10 row 5"
    with pytest.raises(DataError, match="unknown built-in task 'multiply'"):
        load_prompts("builtin://multiply", TOK)
