"""An environment's ``get_reward()`` in a sample's score: added to the reward function's score (weight 1, as
TRL sums its reward sources), or the whole score when the environment owns the reward alone (no reward
function named and no built-in rule for the rows). Reported under the environment's class name
(``reward/<Name>/mean``), NaN for samples of other environments; a verifiers rubric's functions (an
episode's ``metrics``) as ``reward/vf/<function>/mean``. A TRL-convention reward function that takes
``environments`` gets each episode's instance, as TRL passes them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..rewards.functions import RewardResult, response_text, score


def score_with_environments(
    reward_fn,
    records,
    samples: Sequence,
    tokenizer,
    *,
    step: int,
    max_steps: int,
    environment_only: bool = False,
    pass_instances: bool = False,
) -> RewardResult:
    """``score`` (unless ``environment_only``) plus each episode's ``environment_reward``; with
    ``pass_instances`` a TRL-convention function also gets ``environments=``, each episode's instance."""
    if environment_only:
        texts = [response_text(tokenizer, s) for s in samples]
        result = RewardResult(torch.zeros(len(samples), dtype=torch.float64), {}, texts)
    else:
        more = [{"environments": getattr(s, "environment_instance", None)} for s in samples] if pass_instances else None
        result = score(reward_fn, records, samples, tokenizer, step=step, max_steps=max_steps, sample_kwargs=more)
    rewards = [getattr(s, "environment_reward", None) for s in samples]
    if all(r is None for r in rewards):
        return result
    added = torch.tensor([0.0 if r is None else r for r in rewards], dtype=torch.float64)
    extra = dict(result.extra)
    for label in dict.fromkeys(s.environment for s, r in zip(samples, rewards) if r is not None):
        extra[label] = [r if s.environment == label and r is not None else math.nan for s, r in zip(samples, rewards)]
    names = dict.fromkeys(name for s in samples for name in getattr(s, "metrics", {}))
    for name in names:  # a verifiers rubric's functions, each under its own name
        label = next(s.environment for s in samples if name in getattr(s, "metrics", {}))
        extra[f"{label}/{name}"] = [getattr(s, "metrics", {}).get(name, math.nan) for s in samples]
    return RewardResult(result.scores + added, extra, result.responses)
