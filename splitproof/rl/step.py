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
import time
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..advantages import compute_advantage
from ..advantages.estimators import ESTIMATOR_TABLE
from ..batch import RolloutBatch, TokenLayout
from ..engine import compute_log_probs, compute_values
from . import pause
from .config.derive import gen_batch_size
from .data.dynamic_sampling import filtered_batch
from .data.prompts import PromptDataset
from .environments.rewards import score_with_environments
from .models.learner import Learner
from .parallel import gather_rows, run_on_share
from .rewards.dapo import apply_manager
from .rewards.functions import RewardError
from .rewards.kl_penalty import apply_kl_penalty
from .rewards.model_scoring import score_with_model
from .rewards.scored import Rewards, ScoredSamples
from .rewards.token_scores import token_level_scores as scores_on_last_token
from .rollout.assemble import samples_to_tokens
from .rollout.correction import rollout_correction
from .rollout.episode import episode_metrics
from .rollout.vllm_engine import sync_check
from .run import Generation, Parts, Reward, reference_split
from .run import greedy as greedy_params
from .tracking.metrics import StageTimer, data_metrics, reward_extra_metrics, throughput_metrics

BASELINE_STREAM = 2  # remax's greedy baseline (training samples use stream 0, validation 1)
REPEAT_STREAM = 16  # dynamic sampling: the k-th repeat of a prompt within one step draws from stream 16 + k


@dataclass
class StepResult:
    """A step's metrics (verl's names) and its scored samples."""

    metrics: dict[str, float]
    scored: ScoredSamples


def collect_samples(parts: Parts, step: int, uids: list[int] | None, timer: StageTimer, pipeline=None) -> ScoredSamples:
    """``rollout.n`` scored samples of each of ``uids``, generated here or taken from ``pipeline`` (generated
    ahead by the rollout process, from the policy of step - k: rollout/pipeline.py); with
    ``algorithm.filter_groups.enable`` (``uids`` None), the groups dynamic sampling keeps."""
    engine = getattr(parts.generation.engine, "rollout", parts.generation.engine)  # an episode loop's engine
    if pipeline is None and hasattr(engine, "sync_weights"):
        with timer("weight_sync"):  # the updated weights reach a vLLM engine (rollout/vllm_engine.py)
            engine.sync_weights()
    if parts.config.algorithm.filter_groups.enable:
        return dynamic_samples(parts, step, timer)
    pipelined = None
    with timer("gen"):
        if pipeline is None:
            samples = generate(
                parts.generation.engine, parts.prompts.train, uids, step, parts.generation.sampling, parts.collective
            )
        else:
            pipelined = pipeline.take(step)
            samples = pipelined.samples
    with timer("reward"):
        rewards = score_samples(parts.reward, parts.prompts.train, samples, step, parts.collective)
    return ScoredSamples(samples, rewards, list(uids), [s.uid for s in samples], pipelined=pipelined)


def dynamic_samples(parts: Parts, step: int, timer: StageTimer) -> ScoredSamples:
    """Dynamic sampling (``data.dynamic_sampling``): rounds of ``data.gen_batch_size`` prompts, each generated
    and scored here, until ``train_batch_size`` groups are eligible."""
    cfg, fg, rounds = parts.config, parts.config.algorithm.filter_groups, itertools.count(1)

    def generate_scored(uids: list[int], repeats: list[int]):
        with timer("gen"):
            samples = generate_repeats(parts.generation, parts.prompts.train, uids, repeats, step, parts.collective)
        with timer("reward"):
            rewards = score_samples(parts.reward, parts.prompts.train, samples, step, parts.collective)
        pause.pause_point(f"step{step}:round{next(rounds)}")
        return samples, rewards

    return filtered_batch(
        parts.prompts.sampler,
        batch_size=cfg.data.train_batch_size,
        gen_batch_size=gen_batch_size(cfg),
        max_rounds=fg.max_num_gen_batches,
        metric=fg.metric,
        n=parts.generation.sampling.n,
        rows=len(parts.prompts.train),
        generate_scored=generate_scored,
    )


def train_step(parts: Parts, step: int, uids: list[int] | None, pipeline=None) -> StepResult:
    """Run training step ``step`` (1-based, as verl counts) on the prompts ``uids`` (None: dynamic sampling
    draws them); ``pipeline`` (a pipelined run) holds the step's samples and takes the updated weights."""
    cfg, timer, collective = parts.config, StageTimer(), parts.collective
    start = time.perf_counter()

    scored = collect_samples(parts, step, uids, timer, pipeline)
    samples, rewards = scored.samples, scored.rewards
    dtype = parts.float_dtype
    seqs, rollout_log_probs = samples_to_tokens(
        samples, response_width=cfg.data.max_response_length, pad_token_id=parts.pad_token_id, dtype=dtype
    )
    seqs, rollout_log_probs = seqs.to(parts.device), rollout_log_probs.to(parts.device)  # the step's device
    old_log_probs, entropy, ref_log_probs, values = no_grad_passes(parts, seqs, rollout_log_probs, timer)

    with timer("adv"):
        is_weights, corr_metrics = rollout_correction(
            cfg.algorithm.rollout_correction,
            old_log_probs,
            rollout_log_probs if cfg.actor_rollout_ref.rollout.calculate_log_probs else None,
            seqs.response_mask,
        )
        token_level_scores, token_level_rewards, kl_metrics = token_rewards(
            parts, rewards.scores.to(parts.device, dtype), seqs.response_mask, old_log_probs, ref_log_probs
        )
        advantages, returns = compute_advantage(
            cfg.algorithm.adv_estimator,
            token_level_rewards,
            seqs.response_mask,
            scored.group_ids,
            **advantage_inputs(parts, scored, step, values),
        )

    group_ids = torch.tensor(scored.group_ids, dtype=torch.long, device=parts.device)
    batch = update_batch(parts, seqs, old_log_probs, ref_log_probs, advantages, is_weights, group_ids)
    update_metrics = {}
    if parts.critic is not None:
        with timer("update_critic"):
            update_metrics.update(parts.critic.update(replace(batch, values=values, returns=returns), collective))
    if step >= cfg.trainer.critic_warmup:  # verl's rule: the actor waits while the critic warms up
        with timer("update_actor"):
            update_metrics.update(parts.actor.update(batch, collective))
    if pipeline is not None:  # these weights go to the rollout process: they generate batch step + 1 + k
        with timer("weight_sync"):
            pipeline.publish(step)

    metrics = {"training/global_step": float(step), "training/epoch": float(parts.prompts.sampler.epoch)}
    metrics.update(scored.metrics)
    metrics.update(
        data_metrics(
            token_level_scores=token_level_scores,
            token_level_rewards=token_level_rewards,
            advantages=advantages,
            returns=returns,
            response_mask=seqs.response_mask,
            prompt_lengths=seqs.prompt_lengths(),
            max_response_length=cfg.data.max_response_length,
            max_prompt_length=cfg.data.max_prompt_length,
            values=values,
            response_lengths=seqs.response_lengths(),
        )
    )
    metrics.update(episode_metrics(samples))  # multi-turn: turns, tool calls and failures
    metrics.update(update_metrics)
    if scored.pipelined is not None:
        metrics.update(pipeline.metrics(scored.pipelined))
    if entropy is not None:
        metrics["actor/entropy"] = parts.token_aggregate(entropy, seqs.response_mask, group_ids)
    metrics.update(kl_metrics)
    metrics.update(corr_metrics)
    metrics.update(sync_check(cfg, scored.pipelined, rollout_log_probs, old_log_probs, seqs.response_mask))
    metrics.update(reward_extra_metrics(rewards.extra))
    metrics.update(rewards.stats)
    metrics.update(timer.metrics())
    seconds = time.perf_counter() - start
    metrics["timing_s/step"] = seconds
    metrics.update(throughput_metrics(int(seqs.attention_mask.sum()), seconds, collective.world_size))
    return StepResult(metrics, scored)


def token_rewards(parts: Parts, scores: Tensor, response_mask: Tensor, old_log_probs: Tensor, ref_log_probs):
    """verl's ``token_level_scores`` (each score on its last response token) and ``token_level_rewards`` (the
    scores less the KL penalty with ``algorithm.use_kl_in_reward``, else the scores), with the KL metrics."""
    cfg = parts.config
    token_level_scores = scores_on_last_token(scores, response_mask)
    if not cfg.algorithm.use_kl_in_reward:
        return token_level_scores, token_level_scores, {}
    token_level_rewards, kl_metrics = apply_kl_penalty(
        token_level_scores,
        old_log_probs,
        ref_log_probs,
        response_mask,
        parts.kl_ctrl,
        kl_penalty=cfg.algorithm.kl_penalty,
    )
    return token_level_scores, token_level_rewards, kl_metrics


def update_batch(
    parts: Parts, seqs: TokenLayout, old_log_probs, ref_log_probs, advantages, is_weights, group_ids: Tensor
) -> RolloutBatch:
    """The batch the critic and actor updates train on; the reference log-probs only with ``use_kl_loss``."""
    return RolloutBatch(
        prompts=seqs.prompts,
        responses=seqs.responses,
        attention_mask=seqs.attention_mask,
        response_mask=seqs.response_mask,
        old_log_probs=old_log_probs,
        advantages=advantages,
        ref_log_probs=ref_log_probs if parts.config.actor_rollout_ref.actor.use_kl_loss else None,
        rollout_is_weights=is_weights,
        index=group_ids.to(seqs.prompts.device),
    )


def no_grad_passes(parts: Parts, tokens: TokenLayout, rollout_log_probs: Tensor, timer: StageTimer):
    """The step's no-grad passes over ``tokens``: the old log-probs and entropy (the rollout's log-probs in
    verl's bypass mode), the reference policy's log-probs and the critic's values (None when not needed)."""
    cfg, collective, dtype = parts.config, parts.collective, parts.float_dtype
    temperature, packed = cfg.actor_rollout_ref.rollout.temperature, parts.actor.update_config.use_remove_padding
    if cfg.algorithm.rollout_correction.bypass_mode:  # verl's bypass mode: no recompute
        old_log_probs, entropy = rollout_log_probs, None
    else:
        with timer("old_log_prob"):
            old_log_probs, entropy = no_grad_log_probs(
                parts.actor.for_inference(),
                tokens,
                parts.actor.no_grad_split,
                collective,
                temperature=temperature,
                packed=packed,
                dtype=dtype,
                with_entropy=True,
                prefix_grouper=parts.actor.update_config.use_prefix_grouper,
            )
    ref_log_probs = None
    if parts.reference_policy is not None:
        with timer("ref"), parts.reference_policy.model() as ref:
            ref_log_probs, _ = no_grad_log_probs(
                ref,
                tokens,
                reference_split(cfg),
                collective,
                temperature=temperature,
                packed=packed,
                dtype=dtype,
                prefix_grouper=parts.actor.update_config.use_prefix_grouper,
            )
    values = None
    if parts.critic is not None:
        with timer("values"):
            values = critic_values(parts.critic, tokens, collective, dtype)
    return old_log_probs, entropy, ref_log_probs, values


def advantage_inputs(parts: Parts, scored: ScoredSamples, step: int, values: Tensor | None) -> dict:
    """The estimator's options under verl's names (``advantage_options``), and the inputs the step supplies:
    `remax` scores a greedy baseline of every prompt, `gae` reads the critic's values."""
    estimator = parts.config.algorithm.adv_estimator
    options = advantage_options(parts.config)
    if estimator == "remax":
        generation = parts.generation
        greedy = generate(
            generation.engine,
            parts.prompts.train,
            scored.uids,
            step,
            greedy_params(generation.sampling),
            parts.collective,
            stream=BASELINE_STREAM,
        )
        baseline = score_samples(parts.reward, parts.prompts.train, greedy, step, parts.collective).scores
        by_uid = {s.uid: float(b) for s, b in zip(greedy, baseline)}
        options["reward_baselines"] = torch.tensor(
            [by_uid[s.uid] for s in scored.samples], dtype=parts.float_dtype, device=parts.device
        )
    if estimator == "gae":
        options["values"] = values
    return options


def advantage_options(cfg) -> dict:
    """The ``algorithm.*`` options the estimator reads (``advantages.ESTIMATOR_TABLE``), by verl's names."""
    algo = cfg.algorithm
    return {name: getattr(algo, name) for name in ESTIMATOR_TABLE[algo.adv_estimator].config_keys}


def generate_repeats(
    generation: Generation, dataset: PromptDataset, uids: list[int], repeats: list[int], step: int, collective
) -> list:
    """Training samples of ``uids`` in canonical order, the k-th repeat of a prompt within a step drawn from
    sampling stream ``REPEAT_STREAM + k`` (k = 0: the training stream 0), so that it differs from the
    first and depends on (step, uid, k) alone."""
    params = generation.sampling
    n, by_candidate = params.n, {}
    for k in sorted(set(repeats)):
        chosen = [i for i, r in enumerate(repeats) if r == k]
        samples = generate(
            generation.engine,
            dataset,
            [uids[i] for i in chosen],
            step,
            params,
            collective,
            stream=REPEAT_STREAM + k if k else 0,
        )
        by_candidate.update({i: samples[c * n : (c + 1) * n] for c, i in enumerate(chosen)})
    return [s for i in range(len(uids)) for s in by_candidate[i]]


def generate(
    engine, dataset: PromptDataset, uids: list[int], step: int, params, collective, *, stream: int = 0
) -> list:
    """``params.n`` samples of every prompt ``dataset[uid]``, in canonical order (prompt order × sample
    index), drawn from sampling stream ``stream``; each rank generates a share of them and every rank
    gets them all."""
    requests = [(uid, j, list(dataset[uid].prompt_ids)) for uid in uids for j in range(params.n)]
    if getattr(engine, "takes_records", False):  # environments reset from each request's row
        return run_on_share(
            collective,
            len(requests),
            lambda rows: engine.generate(
                [requests[r] for r in rows],
                params,
                step=step,
                stream=stream,
                records=[dataset[requests[r][0]] for r in rows],
            ),
        )
    return run_on_share(
        collective,
        len(requests),
        lambda rows: engine.generate([requests[r] for r in rows], params, step=step, stream=stream),
    )


def score_samples(reward: Reward, dataset: PromptDataset, samples: list, step: int, collective) -> Rewards:
    """Every sample's score (float64 [B]) and the reward function's extra values ``{key: [B values]}``,
    NaN where a sample has no number for the key, under the reward manager; each rank scores a share,
    and the keys are gathered over the whole batch (so a key that only another rank's share returned is
    NaN here, not missing). A reward function that fails on any rank stops the step on every rank,
    before anything is updated."""

    def work(rows):
        part = [samples[r] for r in rows]
        records, stats = [dataset[s.uid] for s in part], {}
        if reward.model is None:
            own = dict(environment_only=reward.environment_only, pass_instances=reward.environment_instances)
            result = score_with_environments(
                reward.fn, records, part, reward.tokenizer, step=step, max_steps=reward.total_steps, **own
            )
        else:  # a reward model (rewards/model_scoring.py)
            scored = score_with_model(
                reward.model,
                reward.fn,
                records,
                part,
                reward.tokenizer,
                step=step,
                max_steps=reward.total_steps,
                rule_metric=reward.rule_metric,
            )
            result, stats = scored.result, scored.stats
        rewards = Rewards(result.scores, result.extra, stats)
        return [apply_manager(reward.manager, rewards, [len(s.response_ids) for s in part])]

    return Rewards.concat(run_on_share(collective, len(samples), work, errors=(RewardError,)))


def no_grad_log_probs(
    model,
    tokens: TokenLayout,
    split: dict,
    collective,
    *,
    temperature: float,
    packed: bool,
    dtype: torch.dtype,
    with_entropy: bool = False,
    prefix_grouper: bool = False,
):
    """No-grad log-probs [B, T] (and entropy) of every row; each rank computes a share. ``split`` holds the
    pass's micro-batching (``micro_batch_size`` or ``max_token_len``), which never changes the values;
    ``prefix_grouper``: each distinct prompt computed once (``engine.shared_prefix``)."""

    def compute(part):
        logp, entropy = compute_log_probs(
            model,
            part,
            **split_kwargs(split, part),
            with_entropy=with_entropy,
            temperature=temperature,
            packed=packed,
            prefix_grouper=prefix_grouper,
        )
        return [logp, entropy] if with_entropy else [logp]

    stacked = no_grad_rows(model, tokens, compute, collective, channels=2 if with_entropy else 1, dtype=dtype)
    return stacked[:, 0], (stacked[:, 1] if with_entropy else None)


def critic_values(critic: Learner, tokens: TokenLayout, collective, dtype: torch.dtype) -> Tensor:
    """The critic's no-grad values [B, T] of every row (the state before each response token); each rank
    computes a share, split by ``critic.forward_*`` (which never changes them)."""
    model = critic.for_inference()

    def compute(part):
        return [
            compute_values(
                model, part, **split_kwargs(critic.no_grad_split, part), packed=critic.update_config.use_remove_padding
            )
        ]

    return no_grad_rows(model, tokens, compute, collective, channels=1, dtype=dtype)[:, 0]


def split_kwargs(split: dict, part: TokenLayout) -> dict:
    """``micro_batch_size`` / ``max_token_len`` of a no-grad pass over ``part`` (null: the whole share)."""
    if split.get("max_token_len"):
        return {"micro_batch_size": None, "max_token_len": split["max_token_len"]}
    return {"micro_batch_size": split.get("micro_batch_size") or len(part), "max_token_len": None}


def no_grad_rows(model, tokens: TokenLayout, compute, collective, *, channels: int, dtype: torch.dtype) -> Tensor:
    """``compute(part)`` -> ``channels`` tensors [rows, T] on this rank's share of the rows, with ``model`` in
    eval mode; gathered on every rank as [B, channels, T] in row order."""
    was_training = model.training
    model.eval()

    def work(rows):
        if not len(rows):
            return torch.zeros(0, channels, tokens.response_width, dtype=dtype, device=tokens.responses.device)
        return torch.stack([p.to(dtype) for p in compute(tokens.select(list(rows)))], dim=1)

    try:
        return gather_rows(collective, len(tokens), work)
    finally:
        model.train(was_training)
