"""What a scenario runs on: the model, the rollout batch, and the independent float64 reference objective.

The model is the embedded tiny random Llama (no download) or a local Hugging Face checkpoint; it runs in
eval mode so that two runs see the same deterministic forward. The reference objective is
:func:`splitproof.oracle.oracle_objective` — a separate, plain float64 implementation — on the
log-probs of a float64 copy of the model before the update (the baseline's pre-update log-probs).
Value-loss scenarios update a critic — the model's body with a value head drawn from the seed
(:mod:`splitproof.value_model`) — and their reference is
:func:`splitproof.oracle.oracle_value_objective` on a float64 copy's value predictions.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.engine import compute_log_probs, compute_values
from splitproof.hf_models import load_causal_lm, tiny_causal_lm
from splitproof.loss_config import LossConfig, ValueLossConfig
from splitproof.oracle import oracle_objective, oracle_value_objective

from .synthetic import synthetic_rollout, with_critic_targets

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
    lora_rank: int = 0  # > 0: a LoRA adapter of this rank (all-linear, drawn from the seed) is what trains

    def describe(self) -> str:
        what = self.path if self.path else f"embedded tiny random {self.arch} (seed {self.seed})"
        lora = f", LoRA rank {self.lora_rank}" if self.lora_rank else ""
        return f"{what}, {self.dtype}, {self.device}{lora}"


def check_device(device: str) -> None:
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ModelError(f"--device: unknown device {device!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ModelError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
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
    return with_lora(model, spec) if spec.lora_rank else model


def with_lora(model: nn.Module, spec: ModelSpec) -> nn.Module:
    """``model`` with a LoRA adapter of rank ``spec.lora_rank`` drawn from ``spec.seed``: only the adapter trains."""
    from splitproof.lora import LoraSettings, apply_lora

    try:
        return apply_lora(model, LoraSettings(lora_rank=spec.lora_rank), seed=spec.seed)
    except ImportError as exc:
        raise ModelError(f"--lora-rank: {exc}") from None


def build_critic(model: nn.Module, seed: int) -> nn.Module:
    """The critic of the value-loss scenarios: ``model``'s body with a value head drawn from ``seed``."""
    from splitproof.value_model import value_model_from_pretrained

    critic = value_model_from_pretrained(model, seed=seed, device=next(model.parameters()).device)
    critic.eval()  # no dropout: runs must be comparable
    for p in critic.parameters():
        p.requires_grad_(True)
    return critic


@dataclass(frozen=True)
class BatchSpec:
    sequences: int
    prompt_length: int
    response_length: int
    full_length: bool = False
    with_is_weights: bool = False
    seed: int = 1
    with_values: bool = False  # the critic's values and returns (value-loss scenarios)


@dataclass
class Context:
    """One model and one rollout batch, and the pre-update per-token outputs the reference objective needs.

    The model (and, for value-loss scenarios, the critic built from it) is the runs' template: it is never
    changed, so its parameters are the "before" of every update. The log-probs (values) are computed when
    the context is made, before any run holds memory (a float32 model needs a float64 copy for them, twice
    its size, for that moment only).
    """

    model: nn.Module
    batch: RolloutBatch
    spec: BatchSpec
    critic: nn.Module | None = None
    _log_probs: tuple[Tensor, Tensor] | None = None
    _values: tuple[Tensor, Tensor] | None = None
    _references: dict = field(default_factory=dict)

    @classmethod
    def create(cls, model: nn.Module, spec: BatchSpec, critic: nn.Module | None = None) -> Context:
        batch = synthetic_rollout(
            model,
            spec.sequences,
            spec.prompt_length,
            spec.response_length,
            seed=spec.seed,
            full_length=spec.full_length,
            with_is_weights=spec.with_is_weights,
        )
        if _param_dtype(model) in (torch.bfloat16, torch.float16):
            # per-token inputs in float32, as rollout buffers keep them (the log-probs come out in float32)
            for name in ("old_log_probs", "advantages", "ref_log_probs", "rollout_is_weights"):
                value = getattr(batch, name)
                if value is not None:
                    setattr(batch, name, value.float())
        if spec.with_values:
            if critic is None:
                raise ValueError("a batch with values needs the critic that predicts them")
            with_critic_targets(batch, critic, seed=spec.seed)
        context = cls(model, batch, spec, critic if spec.with_values else None)
        context._cached_log_probs()
        if context.critic is not None:
            context._cached_values()
        return context

    @property
    def valid_tokens(self) -> int:
        return int(self.batch.response_mask.sum())

    def _log_probs_of(self, model: nn.Module) -> tuple[Tensor, Tensor]:
        logp, entropy = compute_log_probs(model, self.batch, micro_batch_size=len(self.batch), with_entropy=True)
        return logp.double(), entropy.double()

    def _values_of(self, critic: nn.Module) -> tuple[Tensor]:
        return (compute_values(critic, self.batch, micro_batch_size=len(self.batch)).double(),)

    def _exact_and_run(self, model: nn.Module, outputs_of) -> tuple[tuple, tuple]:
        """(a float64 copy's outputs, the run dtype's), before the update, one microbatch."""
        run = outputs_of(model)
        if _param_dtype(model) == torch.float64:
            return run, run
        model64 = copy.deepcopy(model).double()
        exact = outputs_of(model64)
        del model64
        return exact, run

    def _cached_log_probs(self) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
        """(float64 copy's log-probs and entropy, the run dtype's), before the update, one microbatch."""
        if self._log_probs is None:
            self._log_probs = self._exact_and_run(self.model, self._log_probs_of)
        return self._log_probs

    def _cached_values(self) -> tuple[tuple[Tensor], tuple[Tensor]]:
        """(float64 copy's value predictions, the run dtype's), before the update, one microbatch."""
        if self._values is None:
            self._values = self._exact_and_run(self.critic, self._values_of)
        return self._values

    def _reference_at(self, loss: LossConfig, logp: Tensor, entropy: Tensor) -> Tensor:
        b = self.batch

        def f64(x):
            return None if x is None else x.double()

        total, _ = oracle_objective(
            logp,
            f64(b.old_log_probs),
            f64(b.advantages),
            b.response_mask,
            loss,
            ref_log_prob=f64(b.ref_log_probs) if loss.use_kl_loss else None,
            rollout_is_weights=f64(b.rollout_is_weights),
            entropy=entropy if loss.entropy_coeff != 0 else None,
            seq_ids=b.seq_ids,
            index=b.index,
            step=0,
        )
        return total

    def _value_reference_at(self, loss: ValueLossConfig, vpreds: Tensor) -> Tensor:
        b = self.batch
        total, _ = oracle_value_objective(
            vpreds,
            b.values.double(),
            b.returns.double(),
            b.response_mask,
            cliprange_value=loss.cliprange_value,
            loss_agg_mode=loss.loss_agg_mode,
            loss_scale_factor=loss.loss_scale_factor,
        )
        return total

    def reference(self, loss: LossConfig | ValueLossConfig) -> ReferenceObjective:
        """J(ℬ) from the independent float64 reference on the float64 pre-update log-probs (a value loss: on
        the float64 value predictions), with the two figures its precision floor is made of
        (:func:`compare.objective_tolerance`):

        - ``rounding`` = |J_ref(run-dtype inputs) − J_ref(float64 inputs)|, measured;
        - ``scale`` = |J| + Σ|∂J/∂x|·(1 + |x|) over the valid tokens of every per-token input x (log π and
          H, or the value predictions): the size of the terms that are summed.
        """
        if loss not in self._references:
            if isinstance(loss, ValueLossConfig):
                inputs, at = self._cached_values(), lambda v: self._value_reference_at(loss, v)
            else:
                inputs, at = self._cached_log_probs(), lambda lp, h: self._reference_at(loss, lp, h)
            self._references[loss] = self._measure(inputs, at)
        return self._references[loss]

    def _measure(self, inputs: tuple[tuple, tuple], at) -> ReferenceObjective:
        exact_inputs, run_inputs = inputs
        leaves = [x.clone().requires_grad_(True) for x in exact_inputs]
        exact = at(*leaves)
        mask = self.batch.response_mask.bool()
        grads = torch.autograd.grad(exact, leaves, allow_unused=True)
        scale = abs(float(exact.detach()))
        for g, x in zip(grads, exact_inputs):
            if g is not None:
                scale += float((g.abs() * (1 + x.abs()))[mask].sum())
        with torch.no_grad():
            run = at(*run_inputs)
        value = float(exact.detach())
        return ReferenceObjective(value, abs(float(run) - value), scale)


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
