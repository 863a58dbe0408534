"""Held-out evaluation: the validation prompts, generated with ``rollout.val_kwargs``, scored.

Reported per data source as verl does (``tracking.held_out``): ``val-core/<data_source>/<var>/mean@<n>``,
the mean over the source's prompts and their n samples of ``acc`` when the reward reports it, else of the
reward (rows without a data source under ``unknown``, as verl names them); with n > 1 also ``best@k``, ``worst@k``,
``maj@k`` (with a numeric ``pred``), ``pass@k`` and
``std@n``, and every extra value under ``val-aux/``. Validation draws from its own sampling stream, so it
never changes what training samples.
"""

from __future__ import annotations

from .parallel import first_rank_only
from .run import Parts
from .step import generate, score_samples
from .tracking.generations import generation_rows, write_generations
from .tracking.held_out import validation_metrics

VALIDATION_STREAM = 1


def evaluate_held_out(parts: Parts, step: int) -> dict[str, float]:
    """The validation prompts' metrics after step ``step`` (empty without validation data)."""
    data = parts.prompts.val
    if data is None or len(data) == 0:
        return {}
    uids = list(range(len(data)))
    samples = generate(
        parts.generation.engine,
        data,
        uids,
        step,
        parts.generation.val_sampling,
        parts.collective,
        stream=VALIDATION_STREAM,
    )
    rewards = score_samples(parts.reward, data, samples, step, parts.collective)
    scores = rewards.scores.tolist()
    folder = parts.config.trainer.validation_data_dir
    if folder and first_rank_only(parts.collective):
        write_generations(folder, step, generation_rows(parts.tokenizer, data, samples, scores, rewards.extra, step))
    return validation_metrics(
        [data[s.uid].data_source for s in samples], [s.uid for s in samples], scores, rewards.extra
    )
