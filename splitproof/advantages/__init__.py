"""Advantage estimators with verl 0.9.1's names, options and numbers, as pure functions of a rollout batch.

``compute_advantage(estimator, token_level_rewards, response_mask, index, **options) -> (advantages,
returns)``. They run on the whole rollout batch, before it is split into minibatches and microbatches,
and their statistics do not depend on the order of the rows. docs/advantages.md states every formula.
"""

from .errors import AdvantageError, AdvantageOptionError, GroupsRequiredError, UnknownEstimatorError
from .estimators import (
    ESTIMATORS,
    NEEDS_GROUPS,
    OPTIONS,
    check_samples_per_prompt,
    compute_advantage,
    estimator_spec,
    requires_groups,
)

__all__ = [
    "ESTIMATORS",
    "NEEDS_GROUPS",
    "OPTIONS",
    "AdvantageError",
    "AdvantageOptionError",
    "GroupsRequiredError",
    "UnknownEstimatorError",
    "check_samples_per_prompt",
    "compute_advantage",
    "estimator_spec",
    "requires_groups",
]
