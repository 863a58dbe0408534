import pytest

from splitproof.rl.data import tasks


def prompts(name):
    return [row["prompt"] for row in tasks.task_rows(name)]


def test_default_sizes_and_verl_row_layout():
    train = tasks.task_rows("builtin://addition")
    test = tasks.task_rows("builtin://addition/test")
    assert (len(train), len(test)) == (5000, 500)
    assert train == tasks.task_rows("builtin://addition/train")
    row = train[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    assert row["prompt"] == f"{a}+{b}=" and 0 <= a < 100 and 0 <= b < 100
    assert row["data_source"] == "addition"
    assert row["reward_model"] == {"ground_truth": str(a + b), "style": "rule"}
    assert row["extra_info"] == {"split": "train", "index": 0, "a": a, "b": b}
    rev = tasks.task_rows("builtin://reversal/test?size=50")
    word = rev[3]["extra_info"]["text"]
    assert rev[3]["prompt"] == f"reverse: {word}=" and rev[3]["reward_model"]["ground_truth"] == word[::-1]
    assert all(3 <= len(r["extra_info"]["text"]) <= 5 for r in rev)


@pytest.mark.parametrize("task", ["addition", "reversal"])
def test_held_out_split_never_shares_an_item_with_train(task):
    train = tasks.task_rows(f"builtin://{task}/train")
    test = tasks.task_rows(f"builtin://{task}/test?seed=5")  # another seed: disjoint all the same
    canon = tasks.TASKS[task]()
    train_keys = {canon.canonical(canon_item(task, r)) for r in train}
    test_keys = {canon.canonical(canon_item(task, r)) for r in test}
    assert len({r["prompt"] for r in train}) == len(train)  # distinct items
    assert not train_keys & test_keys


def canon_item(task, row):
    info = row["extra_info"]
    return (info["a"], info["b"]) if task == "addition" else info["text"]


def test_commuted_sums_stay_in_one_split():
    test_pairs = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in tasks.task_rows("builtin://addition/test")}
    train_pairs = {(r["extra_info"]["a"], r["extra_info"]["b"]) for r in tasks.task_rows("builtin://addition")}
    assert not {(b, a) for a, b in test_pairs} & train_pairs


def test_rows_are_a_function_of_the_name_alone():
    name = "builtin://reversal?seed=3&size=200&min_len=2&max_len=7"
    assert tasks.task_rows(name) == tasks.task_rows(name)
    assert prompts("builtin://addition?seed=3&size=200") != prompts("builtin://addition?seed=4&size=200")
    # a smaller size is a prefix of a larger one
    assert prompts("builtin://addition?size=50") == prompts("builtin://addition?size=300")[:50]
    lengths = {len(r["extra_info"]["text"]) for r in tasks.task_rows(name)}
    assert lengths == set(range(2, 8))


def test_digits_parameter():
    rows = tasks.task_rows("builtin://addition?digits=3&size=300")
    assert max(max(r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows) >= 100
    assert all(r["extra_info"]["a"] < 1000 for r in rows)


def test_score_is_exact_match_after_stripping():
    assert tasks.score(" 82\n", "82") == 1.0
    assert tasks.score("82 ", 82) == 1.0
    assert tasks.score("8 2", "82") == 0.0
    assert tasks.score("820", "82") == 0.0
    assert tasks.score("", "82") == 0.0


@pytest.mark.parametrize(
    "name, message",
    [
        ("builtin://multiply", "unknown built-in task 'multiply'; built-in tasks: addition, reversal, product"),
        ("builtin://addition/valid", "unknown split 'valid'"),
        ("builtin://addition?width=3", "unknown parameter 'width'; addition takes seed, size, digits"),
        ("builtin://reversal?size=ten", "parameter size must be an integer"),
        ("builtin://addition?digits=0", "digits must be between 1 and 9"),
        ("builtin://reversal?min_len=6&max_len=3", "need 1 <= min_len <= max_len"),
        ("builtin://addition?size=0", "need seed >= 0 and size >= 1"),
        ("builtin://addition?digits=1&size=200", "found only .* distinct items for size=200"),
    ],
)
def test_bad_names(name, message):
    with pytest.raises(ValueError, match=message):
        tasks.task_rows(name)
