"""Built-in reward rules: pure functions of (response text, ground truth) → score.

They are the rules ``data_source`` selects when no reward function is named, and helpers a user's own
reward file may import (``from splitproof.rl.rewards.rules import exact_match``). A rule with an entry in
``ANSWERS`` also reports the answer it compared, as the number ``answer_id`` (the reward's ``pred``: what
the held-out ``maj@k`` votes on).
"""

from __future__ import annotations

import hashlib
import math
import re
from decimal import Decimal, InvalidOperation

from ..data import tasks

GSM8K_TAIL_CHARS = 300  # verl looks for the answer only in the last 300 characters
_GSM8K_ANSWER = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def exact_match(response: str, ground_truth: object) -> float:
    """1.0 when the response equals the ground truth, both stripped of surrounding whitespace, else 0.0."""
    return tasks.score(response, ground_truth)


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-1,234.5`` → ``"-1234.5"``), or None."""
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _as_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def last_number_match(response: str, ground_truth: object) -> float:
    """1.0 when the last number in the response equals the ground truth as a number (``"7.0"`` = ``7``).

    A ground truth that is not a number is an error (the data is wrong, not the response).
    """
    expected = _as_decimal(str(ground_truth).strip().replace(",", ""))
    if expected is None:
        raise ValueError(f"ground truth {ground_truth!r} is not a number")
    found = last_number(response)
    value = _as_decimal(found) if found is not None else None
    return 1.0 if value is not None and value == expected else 0.0


def format_check(response: str, pattern: str) -> float:
    """1.0 when the whole response (stripped) matches the regular expression ``pattern``, else 0.0."""
    return 1.0 if re.fullmatch(pattern, response.strip(), flags=re.DOTALL) else 0.0


def gsm8k_answer(text: str) -> str | None:
    """verl's strict GSM8K extraction: the last ``#### <number>`` in the final 300 characters, commas and
    dollar signs removed; None when there is none."""
    found = _GSM8K_ANSWER.findall(text[-GSM8K_TAIL_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k_ground_truth(ground_truth: object) -> str:
    """The reference answer as a string; a full GSM8K solution (``"... #### 1,234"``) gives ``"1234"``."""
    text = str(ground_truth).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    return text


def gsm8k_score(response: str, ground_truth: object) -> float:
    """1.0 when the strict ``####`` answer equals the reference string exactly, else 0.0 (no format credit)."""
    answer = gsm8k_answer(response)
    return 1.0 if answer is not None and answer == gsm8k_ground_truth(ground_truth) else 0.0


MATH_VERIFY_HINT = "pip install 'splitproof[math]' (math-verify), or name a reward function"


def math_verify_score(response: str, ground_truth: object) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to ``\\boxed{ground_truth}``."""
    try:
        from math_verify import parse, verify
    except ImportError:
        raise ImportError(f"boxed-answer scoring needs the optional package math-verify: {MATH_VERIFY_HINT}") from None
    gold = parse("\\boxed{" + str(ground_truth) + "}")
    answer = parse(response)
    return 1.0 if verify(gold, answer) else 0.0


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")

# data_source → rule(response, ground_truth). verl's names for the sets it scores by rule, then ours.
RULES = {
    "openai/gsm8k": gsm8k_score,
    **dict.fromkeys(MATH_SOURCES, math_verify_score),
    **tasks.SCORES,
    "exact_match": exact_match,
    "last_number": last_number_match,
}


# data_source → the answer its rule compares (None: no answer found), for the held-out maj@k (``pred``)
ANSWERS = {
    "openai/gsm8k": gsm8k_answer,
    **tasks.ANSWERS,
    "exact_match": lambda response: response.strip(),
    "last_number": last_number,
}
_TEXT_IDS = 1 << 53  # text answers map into [2^53, 2^54), where float64 holds the even integers exactly


def answer_id(answer: str | None) -> float:
    """A number that is equal for equal answers (the held-out ``pred``): an integer answer is its value
    (when |value| < 2^53), any other text 2^53 + 2 × (52 bits of its BLAKE2b digest); no answer is NaN."""
    if answer is None or answer == "":
        return math.nan
    if re.fullmatch(r"[+-]?\d+", answer) and abs(int(answer)) < _TEXT_IDS:
        return float(int(answer))
    digest = int.from_bytes(hashlib.blake2b(answer.encode("utf-8"), digest_size=8).digest(), "little")
    return float(_TEXT_IDS + 2 * (digest % (1 << 52)))
