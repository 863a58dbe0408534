"""The update engine: minibatches, microbatches, log-probs and values, accumulation, DP glue.

The public names are imported on first use, so that reading a config (``update_config``) needs no torch.
"""


def __getattr__(name: str):
    if name in ("CriticUpdateConfig", "UpdateConfig"):
        from . import update_config as module
    elif name in ("ValueObjective", "update_critic"):
        from . import critic_update as module
    elif name == "wrap_model":
        from . import distributed as module
    elif name in ("compute_log_probs", "response_log_probs"):
        from . import logprobs as module
    elif name in ("Objective", "StepResult"):
        from . import optimizer_step as module
    elif name in ("PolicyObjective", "update_policy"):
        from . import update as module
    elif name in ("compute_values", "response_values"):
        from . import values as module
    else:
        raise AttributeError(f"module 'splitproof.engine' has no attribute {name!r}")
    return getattr(module, name)


__all__ = [
    "CriticUpdateConfig",
    "Objective",
    "PolicyObjective",
    "StepResult",
    "UpdateConfig",
    "ValueObjective",
    "compute_log_probs",
    "compute_values",
    "response_log_probs",
    "response_values",
    "update_critic",
    "update_policy",
    "wrap_model",
]
