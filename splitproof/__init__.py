"""splitproof: RL policy updates for language models that are a function of the optimizer minibatch alone.

Micro-batch size, token budgets, data-parallel size and sequence order change how an update is computed,
never what it is.
"""

from .mkl_mode import request_strict_mode

request_strict_mode()  # before MKL's first product (splitproof.mkl_mode)

__version__ = "0.1.0"


def __getattr__(name: str):
    """The public names, imported on first use (``splitproof train --print-config`` needs no torch) and then
    bound here."""
    if name in ("BatchError", "RolloutBatch"):
        from .batch import BatchError, RolloutBatch

        found = {"BatchError": BatchError, "RolloutBatch": RolloutBatch}
    elif name in ("ConfigError", "LossConfig", "ValueLossConfig"):
        from .loss_config import ConfigError, LossConfig, ValueLossConfig

        found = {"ConfigError": ConfigError, "LossConfig": LossConfig, "ValueLossConfig": ValueLossConfig}
    elif name in ("correction_share", "minibatch_share", "objective"):
        from .policy_objective import correction_share, minibatch_share, objective

        found = {"correction_share": correction_share, "minibatch_share": minibatch_share, "objective": objective}
    elif name == "MinibatchStats":
        from .stats import MinibatchStats

        found = {"MinibatchStats": MinibatchStats}
    else:
        raise AttributeError(f"module 'splitproof' has no attribute {name!r}")
    globals().update(found)
    return found[name]


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
