"""One RL training step, top to bottom.

    prompts → generate n samples each → score → old (and ref) log-probs → critic values (PPO) →
    advantages → critic update (PPO) → policy update (from step max(1, trainer.critic_warmup) on)

Every stage is a function of (seed, step, data, config): sampling draws from counter-based streams
keyed by (seed, step, uid, sample index); rewards and log-probs are per sequence; advantages are
computed on the whole rollout batch; the engine's update depends on the minibatch alone. Generation
batch size, log-prob and update micro-batching, token budgets, packing and the data-parallel size
change how the step is computed, never its result.

Pipelined (``async_training.staleness_steps`` = k > 0): the samples were generated ahead by the rollout
process from the policy of step s − k (``rollout/pipeline.py``), and the weights after this step's update
are handed to it at once, for batch s + 1 + k; everything between is this same step.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from ..advantages import compute_advantage
from ..batch import RolloutBatch
from ..engine import compute_log_probs, compute_values, update_policy
from .rollout.assemble import SequenceTensors, pad_samples
from .models.critic import train_critic
from .rewards.kl_penalty import apply_kl_penalty
from .tracking.metrics import (StageTimer, actor_metrics, data_metrics, reward_extra_metrics,
                               throughput_metrics)
from .parallel import gather_rows, run_on_share
from .rewards.functions import RewardError, score, token_level_scores as scores_on_last_token
from .rollout.correction import rollout_correction
from .rollout.episode import episode_metrics
from . import pause
from .config.check import gen_batch_size
from .data.dynamic_sampling import filtered_batch
from .rewards.dapo import apply_manager
from .run import Run, greedy as greedy_params

BASELINE_STREAM = 2  # remax's greedy baseline (training samples use stream 0, validation 1)
REPEAT_STREAM = 16  # dynamic sampling: the k-th repeat of a prompt within one step draws from stream 16 + k


@dataclass
class StepOutput:
    """A step's metrics (verl's names) and its rollouts, in canonical order."""

    metrics: dict[str, float]
    samples: list
    consumed: list[int] | None = None  # the prompts the step consumed, in order (dynamic sampling)
    scores: list[float] | None = None  # each sample's reward (the reward manager's)
    extra: dict | None = None  # the reward function's extra values, one per sample


@dataclass
class Rollout:
    """A step's scored samples in canonical order, each sample's group id, the step's prompts, and
    (dynamic sampling) the prompts it consumed and its ``train/`` and ``training/filter_groups/`` metrics."""

    samples: list
    scores: Tensor
    extra: dict[str, list[float]]
    uids: list[int]
    group_ids: list[int]
    consumed: list[int] | None = None
    metrics: dict = field(default_factory=dict)
    pipelined: object = None  # the pipeline's batch (async_training.staleness_steps > 0)


def rollout_groups(run: Run, step: int, uids: list[int] | None, timer: StageTimer) -> Rollout:
    """``rollout.n`` scored samples of each of ``uids``; with ``algorithm.filter_groups.enable`` (``uids``
    None), the groups dynamic sampling keeps (``data.dynamic_sampling``)."""
    if not run.config.algorithm.filter_groups.enable:
        pipelined = None
        with timer("gen"):
            if run.pipeline is None:
                samples = generate(run, uids, step, run.sampling)
            else:  # generated ahead by the rollout process, from the policy of step - k (rollout/pipeline.py)
                pipelined = run.pipeline.take(step)
                samples = pipelined.samples
        with timer("reward"):
            scores, extra = score_samples(run, samples, step)
        return Rollout(samples, scores, extra, list(uids), [s.uid for s in samples], pipelined=pipelined)
    return filtered_rollout(run, step, timer)


def filtered_rollout(run: Run, step: int, timer: StageTimer) -> Rollout:
    """Dynamic sampling (``data.dynamic_sampling``): rounds of ``data.gen_batch_size`` prompts, each generated
    and scored here, until ``train_batch_size`` groups are eligible."""
    cfg, fg, rounds = run.config, run.config.algorithm.filter_groups, itertools.count(1)

    def generate_scored(uids: list[int], repeats: list[int]):
        with timer("gen"):
            samples = generate_repeats(run, uids, repeats, step)
        with timer("reward"):
            scores, extra = score_samples(run, samples, step)
        pause.pause_point(f"step{step}:round{next(rounds)}")
        return samples, scores, extra

    kept = filtered_batch(run.sampler, batch_size=cfg.data.train_batch_size, gen_batch_size=gen_batch_size(cfg),
                          max_rounds=fg.max_num_gen_batches, metric=fg.metric, n=run.sampling.n,
                          rows=len(run.train_data), generate_scored=generate_scored)
    return Rollout(kept.samples, kept.scores, kept.extra, kept.uids, kept.group_ids, kept.consumed, kept.metrics)


def train_step(run: Run, step: int, uids: list[int]) -> StepOutput:
    """Run training step ``step`` (1-based, as verl counts) on the prompts ``uids``."""
    cfg, timer = run.config, StageTimer()
    start = time.perf_counter()

    rollout = rollout_groups(run, step, uids, timer)
    samples, scores, reward_extra, uids = rollout.samples, rollout.scores, rollout.extra, rollout.uids
    pipelined = rollout.pipelined
    seqs = pad_samples(samples, response_width=cfg.data.max_response_length, pad_token_id=run.pad_token_id,
                       dtype=run.float_dtype)

    if cfg.algorithm.rollout_correction.bypass_mode:  # verl's bypass mode: no recompute
        old_log_probs, entropy = seqs.rollout_log_probs, None
    else:
        with timer("old_log_prob"):
            old_log_probs, entropy = no_grad_log_probs(run, run.policy_for_inference(), seqs, run.old_log_prob_split,
                                                       with_entropy=True)
    ref_log_probs = None
    if run.needs_reference:
        with timer("ref"), run.reference() as ref:
            ref_log_probs, _ = no_grad_log_probs(run, ref, seqs, run.ref_log_prob_split)
    values = None
    if run.critic is not None:
        with timer("values"):
            values = critic_values(run, seqs)

    with timer("adv"):
        is_weights, corr_metrics = rollout_correction(
            cfg.algorithm.rollout_correction, old_log_probs,
            seqs.rollout_log_probs if cfg.actor_rollout_ref.rollout.calculate_log_probs else None, seqs.response_mask)
        token_level_scores = scores_on_last_token(scores.to(run.float_dtype), seqs.response_mask)
        token_level_rewards, kl_metrics = token_level_scores, {}
        if cfg.algorithm.use_kl_in_reward:
            token_level_rewards, kl_metrics = apply_kl_penalty(
                token_level_scores, old_log_probs, ref_log_probs, seqs.response_mask, run.kl_ctrl,
                kl_penalty=cfg.algorithm.kl_penalty)
        index = rollout.group_ids
        advantages, returns = compute_advantage(
            cfg.algorithm.adv_estimator, token_level_rewards, seqs.response_mask, index,
            **advantage_options(run, samples, uids, step, values))

    group_ids = torch.tensor(index, dtype=torch.long)
    batch = RolloutBatch(prompts=seqs.prompts, responses=seqs.responses, attention_mask=seqs.attention_mask,
                         response_mask=seqs.response_mask, old_log_probs=old_log_probs, advantages=advantages,
                         ref_log_probs=ref_log_probs if cfg.actor_rollout_ref.actor.use_kl_loss else None,
                         rollout_is_weights=is_weights, index=group_ids.to(seqs.prompts.device))
    update_metrics = {}
    if run.critic is not None:
        with timer("update_critic"):
            update_metrics.update(train_critic(run.critic, replace(batch, values=values, returns=returns),
                                               collective=run.collective))
    if step >= cfg.trainer.critic_warmup:  # verl's rule: the actor waits while the critic warms up
        with timer("update_actor"):
            update_metrics.update(update_actor(run, batch))
    if run.pipeline is not None:  # these weights go to the rollout process: they generate batch step + 1 + k
        with timer("weight_sync"):
            run.pipeline.publish(step)

    metrics = {"training/global_step": float(step), "training/epoch": float(run.sampler.epoch), **rollout.metrics}
    metrics.update(data_metrics(
        token_level_scores=token_level_scores, token_level_rewards=token_level_rewards, advantages=advantages,
        returns=returns, response_mask=seqs.response_mask, prompt_lengths=seqs.prompt_lengths,
        max_response_length=cfg.data.max_response_length, max_prompt_length=cfg.data.max_prompt_length,
        values=values, response_lengths=seqs.response_token_counts))
    metrics.update(episode_metrics(samples))  # multi-turn: turns, tool calls and failures
    metrics.update(update_metrics)
    if pipelined is not None:
        metrics.update(run.pipeline.metrics(pipelined))
    if entropy is not None:
        metrics["actor/entropy"] = run.token_aggregate(entropy, seqs.response_mask, group_ids)
    metrics.update(kl_metrics)
    metrics.update(corr_metrics)
    metrics.update(reward_extra_metrics(reward_extra))
    metrics.update(timer.metrics())
    seconds = time.perf_counter() - start
    metrics["timing_s/step"] = seconds
    metrics.update(throughput_metrics(int(seqs.attention_mask.sum()), seconds, run.collective.world_size))
    return StepOutput(metrics, samples, rollout.consumed, scores.tolist(), reward_extra)


def update_actor(run: Run, batch: RolloutBatch) -> dict[str, float]:
    """Every policy optimizer step over ``batch``, then one step of the LR schedule; ``actor/*`` metrics
    (``actor/lr``: the rate these steps used)."""
    run.policy.train()
    results = update_policy(run.policy, run.optimizer, batch, run.update_config, collective=run.collective,
                            step=run.optimizer_steps)
    run.optimizer_steps += len(results)
    lr = run.optimizer.param_groups[0]["lr"]
    run.scheduler.step()
    run.after_update()
    return {**actor_metrics(r.metrics for r in results), "actor/lr": lr}


def advantage_options(run: Run, samples: list, uids: list[int], step: int, values: Tensor | None) -> dict:
    """The estimator's options under verl's names; `remax` scores a greedy baseline of every prompt, `gae`
    reads the critic's values."""
    algo = run.config.algorithm
    estimator = algo.adv_estimator
    if estimator == "grpo":
        return {"norm_adv_by_std_in_grpo": algo.norm_adv_by_std_in_grpo}
    if estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        return {"gamma": algo.gamma}
    if estimator == "remax":
        greedy = generate(run, uids, step, greedy_params(run.sampling), stream=BASELINE_STREAM)
        baseline, _ = score_samples(run, greedy, step)
        by_uid = {s.uid: float(b) for s, b in zip(greedy, baseline)}
        return {"reward_baselines": torch.tensor([by_uid[s.uid] for s in samples], dtype=run.float_dtype)}
    if estimator == "gae":
        return {"gamma": algo.gamma, "lam": algo.lam, "values": values}
    return {}


def generate_repeats(run: Run, uids: list[int], repeats: list[int], step: int) -> list:
    """Training samples of ``uids`` in canonical order, the k-th repeat of a prompt within a step drawn from
    sampling stream ``REPEAT_STREAM + k`` (k = 0: the training stream 0), so that it differs from the
    first and depends on (step, uid, k) alone."""
    n, by_candidate = run.sampling.n, {}
    for k in sorted(set(repeats)):
        chosen = [i for i, r in enumerate(repeats) if r == k]
        samples = generate(run, [uids[i] for i in chosen], step, run.sampling, stream=REPEAT_STREAM + k if k else 0)
        by_candidate.update({i: samples[c * n:(c + 1) * n] for c, i in enumerate(chosen)})
    return [s for i in range(len(uids)) for s in by_candidate[i]]


def generate(run: Run, uids: list[int], step: int, params, *, stream: int = 0) -> list:
    """``params.n`` samples of every prompt, in canonical order (prompt order × sample index); each rank
    generates a share of them and every rank gets them all."""
    requests = [(uid, j, list(run.dataset_for(stream)[uid].prompt_ids)) for uid in uids for j in range(params.n)]
    return run_on_share(run.collective, len(requests),
                        lambda rows: run.rollout.generate([requests[r] for r in rows], params, step=step,
                                                          stream=stream))


def score_samples(run: Run, samples: list, step: int, *, stream: int = 0) -> tuple[torch.Tensor, dict]:
    """Every sample's score (float64 [B]) and the reward function's extra values ``{key: [B values]}``,
    NaN where a sample has no number for the key; each rank scores a share, and the keys are gathered
    over the whole batch (so a key that only another rank's share returned is NaN here, not missing).
    A reward function that fails on any rank stops the step on every rank, before anything is updated."""
    dataset = run.dataset_for(stream)

    def work(rows):
        part = [samples[r] for r in rows]
        result = score(run.reward_fn, [dataset[s.uid] for s in part], part, run.tokenizer, step=step,
                       max_steps=run.total_steps)
        values = result.scores.tolist()  # one conversion, not one tensor index per sample
        extras = [{name: extra[k] for name, extra in result.extra.items() if not math.isnan(extra[k])}
                  for k in range(len(part))]
        values, extras = apply_manager(run.reward_manager, values, extras, [len(s.response_ids) for s in part])
        return list(zip(values, extras))

    scored = run_on_share(run.collective, len(samples), work, errors=(RewardError,))
    scores = torch.tensor([value for value, _ in scored], dtype=torch.float64)
    names = dict.fromkeys(name for _, values in scored for name in values)
    extra = {name: [values.get(name, math.nan) for _, values in scored] for name in names}
    return scores, extra


def no_grad_log_probs(run: Run, model, seqs: SequenceTensors, split: dict, *, with_entropy: bool = False):
    """No-grad log-probs [B, T] (and entropy) of every row; each rank computes a share. ``split`` holds the
    pass's micro-batching (``micro_batch_size`` or ``max_token_len``), which never changes the values."""
    def compute(part):
        logp, entropy = compute_log_probs(model, part, **_split_kwargs(split, part), with_entropy=with_entropy,
                                          temperature=run.config.actor_rollout_ref.rollout.temperature,
                                          packed=run.update_config.use_remove_padding)
        return [logp, entropy] if with_entropy else [logp]

    stacked = _no_grad_rows(run, model, seqs, compute, channels=2 if with_entropy else 1)
    return stacked[:, 0], (stacked[:, 1] if with_entropy else None)


def critic_values(run: Run, seqs: SequenceTensors) -> Tensor:
    """The critic's no-grad values [B, T] of every row (the state before each response token); each rank
    computes a share, split by ``critic.forward_*`` (which never changes them)."""
    critic = run.critic
    model = critic.for_inference()

    def compute(part):
        return [compute_values(model, part, **_split_kwargs(critic.forward_split, part),
                               packed=critic.update_config.use_remove_padding)]

    return _no_grad_rows(run, model, seqs, compute, channels=1)[:, 0]


def _split_kwargs(split: dict, part: RolloutBatch) -> dict:
    """``micro_batch_size`` / ``max_token_len`` of a no-grad pass over ``part`` (null: the whole share)."""
    if split.get("max_token_len"):
        return {"micro_batch_size": None, "max_token_len": split["max_token_len"]}
    return {"micro_batch_size": split.get("micro_batch_size") or len(part), "max_token_len": None}


def _no_grad_rows(run: Run, model, seqs: SequenceTensors, compute, *, channels: int) -> Tensor:
    """``compute(part)`` -> ``channels`` tensors [rows, T] on this rank's share of the rows, with ``model`` in
    eval mode; gathered on every rank as [B, channels, T] in row order."""
    batch = RolloutBatch(prompts=seqs.prompts, responses=seqs.responses, attention_mask=seqs.attention_mask,
                         response_mask=seqs.response_mask, old_log_probs=seqs.rollout_log_probs,
                         advantages=torch.zeros(len(seqs.prompts), dtype=run.float_dtype))
    was_training = model.training
    model.eval()

    def work(rows):
        if not len(rows):
            return torch.zeros(0, channels, seqs.responses.shape[1], dtype=run.float_dtype)
        return torch.stack([p.to(run.float_dtype) for p in compute(batch.select(list(rows)))], dim=1)

    try:
        return gather_rows(run.collective, len(batch), work)
    finally:
        model.train(was_training)
