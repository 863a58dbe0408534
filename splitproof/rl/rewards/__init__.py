"""Scoring samples: reward functions in verl's and TRL's conventions (``functions``), the built-in rules
a ``data_source`` selects (``rules``), the reward managers ``naive`` and ``dapo`` (``dapo``), the filter
metric of dynamic sampling (``filter_metric``), and KL in the reward (``kl_penalty``: verl's ``kl_ctrl``).

The names below come from ``functions`` on first use, so that the config check (which reads ``dapo``)
loads no torch."""

__all__ = ["RewardError", "RewardFunction", "check_reward_sources", "load_reward_function", "score"]


def __getattr__(name: str):
    if name in __all__:
        from . import functions

        return getattr(functions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
