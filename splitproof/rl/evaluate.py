"""Held-out evaluation: the validation prompts, generated with ``rollout.val_kwargs``, scored.

Reported per data source as verl does: ``val-core/<data_source>/reward/mean@<n>``, the mean score over
the source's prompts and their n samples. Validation draws from its own sampling stream, so it never
changes what training samples.
"""

from __future__ import annotations

from collections import defaultdict

from .run import Run
from .step import generate, score_samples

VALIDATION_STREAM = 1


def validate(run: Run, step: int) -> dict[str, float]:
    if run.val_data is None or len(run.val_data) == 0:
        return {}
    uids = list(range(len(run.val_data)))
    samples = generate(run, uids, step, run.val_sampling, stream=VALIDATION_STREAM)
    scores, _ = score_samples(run, samples, step, stream=VALIDATION_STREAM)
    by_source: dict[str, list[float]] = defaultdict(list)
    for sample, value in zip(samples, scores.tolist()):
        by_source[run.val_data[sample.uid].data_source].append(value)
    n = run.val_sampling.n
    return {f"val-core/{source}/reward/mean@{n}": sum(values) / len(values)
            for source, values in sorted(by_source.items())}
