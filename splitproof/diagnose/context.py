"""What a scenario runs on: the model, the rollout batch, and the independent float64 reference objective.

The model is the embedded tiny random Llama (no download) or a local Hugging Face checkpoint; it runs in
eval mode so that two runs see the same deterministic forward. The reference objective is
:func:`splitproof.reference.reference_objective` — a separate, plain float64 implementation — on the
log-probs of a float64 copy of the model before the update (the baseline's pre-update log-probs).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.config import LossConfig
from splitproof.engine import compute_log_probs
from splitproof.models import load_causal_lm, tiny_causal_lm
from splitproof.reference import reference_objective

from .synthetic import synthetic_rollout

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


class ModelError(ValueError):
    """The model cannot be built or loaded (one-line message)."""


@dataclass(frozen=True)
class ModelSpec:
    path: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    trust_remote_code: bool = False
    arch: str = "llama"

    def describe(self) -> str:
        what = self.path if self.path else f"embedded tiny random {self.arch} (seed {self.seed})"
        return f"{what}, {self.dtype}, {self.device}"


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ModelError(f"--device: unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ModelError(f"--device {device}: only cpu and cuda are supported")


def build_model(spec: ModelSpec) -> nn.Module:
    dtype = DTYPES[spec.dtype]
    if spec.path:
        if not os.path.exists(spec.path):
            raise ModelError(f"--model {spec.path}: no such file or directory (only local checkpoints are loaded)")
        try:
            model = load_causal_lm(spec.path, dtype=dtype, device=spec.device, trust_remote_code=spec.trust_remote_code)
        except Exception as exc:  # a broken or unsupported checkpoint is a user error
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ModelError(f"--model {spec.path}: cannot load a causal LM: {first}") from None
    else:
        model = tiny_causal_lm(spec.arch, dtype=dtype, seed=spec.seed).to(spec.device)
    model.eval()  # no dropout: runs must be comparable
    for p in model.parameters():
        p.requires_grad_(True)
    return model


@dataclass(frozen=True)
class BatchSpec:
    sequences: int
    prompt_length: int
    response_length: int
    full_length: bool = False
    with_is_weights: bool = False
    seed: int = 1


@dataclass
class Context:
    """One model and one rollout batch, and the pre-update log-probs the reference objective needs.

    The model is the runs' template: it is never changed, so its parameters are the "before" of every
    update. The log-probs are computed when the context is made, before any run holds memory (a float32
    model needs a float64 copy for them, twice its size, for that moment only).
    """

    model: nn.Module
    batch: RolloutBatch
    spec: BatchSpec
    _log_probs: tuple[Tensor, Tensor] | None = None
    _references: dict = field(default_factory=dict)

    @classmethod
    def create(cls, model: nn.Module, spec: BatchSpec) -> "Context":
        batch = synthetic_rollout(model, spec.sequences, spec.prompt_length, spec.response_length, seed=spec.seed,
                                  full_length=spec.full_length, with_is_weights=spec.with_is_weights)
        if _param_dtype(model) in (torch.bfloat16, torch.float16):
            # per-token inputs in float32, as rollout buffers keep them (the log-probs come out in float32)
            for name in ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights"):
                value = getattr(batch, name)
                if value is not None:
                    setattr(batch, name, value.float())
        context = cls(model, batch, spec)
        context._cached_log_probs()
        return context

    @property
    def valid_tokens(self) -> int:
        return int(self.batch.response_mask.sum())

    def _log_probs_of(self, model: nn.Module) -> tuple[Tensor, Tensor]:
        logp, entropy = compute_log_probs(model, self.batch, micro_batch_size=len(self.batch), with_entropy=True)
        return logp.double(), entropy.double()

    def _cached_log_probs(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """(float64 copy's log-probs and entropy, the run dtype's), before the update, one microbatch."""
        if self._log_probs is None:
            run = self._log_probs_of(self.model)
            if _param_dtype(self.model) == torch.float64:
                exact = run
            else:
                model64 = copy.deepcopy(self.model).double()
                exact = self._log_probs_of(model64)
                del model64
            self._log_probs = (exact, run)
        return self._log_probs

    def _reference_at(self, loss: LossConfig, logp: Tensor, entropy: Tensor) -> Tensor:
        b = self.batch

        def f64(x):
            return None if x is None else x.double()

        total, _ = reference_objective(
            logp, f64(b.old_log_probs), f64(b.advantages), b.response_mask, loss,
            ref_log_prob=f64(b.ref_log_probs) if loss.use_kl_loss else None,
            rollout_is_weights=f64(b.rollout_is_weights),
            entropy=entropy if loss.entropy_coeff != 0 else None, seq_ids=b.seq_ids, index=b.index, step=0)
        return total

    def reference(self, loss: LossConfig) -> ReferenceObjective:
        """J(ℬ) from the independent float64 reference on the float64 pre-update log-probs, with the two
        figures its precision floor is made of (:func:`compare.objective_tolerance`):

        - ``rounding`` = |J_ref(run-dtype log-probs) − J_ref(float64 log-probs)|, measured;
        - ``scale`` = |J| + Σ|∂J/∂log π|·(1 + |log π|) + Σ|∂J/∂H|·(1 + |H|) over valid tokens (the size of
          the terms that are summed).
        """
        if loss not in self._references:
            (lp64, h64), (lp_run, h_run) = self._cached_log_probs()
            lp = lp64.clone().requires_grad_(True)
            h = h64.clone().requires_grad_(True)
            exact = self._reference_at(loss, lp, h)
            mask = self.batch.response_mask.bool()
            grads = torch.autograd.grad(exact, [lp, h], allow_unused=True)
            scale = abs(float(exact.detach()))
            for g, x in zip(grads, (lp64, h64)):
                if g is not None:
                    scale += float((g.abs() * (1 + x.abs()))[mask].sum())
            with torch.no_grad():
                run = self._reference_at(loss, lp_run, h_run)
            value = float(exact.detach())
            self._references[loss] = ReferenceObjective(value, abs(float(run) - value), scale)
        return self._references[loss]


@dataclass(frozen=True)
class ReferenceObjective:
    """The float64 reference objective of a loss on a context, and what its precision floor is made of."""

    value: float
    rounding: float  # |J_ref(run-dtype log-probs) − J_ref(float64 log-probs)|
    scale: float  # |J| + Σ|∂J/∂x|·(1 + |x|) over the per-token inputs x (log-probs, entropy)


def _param_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
