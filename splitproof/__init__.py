"""splitproof: RL policy updates for language models that are a function of the optimizer minibatch alone.

Micro-batch size, token budgets, data-parallel size and sequence order change how an update is computed,
never what it is.
"""

from .batch import BatchError, RolloutBatch
from .loss_config import ConfigError, LossConfig, ValueLossConfig
from .objective import correction_share, minibatch_share, objective
from .stats import MinibatchStats

__version__ = "0.1.0"

__all__ = [
    "BatchError",
    "ConfigError",
    "LossConfig",
    "MinibatchStats",
    "RolloutBatch",
    "ValueLossConfig",
    "correction_share",
    "minibatch_share",
    "objective",
]
