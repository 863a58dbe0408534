"""Policy losses (docs/semantics.md, "Policy losses"): pure functions of per-token inputs and the config.

Each loss maps ``PolicyInputs`` to ``LossTerms`` — a per-token loss ``[B, T]`` (or, for GMPO, a
per-sequence loss ``[B]``) plus per-token metric indicators. None of them sees minibatch statistics or
knows how the minibatch was split: the objective weights their output (``splitproof.aggregation``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..loss_config import LossConfig
from .common import LossTerms, PolicyInputs
from .cov import clip_cov, clip_cov_correction, kl_cov, kl_cov_correction
from .gmpo import geo_mean
from .kl import kl_estimate
from .ppo import cispo, gspo, sapo, vanilla
from .reinforce import dro, gpg
from .trust_region import dppo_kl, dppo_tv

PolicyLoss = Callable[[PolicyInputs, LossConfig], LossTerms]

POLICY_LOSSES: dict[str, PolicyLoss] = {
    "vanilla": vanilla,
    "gspo": gspo,
    "geo_mean": geo_mean,
    "sapo": sapo,
    "gpg": gpg,
    "cispo": cispo,
    "dro": dro,
    "dppo_tv": dppo_tv,
    "dppo_kl": dppo_kl,
    "clip_cov": clip_cov,
    "kl_cov": kl_cov,
}

# The per-token loss a Cov selection adds on top of the base loss (the `deferred` strategy's correction).
COV_CORRECTIONS: dict[str, Callable] = {"kl_cov": kl_cov_correction, "clip_cov": clip_cov_correction}

__all__ = ["POLICY_LOSSES", "COV_CORRECTIONS", "LossTerms", "PolicyInputs", "kl_estimate"]
