"""splitproof: RL policy updates for language models that are a function of the optimizer minibatch alone.

Micro-batch size, token budgets, data-parallel size and sequence order change how an update is computed,
never what it is.
"""

import sys
import types

__version__ = "0.1.0"


def __getattr__(name: str):
    """The public names, imported on first use (``splitproof train --print-config`` needs no torch) and then
    bound here: ``splitproof.objective`` is the function, not its module."""
    if name in ("BatchError", "RolloutBatch"):
        from .batch import BatchError, RolloutBatch
        found = {"BatchError": BatchError, "RolloutBatch": RolloutBatch}
    elif name in ("ConfigError", "LossConfig", "ValueLossConfig"):
        from .loss_config import ConfigError, LossConfig, ValueLossConfig
        found = {"ConfigError": ConfigError, "LossConfig": LossConfig, "ValueLossConfig": ValueLossConfig}
    elif name in ("correction_share", "minibatch_share"):
        from .objective import correction_share, minibatch_share
        found = {"correction_share": correction_share, "minibatch_share": minibatch_share}
    elif name == "MinibatchStats":
        from .stats import MinibatchStats
        found = {"MinibatchStats": MinibatchStats}
    else:
        raise AttributeError(f"module 'splitproof' has no attribute {name!r}")
    globals().update(found)
    return found[name]


class _Package(types.ModuleType):
    """``splitproof.objective`` is the function ``objective.objective``, imported on first use. Importing
    the submodule ``splitproof.objective`` (as the engine does) binds it on the package; the setter keeps
    that from replacing the function."""

    @property
    def objective(self):
        from .objective import objective

        return objective

    @objective.setter
    def objective(self, submodule) -> None:
        pass


sys.modules[__name__].__class__ = _Package

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
