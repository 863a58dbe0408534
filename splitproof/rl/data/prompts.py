"""Prompt datasets (verl and TRL row layouts) and the seeded prompt order.

``load_prompts`` reads Parquet / JSON Lines files (or ``builtin://`` tasks), concatenated in the order
given; a row's ``uid`` is its index in that concatenation. The prompt is the column ``prompt_key``:

- a string: tokenized as it is;
- a list of chat messages ``[{"role": ..., "content": ...}, ...]``: rendered with the tokenizer's chat
  template (``add_generation_prompt=True`` plus ``apply_chat_template_kwargs``), then tokenized.

Tokenization never adds special tokens (``add_special_tokens=False``, as verl does). A prompt longer than
``max_prompt_length`` tokens is an error naming the file and row (``truncation="error"``), or keeps its
last (``left``), first (``right``) or first half + last half (``middle``, as verl) tokens. With
``filter_overlong=True`` (verl's ``data.filter_overlong_prompts``) such rows are dropped instead, after
``max_samples`` is applied, as verl does; ``PromptDataset.dropped`` counts them and the uids number the rows
that are kept.

``data_source`` is the row's ``reward_fn_key`` column (verl: ``data.reward_fn_key``, default
``data_source``); a row without one (TRL layout) gets ``""`` and then needs a reward function.
Every column of the row, the prompt included, is kept in ``PromptRecord.columns`` for the reward.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .files import DataError, read_rows

TRUNCATION_MODES = ("error", "left", "right", "middle")

__all__ = [
    "DataError",
    "PromptDataset",
    "PromptRecord",
    "PromptSampler",
    "TRUNCATION_MODES",
    "load_prompts",
    "overlong_notice",
    "prompt_order",
]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt row. ``uid`` is its index in the dataset; ``columns`` holds every column of the row."""

    uid: int
    prompt: str | list[dict]
    prompt_ids: tuple[int, ...]
    data_source: str
    columns: dict = field(repr=False)


class PromptDataset(Sequence):
    """The records of ``load_prompts``, indexed by uid, with where each row came from."""

    def __init__(self, records: list[PromptRecord], origins: list[tuple[str, int]], prompt_key: str, dropped: int = 0):
        self._records = records
        self._origins = origins
        self.prompt_key = prompt_key
        self.dropped = dropped  # over-long rows left out (filter_overlong)

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, uid):
        return self._records[uid]

    def origin(self, uid: int) -> str:
        """``"FILE row R"`` (R counts from 0 within its file) for messages about a record."""
        name, row = self._origins[uid]
        return f"{name} row {row}"

    @property
    def data_sources(self) -> dict[str, int]:
        """Each ``data_source`` and the uid of its first row, in first-appearance order."""
        first: dict[str, int] = {}
        for record in self._records:
            first.setdefault(record.data_source, record.uid)
        return first

    @property
    def column_names(self) -> tuple[str, ...]:
        """Every column name that occurs in some row, in first-appearance order."""
        names: dict[str, None] = {}
        for record in self._records:
            names.update(dict.fromkeys(record.columns))
        return tuple(names)


def _file_list(files) -> list[str]:
    if isinstance(files, (str, os.PathLike)):
        return [os.fspath(files)]
    names = [os.fspath(f) for f in files]
    if not names:
        raise DataError("no prompt files given")
    return names


def _check_options(prompt_key: str, max_prompt_length: int, truncation: str, max_samples: int) -> None:
    if not isinstance(prompt_key, str) or not prompt_key:
        raise DataError(f"prompt_key must be a column name, got {prompt_key!r}")
    if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, int) or max_prompt_length < 1:
        raise DataError(f"max_prompt_length must be a positive integer, got {max_prompt_length!r}")
    if truncation not in TRUNCATION_MODES:
        raise DataError(f"truncation must be one of {', '.join(TRUNCATION_MODES)}, got {truncation!r}")
    if isinstance(max_samples, bool) or not isinstance(max_samples, int) or (max_samples < 1 and max_samples != -1):
        raise DataError(f"max_samples must be -1 (all rows) or a positive integer, got {max_samples!r}")


def _check_messages(messages: list, where: str, prompt_key: str) -> None:
    if not messages:
        raise DataError(f"{where}: {prompt_key!r} is an empty message list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {i} of {prompt_key!r} is {type(message).__name__}, not a dict")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(f"{where}: message {i} of {prompt_key!r} has no 'role' string (got {role!r})")
        if not isinstance(content, str):
            raise DataError(
                f"{where}: message {i} of {prompt_key!r} has no 'content' string (got {type(content).__name__}); "
                "only text messages are supported"
            )
    if not any(m["content"].strip() for m in messages):
        raise DataError(f"{where}: every message of {prompt_key!r} is empty")


def _prompt_text(prompt, tokenizer, where: str, prompt_key: str, template_kwargs: dict) -> str:
    """The text to tokenize: the string itself, or the rendered chat messages."""
    if prompt is None:
        raise DataError(f"{where}: the row has no {prompt_key!r} (missing or null)")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: {prompt_key!r} is empty")
        return prompt
    if not isinstance(prompt, list):
        raise DataError(
            f"{where}: {prompt_key!r} is {type(prompt).__name__}; it must be a string or a list of chat messages"
        )
    _check_messages(prompt, where, prompt_key)
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: {prompt_key!r} is a chat-message list but the tokenizer has no chat template")
    try:
        return tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, **template_kwargs)
    except Exception as err:  # a template may raise anything (jinja errors, raise_exception)
        raise DataError(f"{where}: the chat template failed on {prompt_key!r}: {err}") from None


def truncate(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Keep ``max_length`` tokens: the last (left), the first (right), or both ends (middle)."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise ValueError(f"cannot truncate with mode {mode!r}")


def load_prompts(
    files,
    tokenizer,
    *,
    prompt_key: str = "prompt",
    max_prompt_length: int = 512,
    truncation: str = "error",
    max_samples: int = -1,
    apply_chat_template_kwargs: dict | None = None,
    reward_fn_key: str = "data_source",
    filter_overlong: bool = False,
) -> PromptDataset:
    """Read, check and tokenize every prompt row before any model work (see the module docstring)."""
    _check_options(prompt_key, max_prompt_length, truncation, max_samples)
    template_kwargs = dict(apply_chat_template_kwargs or {})
    rows: list[dict] = []
    origins: list[tuple[str, int]] = []
    for name in _file_list(files):
        file_rows = read_rows(name)
        if file_rows and prompt_key not in file_rows[0]:
            raise DataError(
                f"{name}: no column {prompt_key!r} (data.prompt_key); columns: {', '.join(map(str, file_rows[0]))}"
            )
        rows.extend(file_rows)
        origins.extend((name, r) for r in range(len(file_rows)))
    if max_samples != -1:
        rows, origins = rows[:max_samples], origins[:max_samples]

    texts = []
    for row, (name, r) in zip(rows, origins):
        texts.append(_prompt_text(row.get(prompt_key), tokenizer, f"{name} row {r}", prompt_key, template_kwargs))
    batch = tokenizer(texts, add_special_tokens=False, return_attention_mask=False, return_token_type_ids=False)
    encoded = batch["input_ids"]

    records, kept_origins, dropped = [], [], []
    for row, ids, (name, r) in zip(rows, encoded, origins):
        where = f"{name} row {r}"
        if not ids:
            raise DataError(f"{where}: {prompt_key!r} tokenizes to no tokens")
        if len(ids) > max_prompt_length and filter_overlong:
            dropped.append((len(ids), where))
            continue
        if len(ids) > max_prompt_length and truncation == "error":
            raise DataError(
                f"{where}: the prompt is {len(ids)} tokens, longer than max_prompt_length={max_prompt_length} "
                "(data.truncation=error; raise data.max_prompt_length, set data.truncation to left, right or middle, "
                "or data.filter_overlong_prompts=true to leave such prompts out)"
            )
        source = row.get(reward_fn_key)
        if source is None:
            source = ""
        elif not isinstance(source, str):
            raise DataError(f"{where}: {reward_fn_key!r} must be a string, got {type(source).__name__} {source!r}")
        ids = truncate(list(ids), max_prompt_length, truncation)
        records.append(PromptRecord(len(records), row[prompt_key], tuple(ids), source, row))
        kept_origins.append((name, r))
    if not records:
        longest, where = max(dropped)
        raise DataError(
            f"{', '.join(_file_list(files))}: every prompt is longer than max_prompt_length="
            f"{max_prompt_length} (data.filter_overlong_prompts=true left out {len(dropped)}; the longest: "
            f"{longest} tokens, {where})"
        )
    return PromptDataset(records, kept_origins, prompt_key, dropped=len(dropped))


def overlong_notice(dataset: PromptDataset, files_key: str, max_prompt_length: int) -> str | None:
    """The notice for the rows ``filter_overlong`` left out of ``dataset`` (None when it left out none)."""
    if not dataset.dropped:
        return None
    total = len(dataset) + dataset.dropped
    return (
        f"data.filter_overlong_prompts=true: left out {dataset.dropped} of {total} prompts of {files_key} "
        f"longer than data.max_prompt_length={max_prompt_length} tokens; {len(dataset)} remain"
    )


# ---------------------------------------------------------------------------------------------------------
# Prompt order


def epoch_seed(seed: int, epoch: int) -> int:
    """The torch seed of one epoch's permutation: 63 bits of BLAKE2b of ``"seed:epoch"``."""
    digest = hashlib.blake2b(f"splitproof-prompt-order:{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def prompt_order(num_rows: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """Epoch ``epoch``'s order of the uids 0..num_rows-1: ``torch.randperm`` under ``epoch_seed``, or file order."""
    if not shuffle:
        return list(range(num_rows))
    generator = torch.Generator().manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(num_rows, generator=generator, device="cpu").tolist()  # the host: same on every device


class PromptSampler:
    """Batches of ``batch_size`` uids; each epoch's order depends on (seed, epoch) alone.

    An epoch yields ``num_rows // batch_size`` batches: the incomplete last batch is dropped, as verl's
    training dataloader does (``drop_last=True``). ``state_dict()`` is (epoch, cursor); a sampler loaded
    from it continues with exactly the batches the original would have produced.
    """

    def __init__(self, num_rows: int, batch_size: int, seed: int, shuffle: bool = True):
        for name, value, low in (("num_rows", num_rows, 1), ("batch_size", batch_size, 1), ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"PromptSampler: {name} must be an integer >= {low}, got {value!r}")
        if batch_size > num_rows:
            raise ValueError(
                f"PromptSampler: the dataset has {num_rows} prompts, fewer than one batch of {batch_size} "
                "(data.train_batch_size)"
            )
        self.num_rows, self.batch_size, self.seed, self.shuffle = num_rows, batch_size, seed, bool(shuffle)
        self.epoch, self.cursor = 0, 0
        self._order_epoch, self._order = -1, []

    @property
    def batches_per_epoch(self) -> int:
        return self.num_rows // self.batch_size

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            self._order = prompt_order(self.num_rows, self.seed, self.epoch, self.shuffle)
            self._order_epoch = self.epoch
        return self._order

    def next_batch(self) -> list[int]:
        """The next ``batch_size`` uids (moving to the next epoch when this one has no full batch left)."""
        if self.cursor + self.batch_size > self.num_rows:
            self.epoch, self.cursor = self.epoch + 1, 0
        batch = self._epoch_order()[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_rows": self.num_rows,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; the dataset size, batch size, seed and shuffle must be the same."""
        for key in ("num_rows", "batch_size", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler: the saved {key}={state[key]!r} differs from this run's {getattr(self, key)!r}"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or not 0 <= cursor <= self.batches_per_epoch * self.batch_size or cursor % self.batch_size:
            raise ValueError(f"PromptSampler: invalid saved position epoch={epoch} cursor={cursor}")
        self.epoch, self.cursor = epoch, cursor
