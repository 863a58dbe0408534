"""reasoning-gym tasks as prompt rows and their reward: ``reasoning-gym://TASK?size=N&seed=S&key=value...``.

``reasoning_gym.create_dataset(TASK, size=N, seed=S, **params)`` generates the items (a function of those
alone); every other query key is a parameter of the task's config (numbers and booleans parsed, e.g.
``min_terms=2``), except the keys read here:

- ``prompt``: ``chat`` (default) — ``[{"role": "system", "content": SYSTEM}, {"role": "user", "content":
  question}]`` with reasoning-gym's ``default`` system prompt (``system=none`` leaves it out, any other
  name picks that entry of ``reasoning_gym.utils.SYSTEM_PROMPTS``) — or ``text``: the question as a plain
  string, followed by ``suffix`` (URL-encoded, default empty).
- ``answer``: ``tag`` (default) — the answer is the text of the last ``<answer>...</answer>`` of the
  response, as reasoning-gym's ``extract_answer`` reads it (none: score 0) — or ``raw``: the whole response,
  stripped.

Rows: ``prompt``, ``data_source`` = ``reasoning_gym/TASK``, ``reward_model.ground_truth`` = the item's
answer, ``extra_info`` = the dataset's arguments and the item's index. The reward is the task's own
``score_answer(answer, entry)`` on the item regenerated from those (a float in [0, 1]).
"""

from __future__ import annotations

import difflib
import functools
import json
from urllib.parse import parse_qsl, urlsplit

SCHEME = "reasoning-gym://"
SOURCE_PREFIX = "reasoning_gym/"
INSTALL_HINT = "pip install 'splitproof[envs]' (reasoning-gym==0.1.25)"
OWN_KEYS = ("size", "seed", "prompt", "system", "suffix", "answer")


def _library():
    try:
        import reasoning_gym
    except ImportError:
        raise ValueError(f"reasoning-gym is not installed: {INSTALL_HINT}") from None
    return reasoning_gym


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse(url: str) -> tuple[str, dict, dict]:
    """(task, the dataset's arguments, the options read here) of a ``reasoning-gym://`` name."""
    parts = urlsplit(url)
    task = (parts.netloc + parts.path).strip("/")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    options = {
        "prompt": query.pop("prompt", "chat"),
        "system": query.pop("system", "default"),
        "suffix": query.pop("suffix", ""),
        "answer": query.pop("answer", "tag"),
    }
    arguments = {"size": int(query.pop("size", 500)), "seed": int(query.pop("seed", 0))}
    arguments.update({k: _value(v) for k, v in query.items()})
    if options["prompt"] not in ("chat", "text"):
        raise ValueError(f"{url}: prompt must be chat or text, got {options['prompt']!r}")
    if options["answer"] not in ("tag", "raw"):
        raise ValueError(f"{url}: answer must be tag or raw, got {options['answer']!r}")
    return task, arguments, options


@functools.lru_cache(maxsize=32)
def _dataset(task: str, arguments: str):
    library = _library()
    names = sorted(library.factory.DATASETS)
    if task not in names:
        close = difflib.get_close_matches(task, names, n=5, cutoff=0.5)
        hint = f"; close names: {', '.join(close)}" if close else f"; tasks: {', '.join(names[:20])}, ..."
        raise ValueError(f"{SCHEME}{task}: reasoning-gym has no task {task!r}{hint}")
    try:
        return library.create_dataset(task, **json.loads(arguments))
    except Exception as e:  # a config that refuses the parameters
        raise ValueError(f"{SCHEME}{task}: create_dataset refused {arguments}: {type(e).__name__}: {e}") from None


def dataset_of(task: str, arguments: dict):
    """The (cached) reasoning-gym dataset of ``task`` with ``arguments``; ``ValueError`` naming close tasks."""
    return _dataset(task, json.dumps(arguments, sort_keys=True))


def task_rows(url: str) -> list[dict]:
    """The rows of a ``reasoning-gym://`` name (module docstring)."""
    task, arguments, options = parse(url)
    dataset = dataset_of(task, arguments)
    system = None
    if options["prompt"] == "chat" and options["system"] != "none":
        prompts = _library().utils.SYSTEM_PROMPTS
        if options["system"] not in prompts:
            raise ValueError(f"{url}: system must be none or one of {', '.join(prompts)}, got {options['system']!r}")
        system = prompts[options["system"]]
    rows = []
    for index in range(len(dataset)):
        entry = dataset[index]
        if options["prompt"] == "text":
            prompt = entry["question"] + options["suffix"]
        else:
            prompt = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": entry["question"]}
            ]
        rows.append(
            {
                "prompt": prompt,
                "data_source": SOURCE_PREFIX + task,
                "reward_model": {"ground_truth": str(entry["answer"]), "style": "rule"},
                "extra_info": {"task": task, "arguments": arguments, "index": index, "answer": options["answer"]},
            }
        )
    return rows


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> dict:
    """verl's convention: the task's ``score_answer`` on the item ``extra_info`` names; ``acc`` 1 when it is 1."""
    info = extra_info or {}
    dataset = dataset_of(info["task"], info["arguments"])
    entry = dataset[info["index"]]
    if info.get("answer", "tag") == "tag":
        answer = _library().utils.extract_answer(solution_str)
    else:
        answer = solution_str.strip()
    value = float(dataset.score_answer(answer, entry))
    return {"score": value, "acc": float(value == 1.0)}
