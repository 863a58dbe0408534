"""Scoring samples: reward functions in verl's and TRL's conventions (``functions``), the built-in rules
a ``data_source`` selects (``rules``), and KL in the reward (``kl_penalty``: verl's ``kl_ctrl``)."""

from .functions import RewardError, RewardFunction, check_reward_sources, load_reward_function, score

__all__ = ["RewardError", "RewardFunction", "check_reward_sources", "load_reward_function", "score"]
