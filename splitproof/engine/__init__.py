"""The update engine: minibatches, microbatches, log-probs, accumulation, DP glue."""

from .config import UpdateConfig
from .distributed import wrap_model
from .logprobs import compute_log_probs, response_log_probs
from .update import StepResult, train_minibatch, update_policy

__all__ = ["StepResult", "UpdateConfig", "compute_log_probs", "response_log_probs", "train_minibatch",
           "update_policy", "wrap_model"]
