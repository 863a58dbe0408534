"""The update engine: minibatches, microbatches, log-probs and values, accumulation, DP glue."""

from .update_config import CriticUpdateConfig, UpdateConfig
from .critic_update import train_critic_minibatch, update_critic
from .distributed import wrap_model
from .logprobs import compute_log_probs, response_log_probs
from .optimizer_step import StepResult
from .update import train_minibatch, update_policy
from .values import compute_values, response_values

__all__ = ["CriticUpdateConfig", "StepResult", "UpdateConfig", "compute_log_probs", "compute_values",
           "response_log_probs", "response_values", "train_critic_minibatch", "train_minibatch", "update_critic",
           "update_policy", "wrap_model"]
