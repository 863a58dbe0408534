"""Generating samples: the counter-based sampler (``sampling``), the ``hf`` backend (``hf``), samples laid
out as the engine's padded tensors (``assemble``), and the correction weights for the mismatch between
the rollout policy and the policy that recomputes the old log-probs (``correction``)."""

from .assemble import samples_to_tokens
from .hf import HFRollout, RolloutError, Sample, SamplingParams, requests_for, samples_to_batch

__all__ = [
    "HFRollout",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "requests_for",
    "samples_to_batch",
    "samples_to_tokens",
]
