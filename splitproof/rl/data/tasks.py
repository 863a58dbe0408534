"""Built-in synthetic tasks with verifiable answers, generated from a seed, each with a held-out split.

Named where a data file goes: ``builtin://TASK[/SPLIT][?key=value&...]`` with SPLIT ``train`` (default) or
``test``, e.g. ``builtin://addition/test?digits=3&size=200``. Parameters every task takes: ``seed`` (0),
``size`` (5000 rows for train, 500 for test). Task parameters:

- ``addition``: ``digits`` (2): operands drawn uniformly from [0, 10**digits); prompt ``"37+45="``, answer
  ``"82"``.
- ``reversal``: ``min_len`` (3), ``max_len`` (5): a lowercase word with a length drawn uniformly from
  [min_len, max_len], letters uniform; prompt ``"reverse: abcde="``, answer ``"edcba"``.
- ``product``: ``digits`` (3): operands drawn uniformly from [10**(digits-1), 10**digits); prompt
  ``"123*456="``, answer ``"56088"``. Made for tool use (a calculator: ``splitproof/builtin/calculator.py``):
  the reward reads the response's last line, so a multi-turn answer after a tool response counts.

Held out means held out whatever the parameters: whether an item belongs to the test split is a fixed
property of the item (a hash of its canonical form, one item in ten, independent of seed, size and task
parameters), so ``train`` and ``test`` never share an item. The canonical form of an addition item is
the unordered operand pair, so ``45+37=`` can never be in train when ``37+45=`` is in test.

Items are drawn from a counter-based stream (SHAKE-128 of ``(task, split, seed, draw index)``); repeats
are skipped, so a split holds distinct items (``37+45=`` and ``45+37=`` are two items) in draw order.
The rows are therefore a function of (task, split, parameters) alone, on any machine and any library
version.

Rows use verl's layout: ``prompt`` (str), ``data_source`` (the task name),
``reward_model = {"ground_truth": answer, "style": "rule"}``, ``extra_info`` (split, index, the operands
or the word). Reward (``score``): 1.0 when the response with surrounding whitespace stripped equals the
answer, else 0.0 — no partial credit, so the mean reward on ``test`` is the exact-match rate
(``product``: the last line of the response, ``final_line_score``).
"""

from __future__ import annotations

import hashlib
import string
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlsplit

SCHEME = "builtin://"
SPLITS = ("train", "test")
DEFAULT_SIZE = {"train": 5000, "test": 500}
HELD_OUT_ONE_IN = 10


def _words(*key: object) -> Iterator[int]:
    """Endless 64-bit words of SHAKE-128 keyed by ``key`` (counter-based: the same key, the same words)."""
    block = 0
    while True:
        digest = hashlib.shake_128(repr((*key, block)).encode()).digest(64)
        for i in range(0, 64, 8):
            yield int.from_bytes(digest[i : i + 8], "little")
        block += 1


def is_held_out(task: str, canonical: str) -> bool:
    """Whether an item belongs to the test split: a fixed hash of (task, canonical item), one in ten."""
    digest = hashlib.shake_128(f"held-out|{task}|{canonical}".encode()).digest(8)
    return int.from_bytes(digest, "little") % HELD_OUT_ONE_IN == 0


@dataclass(frozen=True)
class Addition:
    """``a+b=`` → ``str(a + b)`` with a, b uniform in [0, 10**digits)."""

    digits: int = 2
    name = "addition"

    def check(self) -> None:
        if not 1 <= self.digits <= 9:
            raise ValueError(f"digits must be between 1 and 9, got {self.digits}")

    def space(self) -> int:
        return (10**self.digits) ** 2

    def draw(self, words: Iterator[int]) -> tuple[int, int]:
        high = 10**self.digits
        return next(words) % high, next(words) % high

    def canonical(self, item: tuple[int, int]) -> str:
        a, b = sorted(item)
        return f"{a}+{b}"

    def row(self, item: tuple[int, int]) -> tuple[str, str, dict]:
        a, b = item
        return f"{a}+{b}=", str(a + b), {"a": a, "b": b}


@dataclass(frozen=True)
class Reversal:
    """``reverse: w=`` → ``w`` reversed, w a lowercase word of length uniform in [min_len, max_len]."""

    min_len: int = 3
    max_len: int = 5
    name = "reversal"

    def check(self) -> None:
        if not 1 <= self.min_len <= self.max_len <= 32:
            raise ValueError(f"need 1 <= min_len <= max_len <= 32, got min_len={self.min_len} max_len={self.max_len}")

    def space(self) -> int:
        return sum(26**n for n in range(self.min_len, self.max_len + 1))

    def draw(self, words: Iterator[int]) -> str:
        length = self.min_len + next(words) % (self.max_len - self.min_len + 1)
        return "".join(string.ascii_lowercase[next(words) % 26] for _ in range(length))

    def canonical(self, item: str) -> str:
        return item

    def row(self, item: str) -> tuple[str, str, dict]:
        return f"reverse: {item}=", item[::-1], {"text": item}


@dataclass(frozen=True)
class Product(Addition):
    """``a*b=`` → ``str(a * b)`` with a, b uniform in [10**(digits-1), 10**digits) (``check`` as addition's)."""

    digits: int = 3
    name = "product"

    def space(self) -> int:
        return (9 * 10 ** (self.digits - 1)) ** 2

    def draw(self, words: Iterator[int]) -> tuple[int, int]:
        low = 10 ** (self.digits - 1)
        return low + next(words) % (9 * low), low + next(words) % (9 * low)

    def canonical(self, item: tuple[int, int]) -> str:
        a, b = sorted(item)
        return f"{a}*{b}"

    def row(self, item: tuple[int, int]) -> tuple[str, str, dict]:
        a, b = item
        return f"{a}*{b}=", str(a * b), {"a": a, "b": b}


TASKS = {"addition": Addition, "reversal": Reversal, "product": Product}
TASK_NAMES = tuple(TASKS)


@dataclass(frozen=True)
class TaskSpec:
    """A parsed ``builtin://`` name."""

    task: Addition | Reversal | Product
    split: str
    seed: int
    size: int


def parse_task_name(name: str) -> TaskSpec:
    """``builtin://TASK[/SPLIT][?key=value&...]`` → a checked spec (``ValueError`` naming what is wrong)."""
    parts = urlsplit(name)
    task_name = parts.netloc
    if parts.scheme + "://" != SCHEME or task_name not in TASKS:
        raise ValueError(f"{name}: unknown built-in task {task_name!r}; built-in tasks: {', '.join(TASK_NAMES)}")
    split = parts.path.strip("/") or "train"
    if split not in SPLITS:
        raise ValueError(f"{name}: unknown split {split!r}; splits: {', '.join(SPLITS)}")
    task_cls = TASKS[task_name]
    task_fields = tuple(task_cls.__dataclass_fields__)
    known = ("seed", "size") + task_fields
    values: dict[str, int] = {}
    for key, text in parse_qsl(parts.query, keep_blank_values=True):
        if key not in known:
            raise ValueError(f"{name}: unknown parameter {key!r}; {task_name} takes {', '.join(known)}")
        try:
            values[key] = int(text)
        except ValueError:
            raise ValueError(f"{name}: parameter {key} must be an integer, got {text!r}") from None
    seed = values.pop("seed", 0)
    size = values.pop("size", DEFAULT_SIZE[split])
    if seed < 0 or size < 1:
        raise ValueError(f"{name}: need seed >= 0 and size >= 1, got seed={seed} size={size}")
    task = task_cls(**values)
    try:
        task.check()
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    return TaskSpec(task=task, split=split, seed=seed, size=size)


def generate(spec: TaskSpec) -> list:
    """``spec.size`` distinct items of the split, in draw order."""
    words = _words("item", spec.task.name, spec.split, spec.seed)
    want_held_out = spec.split == "test"
    items, seen = [], set()
    max_draws = 20 * spec.size + 1000
    for _ in range(max_draws):
        item = spec.task.draw(words)
        if item in seen or is_held_out(spec.task.name, spec.task.canonical(item)) != want_held_out:
            continue
        seen.add(item)
        items.append(item)
        if len(items) == spec.size:
            return items
    raise ValueError(
        f"builtin://{spec.task.name}/{spec.split}: {max_draws} draws found only {len(items)} distinct items for "
        f"size={spec.size} (the task has {spec.task.space()} items, about one in {HELD_OUT_ONE_IN} held out); "
        f"ask for fewer with size= or widen the task"
    )


def task_rows(name: str) -> list[dict]:
    """The rows of a ``builtin://`` name, in verl's layout."""
    spec = parse_task_name(name)
    rows = []
    for index, item in enumerate(generate(spec)):
        prompt, answer, info = spec.task.row(item)
        rows.append(
            {
                "prompt": prompt,
                "data_source": spec.task.name,
                "reward_model": {"ground_truth": answer, "style": "rule"},
                "extra_info": {"split": spec.split, "index": index, **info},
            }
        )
    return rows


def score(response: str, ground_truth: object) -> float:
    """Exact match: 1.0 when ``response.strip() == str(ground_truth).strip()``, else 0.0."""
    return 1.0 if response.strip() == str(ground_truth).strip() else 0.0


def final_line_score(response: str, ground_truth: object) -> float:
    """Exact match of the response's last line (what follows the last newline, e.g. the answer after a
    tool response ``"=56088\n"``)."""
    return score(response.rsplit("\n", 1)[-1], ground_truth)


def answer(response: str) -> str:
    """The answer a response gives, as ``score`` compares it: the response, stripped."""
    return response.strip()


def final_line_answer(response: str) -> str:
    """The answer ``final_line_score`` compares: the response's last line, stripped."""
    return answer(response.rsplit("\n", 1)[-1])


SCORES = {"addition": score, "reversal": score, "product": final_line_score}
ANSWERS = {"addition": answer, "reversal": answer, "product": final_line_answer}  # what each rule compares
