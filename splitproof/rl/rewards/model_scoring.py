"""Scoring with a reward model, combined with the reward function as verl combines them.

- No reward function named: the reward is the reward model's score (verl's reward loop with a
  discriminative model). When every row has a built-in rule and a ground truth, the rule's score is
  reported beside it as ``acc`` (with the rule's ``pred``), so the held-out ``val-core`` metric and
  ``reward/acc/mean`` are rule-scored while training follows the model: reward hacking shows as the two
  parting.
- A reward function named: the function decides (verl: "only the user-defined reward function will be
  used"), and it receives each sample's reward-model score as the keyword ``rm_score`` (a list, one per
  completion, for a TRL-style function) to combine as it likes, e.g. ``rule + 0.5 * rm_score``.

Either way the model's score is the extra value ``rm_score`` (``reward/rm_score/mean``), and the seconds
spent in the model are ``timing_s/reward_model``.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass

import torch

from .functions import RewardError, RewardFunction, RewardResult, response_text, score
from .judge import Judge, JudgeCall
from .remote_judge import RemoteJudge
from .reward_model import RewardModel

RM_KEYWORD = "rm_score"
JUDGE_KEYWORD = "judge"  # a reward function that takes it gets each sample's judge (judge.JudgeCall)
JUDGES = (Judge, RemoteJudge)


@dataclass(frozen=True)
class ModelScored:
    """A share's reward result and its stats (``timing_s/reward_model``; a judge's ``judge/*`` counts)."""

    result: RewardResult
    stats: dict[str, float]


def takes_keyword(fn, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return any(p.kind is inspect.Parameter.VAR_KEYWORD or (p.name == name and p.kind in kinds) for p in params)


def check_function_takes_score(reward_fn: RewardFunction | None) -> None:
    """A named reward function beside a reward model must take ``rm_score``, else the model would be unused."""
    if reward_fn is not None and not takes_keyword(reward_fn.fn, RM_KEYWORD):
        raise RewardError(
            f"reward function {reward_fn.name}: a reward model is enabled and the named function decides the "
            f"reward (as in verl), but it does not take {RM_KEYWORD}; add the parameter (or **kwargs) to combine "
            "the model's score, or name no function to train on the model's score"
        )


def model_scores(model, records, samples, texts, step: int) -> tuple[list[float], dict[str, float]]:
    """The reward model's or the judge's score of each sample, and its stats (seconds; a judge's parse
    failures)."""
    start = time.perf_counter()
    stats: dict[str, float] = {}
    if isinstance(model, JUDGES):
        verdicts = model.score(records, samples, texts, step=step) if samples else []
        values = [v.score for v in verdicts]
        stats["judge/parse_failures"] = float(sum(not v.parsed for v in verdicts))
        stats["judge/calls"] = float(len(verdicts))
    else:
        values = model.score(records, samples, texts).tolist() if samples else []
    stats["timing_s/reward_model"] = time.perf_counter() - start
    return values, stats


def score_with_model(
    model: RewardModel | Judge | RemoteJudge,
    reward_fn: RewardFunction | None,
    records,
    samples,
    tokenizer,
    *,
    step: int,
    max_steps: int,
    rule_metric: bool,
) -> ModelScored:
    """The samples' rewards under the reward model or judge (see the module docstring for how it combines)."""
    by_uid = {record.uid: record for record in records}
    rows = [by_uid[s.uid] for s in samples]
    texts = [response_text(tokenizer, s) for s in samples]
    rm_list, stats = model_scores(model, rows, samples, texts, step)
    if reward_fn is not None:
        more = [{RM_KEYWORD: v} for v in rm_list]
        if isinstance(model, JUDGES) and takes_keyword(reward_fn.fn, JUDGE_KEYWORD):
            for extra, sample in zip(more, samples):
                extra[JUDGE_KEYWORD] = JudgeCall(model, step, sample.uid, sample.sample_index)
        result = score(reward_fn, records, samples, tokenizer, step=step, max_steps=max_steps, sample_kwargs=more)
        return ModelScored(RewardResult(result.scores, {**result.extra, RM_KEYWORD: rm_list}, texts), stats)
    extra: dict[str, list[float]] = {RM_KEYWORD: rm_list}
    if rule_metric:
        rule = score(None, records, samples, tokenizer, step=step, max_steps=max_steps)
        extra = {"acc": rule.scores.tolist(), **rule.extra, RM_KEYWORD: rm_list}
    return ModelScored(RewardResult(torch.tensor(rm_list, dtype=torch.float64), extra, texts), stats)
