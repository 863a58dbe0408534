import pytest

from splitproof.rl.rewards.rules import (
    exact_match,
    format_check,
    gsm8k_answer,
    gsm8k_score,
    last_number,
    last_number_match,
)


@pytest.mark.parametrize(
    "response, ground_truth, expected",
    [
        ("So the total is 18.\n#### 18", "18", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas removed from the answer
        ("first #### 5 then #### 7", "7", 1.0),  # the last #### answer counts
        ("first #### 7 then #### 5", "7", 0.0),
        ("#### -3", "-3", 1.0),
        ("#### 18.0", "18", 0.0),  # strict string comparison, as verl
        ("The answer is 18", "18", 0.0),  # no #### : no answer
        ("####18", "18", 0.0),  # the space after #### is required
        ("#### $18", "18", 0.0),  # a dollar sign breaks the number pattern
        ("#### 18" + " filler" * 60, "18", 0.0),  # only the last 300 characters are searched
        ("x" * 400 + " #### 18", "18", 1.0),
        ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # a full GSM8K solution as ground truth
        ("#### 1000", "#### 1,000", 1.0),
        ("#### 72", 72, 1.0),  # a number stored as a number
    ],
)
def test_gsm8k_strict(response, ground_truth, expected):
    assert gsm8k_score(response, ground_truth) == expected


def test_gsm8k_answer_extraction():
    assert gsm8k_answer("#### 3.5, done") == "3.5"
    assert gsm8k_answer("nothing here") is None


def test_last_number_and_match():
    assert last_number("a 1, b -2.5 then 1,000") == "1000"
    assert last_number("no digits") is None
    assert last_number_match("so it is 7.0", "7") == 1.0
    assert last_number_match("7 or 8", "7") == 0.0
    assert last_number_match("none", "7") == 0.0
    with pytest.raises(ValueError, match="ground truth 'seven' is not a number"):
        last_number_match("7", "seven")


def test_exact_match_and_format_check():
    assert exact_match("  edcba\n", "edcba") == 1.0
    assert exact_match("edcb a", "edcba") == 0.0
    assert format_check("<think>x</think> 5", r"<think>.*</think>\s*\d+") == 1.0
    assert format_check("5 <think>x</think>", r"<think>.*</think>\s*\d+") == 0.0
