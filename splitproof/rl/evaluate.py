"""Held-out evaluation: the validation prompts, generated with ``rollout.val_kwargs``, scored.

Reported per data source as verl does: ``val-core/<data_source>/reward/mean@<n>``, the mean score over
the source's prompts and their n samples (rows without a data source under ``unknown``, as verl names
them). Validation draws from its own sampling stream, so it never changes what training samples.
"""

from __future__ import annotations

from collections import defaultdict

from .run import Run
from .step import generate, score_samples

VALIDATION_STREAM = 1
UNKNOWN_SOURCE = "unknown"  # verl's data source for rows without one


def validate(run: Run, step: int) -> dict[str, float]:
    if run.val_data is None or len(run.val_data) == 0:
        return {}
    uids = list(range(len(run.val_data)))
    samples = generate(run, uids, step, run.val_sampling, stream=VALIDATION_STREAM)
    scores, _ = score_samples(run, samples, step, stream=VALIDATION_STREAM)
    sources = [run.val_data[sample.uid].data_source for sample in samples]
    return held_out_metrics(sources, scores.tolist(), run.val_sampling.n)


def held_out_metrics(sources: list[str], scores: list[float], n: int) -> dict[str, float]:
    """``val-core/<data_source>/reward/mean@<n>``: the mean score per data source; a row without one counts
    as ``unknown``, verl's name for it."""
    by_source: dict[str, list[float]] = defaultdict(list)
    for source, value in zip(sources, scores):
        by_source[source or UNKNOWN_SOURCE].append(value)
    return {f"val-core/{source}/reward/mean@{n}": sum(values) / len(values)
            for source, values in sorted(by_source.items())}
