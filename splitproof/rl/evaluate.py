"""Held-out evaluation: the validation prompts, generated with ``rollout.val_kwargs``, scored.

Reported per data source as verl does (``tracking.held_out``): ``val-core/<data_source>/<var>/mean@<n>``,
the mean over the source's prompts and their n samples of ``acc`` when the reward reports it, else of the
reward (rows without a data source under ``unknown``, as verl names them); with n > 1 also ``best@k``, ``worst@k``, ``maj@k`` (with a numeric ``pred``), ``pass@k`` and
``std@n``, and every extra value under ``val-aux/``. Validation draws from its own sampling stream, so it
never changes what training samples.
"""

from __future__ import annotations

from .run import Run
from .step import generate, score_samples
from .parallel import first_rank_only
from .tracking.generations import generation_rows, write_generations
from .tracking.held_out import validation_metrics

VALIDATION_STREAM = 1


def validate(run: Run, step: int) -> dict[str, float]:
    if run.val_data is None or len(run.val_data) == 0:
        return {}
    uids = list(range(len(run.val_data)))
    samples = generate(run, uids, step, run.val_sampling, stream=VALIDATION_STREAM)
    scores, extra = score_samples(run, samples, step, stream=VALIDATION_STREAM)
    folder = run.config.trainer.validation_data_dir
    if folder and first_rank_only(run.collective):
        write_generations(folder, step, generation_rows(run.tokenizer, run.val_data, samples, scores.tolist(), extra,
                                                        step))
    return validation_metrics([run.val_data[s.uid].data_source for s in samples], [s.uid for s in samples],
                              scores.tolist(), extra)
