"""Generations on disk, as verl writes them (``trainer.rollout_data_dir``, ``trainer.validation_data_dir``).

One file per step, ``<dir>/<step>.jsonl``, one JSON object per sample in canonical order (prompt order ×
sample index) with verl's fields: ``input`` (the prompt text), ``output`` (the response text, special
tokens skipped), ``gts`` (the row's ground truth), ``score`` (the reward the step trained on: the reward
manager's, before any KL in the reward), ``step``, and each extra value of the reward function (e.g.
``acc``, ``overlong_reward``). The file is written whole and renamed into place, so a killed run leaves
either the complete file or none, and a resumed run rewrites the same bytes.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from ..rewards.functions import ground_truth_of


def generation_rows(
    tokenizer, dataset, samples, scores: list[float], extra: dict[str, list[float]], step: int
) -> list[dict]:
    rows = []
    for i, sample in enumerate(samples):
        record = dataset[sample.uid]
        row = {
            "input": tokenizer.decode(list(sample.prompt_ids), skip_special_tokens=True),
            "output": tokenizer.decode(list(sample.response_ids), skip_special_tokens=True),
            "gts": ground_truth_of(record.columns),
            "score": scores[i],
            "step": step,
        }
        for name, values in extra.items():
            if name not in row and not math.isnan(values[i]):
                row[name] = values[i]
        rows.append(row)
    return rows


def write_generations(folder: str | os.PathLike, step: int, rows: list[dict]) -> Path:
    """``folder/<step>.jsonl`` with ``rows``, atomically."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{step}.jsonl"
    tmp = folder / f".{step}.jsonl.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
    os.replace(tmp, path)
    return path
