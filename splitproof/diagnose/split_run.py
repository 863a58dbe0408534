"""Run one policy update for one split and keep what the diagnosis compares.

A run copies the template model, builds a fresh optimizer, and drives the engine's own optimizer step
(:func:`splitproof.engine.optimizer_step.optimizer_step`) with the split's microbatch plan and the engine's
objective (or a legacy one, :mod:`.per_microbatch`) — the call ``update_policy`` (``update_critic``) makes per
minibatch. It reads the accumulated gradient (before clipping) and the engine's selection through
:class:`~.watched.Watched`, and the parameters after the step; it keeps the engine's metrics and, for
KL-Cov / Clip-Cov, the canonical keys (sequence id, position) of the tokens the engine selected.

Memory: the baseline run writes its gradient and its parameters after the step, parameter by parameter,
to two flat vectors in a :class:`~.store.FlatStore` (a temporary file on disk); every other run is
compared with them chunk by chunk as it finishes, and keeps only the figures. A run holds one copy of the
model, its gradients and the optimizer's state. ``dp:D`` runs happen inside
:func:`splitproof.engine.launch.run_data_parallel` workers, forked from the process that holds the
template, and read the same file.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.collective import default_collective
from splitproof.engine import CriticUpdateConfig, UpdateConfig, wrap_model
from splitproof.engine.launch import release_free_memory
from splitproof.engine.optimizer_step import optimizer_step
from splitproof.hf_models import unwrap, vocab_size_of
from splitproof.loss_config import LossConfig, ValueLossConfig

from .baseline_store import FlatStore
from .compare import CHUNK, Difference
from .per_microbatch import check_scope, per_microbatch
from .splits import SplitPlan
from .watched import SelectionRecorder, Watched

OPTIMIZERS = ("sgd", "adamw")
BASELINE_VECTORS = ("grad", "after")
Loss = LossConfig | ValueLossConfig  # a policy loss, or the critic's value loss


@dataclass(frozen=True)
class RunSettings:
    """Everything about a run except the loss and the split. ``cov_strategy`` is the engine's or
    "microbatch", ``statistics_scope`` "minibatch" or "microbatch" (:mod:`.per_microbatch`)."""

    optimizer: str = "sgd"
    lr: float = 0.02
    grad_clip: float = 1.0
    cov_strategy: str = "auto"
    statistics_scope: str = "minibatch"
    device: str = "cpu"
    wrapper: str = "ddp"

    def __post_init__(self) -> None:
        check_scope(self.statistics_scope, self.cov_strategy)

    def with_(self, **changes) -> RunSettings:
        return replace(self, **changes)


@dataclass
class RunResult:
    objective: float  # the engine's metrics["loss"] (a value loss: metrics["critic/vf_loss"])
    metrics: dict[str, float]
    selected: frozenset | None  # canonical keys of the tokens the engine selected (Cov losses)
    skipped: bool
    microbatches: int
    strategy: str | None = None
    differences: dict[str, float] = field(default_factory=dict)  # against the baseline (compare.DIFF_FIELDS)


@dataclass
class Baseline:
    """The run every split is compared with: its result, and two model-sized flat vectors in ``store``:
    "grad", the accumulated gradient before clipping, and "after", the parameters after the step (every
    parameter in order, flattened)."""

    result: RunResult
    store: FlatStore
    grad_norm: float  # ‖grad‖₂ (float64)
    update_norm: float  # ‖after − before‖₂ (float64)

    def release(self) -> None:
        self.store.close()


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer: unknown {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def is_value(loss: Loss) -> bool:
    """A scenario on the critic's value loss (else a policy loss)."""
    return isinstance(loss, ValueLossConfig)


def is_cov(loss: Loss) -> bool:
    return not is_value(loss) and loss.is_cov


def describe_loss(loss: Loss) -> str:
    return f"value/{loss.loss_agg_mode}" if is_value(loss) else f"{loss.loss_mode}/{loss.loss_agg_mode}"


def objective_metric(loss: Loss) -> str:
    """The metric that holds the step's objective J."""
    return "critic/vf_loss" if is_value(loss) else "loss"


def update_config(
    loss: Loss, plan: SplitPlan, num_sequences: int, settings: RunSettings
) -> UpdateConfig | CriticUpdateConfig:
    """The engine config of a split (its microbatch fields also shape the `deferred` correction pass)."""
    micro = plan.split.micro
    extra = {}
    if micro is not None and micro[0] in ("tokens", "packed"):
        extra = dict(
            use_dynamic_bsz=True, ppo_max_token_len_per_gpu=int(micro[1]), use_remove_padding=micro[0] == "packed"
        )
    elif micro is not None:
        extra = dict(ppo_micro_batch_size_per_gpu=max(1, max(len(mb) for mbs in plan.per_rank for mb in mbs)))
    common = dict(ppo_mini_batch_size=num_sequences, grad_clip=settings.grad_clip, **extra)
    if is_value(loss):
        return CriticUpdateConfig(
            cliprange_value=loss.cliprange_value,
            loss_agg_mode=loss.loss_agg_mode,
            loss_scale_factor=loss.loss_scale_factor,
            **common,
        )
    strategy = "auto" if settings.cov_strategy == "microbatch" else settings.cov_strategy  # the legacy objective's
    return UpdateConfig(loss=loss, cov_strategy=strategy, **common)


def objective_of(loss: Loss, settings: RunSettings, config, batch: RolloutBatch, plan, collective):
    """The objective of a run's one optimizer step: the engine's, or the legacy one the settings name."""
    make = per_microbatch(
        value=is_value(loss), statistics_scope=settings.statistics_scope, cov_strategy=settings.cov_strategy
    )
    return make(config, batch, plan, collective, 0)


def _full(t: Tensor) -> Tensor:
    """A plain tensor of the whole parameter (FSDP2 shards are DTensors: gather them)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def parameters_of(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in unwrap(model).named_parameters()]


def _flat_parameters(model: nn.Module, values) -> Iterator[tuple[int, Tensor]]:
    """(offset, whole tensor) of ``values(p)`` for every parameter, in order (collective under FSDP2)."""
    offset = 0
    for p in parameters_of(model):
        value = values(p)
        yield offset, value
        offset += value.numel()


def _grad_of(p: nn.Parameter) -> Tensor:
    return torch.zeros_like(_full(p.detach())) if p.grad is None else _full(p.grad.detach())


def _value_of(p: nn.Parameter) -> Tensor:
    return _full(p.detach())


def _store_into(store: FlatStore, name: str, model: nn.Module, values) -> None:
    for offset, value in _flat_parameters(model, values):
        store.write(name, offset, value)


def _chunks(numel: int, start: int = 0) -> Iterator[tuple[int, int]]:
    """(start, count) of the ``CHUNK``-element pieces :class:`Difference` takes a vector of ``numel`` in."""
    for first in range(0, numel, CHUNK):
        yield start + first, min(CHUNK, numel - first)


def _compare_with(model: nn.Module, values, store: FlatStore, name: str) -> Difference:
    """The difference of ``values(p)`` over every parameter from the stored vector, chunk by chunk."""
    diff = Difference()
    for offset, value in _flat_parameters(model, values):
        flat = value.reshape(-1)
        for start, count in _chunks(flat.numel()):
            diff.add(flat[start : start + count], store.read(name, offset + start, count))
    return diff


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in parameters_of(model))


def _start_with_zero_gradients(model: nn.Module) -> None:
    """Give every trainable parameter a zero gradient that takes no memory (an expanded scalar), before DDP
    wraps it (a frozen one, LoRA's base weights, keeps none: DDP has no bucket for it).

    DDP keeps gradients as views into its communication buckets only for parameters whose gradient
    exists when it is built (or once a synchronised backward has run): a parameter without one gets a
    fresh gradient from its first backward, and with more than one microbatch per rank those fresh
    gradients (a second gradient-sized buffer) live until the last backward copies them into the buckets.
    """
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros((), dtype=p.dtype, device=p.device).expand_as(p)


def _zero_gradients_in_place(optimizer: torch.optim.Optimizer) -> None:
    """The engine zeroes gradients with ``set_to_none=True``, which would drop DDP's bucket views again:
    zero them in place instead. The step is the same: the first backward adds to zeros (0 + g = g)."""
    zero_grad = optimizer.zero_grad
    optimizer.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=False)


def _run(
    template: nn.Module,
    batch: RolloutBatch,
    loss: Loss,
    plan: SplitPlan,
    settings: RunSettings,
    on_gradients,
    on_parameters,
    in_place: bool = False,
) -> RunResult:
    """One optimizer step of ``template``'s copy over ``batch`` split as ``plan``; ``on_gradients(model)``
    sees the accumulated gradient, ``on_parameters(model)`` the parameters after the step.

    With ``plan.ranks > 1`` this must run on every rank of an initialised process group of that size.
    ``in_place=True`` trains ``template`` itself (a forked worker's own copy-on-write template, which
    nothing reads afterwards: its pages stay shared with the parent until the optimizer writes them).
    """
    model = template if in_place else copy.deepcopy(template)
    collective = default_collective(settings.device)
    if plan.ranks > 1:
        if collective.world_size != plan.ranks:
            raise RuntimeError(f"{plan.split.spec}: needs {plan.ranks} ranks, running on {collective.world_size}")
        if settings.wrapper == "ddp":
            _start_with_zero_gradients(model)
        # forked ranks hold the template's parameters already: no broadcast (it would write every page)
        model = wrap_model(model, settings.wrapper, device=settings.device, init_sync=not in_place)
    rank = collective.rank
    optimizer = make_optimizer(settings.optimizer, model.parameters(), settings.lr)
    if plan.ranks > 1 and settings.wrapper == "ddp":
        _zero_gradients_in_place(optimizer)
    config = update_config(loss, plan, len(batch), settings)
    data = plan.batch_for(batch).validate(vocab_size_of(model)).to(settings.device)
    recorder = SelectionRecorder()
    minibatch = plan.minibatch_plan(rank, data)

    def gradients_ready(model: nn.Module) -> None:
        # the backward's freed activations go back to the system before the step writes the parameters
        # (in a forked worker, copy-on-write pages): glibc would otherwise keep them, ~0.4 model sizes
        release_free_memory()
        on_gradients(model)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the microbatch strategy's warning is the point of a legacy run
        objective = Watched(
            objective_of(loss, settings, config, data, minibatch, collective),
            data,
            on_gradients=gradients_ready,
            on_selection=recorder,
        )
        result = optimizer_step(
            model, optimizer, data, minibatch, objective, grad_clip=config.grad_clip, collective=collective, step=0
        )
    release_free_memory()
    on_parameters(model)
    del optimizer, model
    selected = None
    if is_cov(loss):
        selected = frozenset(recorder.keys)
        if plan.ranks > 1:
            gathered = collective.gather_objects(sorted(recorder.keys))
            selected = frozenset(k for part in gathered for k in part)
    return RunResult(
        float(result.metrics.get(objective_metric(loss), float("nan"))),
        dict(result.metrics),
        selected,
        bool(result.skipped),
        plan.microbatches,
        result.cov_strategy,
    )


def run_baseline(
    template: nn.Module, batch: RolloutBatch, loss: Loss, plan: SplitPlan, settings: RunSettings
) -> Baseline:
    """The baseline run, its two flat vectors written to a :class:`FlatStore` as the run produces them."""
    numel = sum(p.numel() for p in parameters_of(template))
    store = FlatStore(BASELINE_VECTORS, numel, _dtype_of(template))
    result = _run(
        template,
        batch,
        loss,
        plan,
        settings,
        lambda model: _store_into(store, "grad", model, _grad_of),
        lambda model: _store_into(store, "after", model, _value_of),
    )
    grad_norm = Difference()
    for start, count in _chunks(numel):
        grad_norm.add(store.read("grad", start, count))
    update = _compare_with(template, _value_of, store, "after")
    return Baseline(result, store, grad_norm.norm, update.norm)


def run_compared(
    template: nn.Module,
    batch: RolloutBatch,
    loss: Loss,
    plan: SplitPlan,
    settings: RunSettings,
    baseline: Baseline,
    in_place: bool = False,
) -> RunResult:
    """A split's run, compared with ``baseline`` as it goes: nothing model-sized is kept."""
    figures: dict[str, float] = {}

    def on_gradients(model) -> None:
        diff = _compare_with(model, _grad_of, baseline.store, "grad")
        figures.update(grad_max_abs_diff=diff.max_abs, grad_rel_diff=diff.relative_to(baseline.grad_norm))

    def on_parameters(model) -> None:
        diff = _compare_with(model, _value_of, baseline.store, "after")
        figures.update(update_max_abs_diff=diff.max_abs, update_rel_diff=diff.relative_to(baseline.update_norm))

    result = _run(template, batch, loss, plan, settings, on_gradients, on_parameters, in_place)
    result.differences = figures
    return result
