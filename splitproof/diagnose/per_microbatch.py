"""Other frameworks' per-microbatch behaviour, as objectives of the engine's optimizer step (the legacy columns).

The engine's own objectives (:class:`~splitproof.engine.update.PolicyObjective`,
:class:`~splitproof.engine.critic_update.ValueObjective`) weight every microbatch by the statistics of the whole
minibatch and select KL-Cov/Clip-Cov tokens over it. The diagnosis compares them with what a framework that
works microbatch by microbatch computes:

- ``statistics_scope="microbatch"``: every statistic (N, G, n_g) is the microbatch's own, and KL-Cov/Clip-Cov
  select within the microbatch (verl 24f25b03 for geo_mean, kl_cov and clip_cov; any local-fallback
  aggregation). For the critic, each microbatch's share is also divided by the DP size D, as verl before its
  PR #6957 averaged the ranks' gradients: the sum of K local means instead of one mean over the minibatch.
- ``cov_strategy="microbatch"``: only the KL-Cov/Clip-Cov selection is per microbatch (its quota and means
  the microbatch's own); the weights stay the minibatch's.

Each class takes the arguments of the engine's ``make_objective``; :func:`per_microbatch` builds one for
``update_policy`` / ``update_critic``. Not split-invariant, by design.
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.collective import LOCAL
from splitproof.engine.critic_update import ValueObjective
from splitproof.engine.optimizer_step import Part, group_ids
from splitproof.engine.plan import MinibatchPlan
from splitproof.engine.update import PolicyObjective, policy_log_probs
from splitproof.engine.update_config import COV_STRATEGIES as ENGINE_COV_STRATEGIES
from splitproof.engine.update_config import CriticUpdateConfig, UpdateConfig
from splitproof.engine.values import response_values
from splitproof.loss_config import ConfigError, LossConfig
from splitproof.policy_objective import metric_names, minibatch_share, policy_inputs
from splitproof.selection import select_tokens
from splitproof.stats import MinibatchStats
from splitproof.value_objective import value_share

STATISTICS_SCOPES = ("minibatch", "microbatch")
COV_STRATEGIES = (*ENGINE_COV_STRATEGIES, "microbatch")  # the engine's, and the per-microbatch selection
SELECTION_WARNING = (
    "cov_strategy 'microbatch' selects tokens per microbatch: the update then depends on the split "
    "(kept for the diagnosis's comparison only)"
)


def check_scope(statistics_scope: str, cov_strategy: str = "auto") -> None:
    """A ConfigError naming the setting for an unknown statistics scope or Cov strategy."""
    for name, value, known in (
        ("statistics_scope", statistics_scope, STATISTICS_SCOPES),
        ("cov_strategy", cov_strategy, COV_STRATEGIES),
    ):
        if value not in known:
            raise ConfigError(name, f"unknown {value!r}; expected one of {', '.join(known)}")


def is_per_microbatch(statistics_scope: str, cov_strategy: str) -> bool:
    return statistics_scope == "microbatch" or cov_strategy == "microbatch"


class LocalPolicyObjective:
    """The policy's loss microbatch by microbatch: KL-Cov/Clip-Cov select within each microbatch, and with
    ``local_statistics`` every weight uses the microbatch's own statistics (an all-padding microbatch then
    adds nothing)."""

    grad_norm_metric = "grad_norm"
    skipped_metric = "step_skipped"
    syncs_in_loop = True

    def __init__(
        self,
        config: UpdateConfig,
        batch: RolloutBatch,
        plan: MinibatchPlan,
        collective,
        step: int,
        *,
        local_statistics: bool,
    ):
        self.config, self.loss, self.step = config, config.loss, step
        self.local_statistics = local_statistics
        self.with_entropy = config.loss.entropy_coeff != 0
        self.group_index = group_ids(batch, config.loss.loss_agg_mode)
        self.selection = torch.zeros_like(batch.response_mask) if config.loss.is_cov else None
        if config.loss.is_cov and not local_statistics:
            warnings.warn(SELECTION_WARNING, stacklevel=3)

    def begin(self, model: nn.Module, stats: MinibatchStats) -> str | None:
        return "microbatch" if self.loss.is_cov else None

    def before(self, model: nn.Module) -> None:
        pass

    def share(self, model: nn.Module, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        sub = part.batch
        index = group_ids(sub, self.loss.loss_agg_mode)
        log_prob, entropy = policy_log_probs(model, sub, self.config, self.with_entropy)
        selection = None
        if self.loss.is_cov:
            selection = local_selection(sub, log_prob, self.loss, self.step)
            if part.live:
                self.selection[part.rows] = selection
        if self.local_statistics:
            stats = MinibatchStats.of(sub.response_mask, index=index)
            if stats.num_tokens == 0:  # an all-padding microbatch: nothing to add
                return (log_prob * 0).sum(), {}
        return minibatch_share(
            log_prob,
            sub.old_log_probs,
            sub.advantages,
            sub.response_mask,
            self.loss,
            stats,
            ref_log_prob=sub.ref_log_probs,
            rollout_is_weights=sub.rollout_is_weights,
            entropy=entropy,
            selection=selection,
            index=index,
        )

    def after(self, model: nn.Module, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        pass

    def metric_names(self) -> list[str]:
        return metric_names(self.loss, self.with_entropy)


def local_selection(part: RolloutBatch, log_prob: Tensor, config: LossConfig, step: int) -> Tensor:
    """Per-microbatch selection (other frameworks' behaviour): the microbatch's own means and quota."""
    if not part.response_mask.any():
        return torch.zeros_like(part.response_mask)
    x = policy_inputs(log_prob.detach(), part.old_log_probs, part.advantages, part.response_mask)
    return select_tokens(x, config, part.seq_ids, step=step, collective=LOCAL)


class LocalValueObjective(ValueObjective):
    """The critic's value loss with each microbatch normalised by its own N, G and divided by the DP size D
    (verl before its PR #6957)."""

    def __init__(self, config: CriticUpdateConfig, batch: RolloutBatch, plan: MinibatchPlan, collective, step: int):
        super().__init__(config, batch, plan, collective, step)
        self.scale = 1.0 / collective.world_size

    def share(self, model: nn.Module, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        sub = part.batch
        index = group_ids(sub, self.loss.loss_agg_mode)
        vpreds = response_values(model, sub, packed=self.config.use_remove_padding)
        stats = MinibatchStats.of(sub.response_mask, index=index)
        if stats.num_tokens == 0:  # a microbatch with no valid token: nothing to add
            return (vpreds * 0).sum(), {}
        loss, metrics = value_share(vpreds, sub.values, sub.returns, sub.response_mask, self.loss, stats, index=index)
        return loss * self.scale, {name: value * self.scale for name, value in metrics.items()}


def per_microbatch(*, value: bool = False, statistics_scope: str = "microbatch", cov_strategy: str = "auto"):
    """The ``make_objective`` of ``update_policy`` (``update_critic`` with ``value``) for these settings: the
    engine's own objective when neither is per microbatch."""
    check_scope(statistics_scope, cov_strategy)
    if value:
        return LocalValueObjective if statistics_scope == "microbatch" else ValueObjective
    if not is_per_microbatch(statistics_scope, cov_strategy):
        return PolicyObjective
    return partial(LocalPolicyObjective, local_statistics=statistics_scope == "microbatch")
