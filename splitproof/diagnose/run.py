"""Run one policy update for one split and keep what the diagnosis compares.

A run copies the template model, builds a fresh optimizer, and drives the engine's own optimizer step
(:func:`splitproof.engine.train_minibatch`) with the split's microbatch plan — the same call
``update_policy`` makes per minibatch. It keeps the accumulated gradient (before clipping, through the
engine's ``on_gradients`` hook), the parameters after the step, the engine's metrics, and for KL-Cov /
Clip-Cov the canonical keys (sequence id, position) of the tokens the engine selected.

``dp:D`` runs happen inside :func:`splitproof.engine.launch.run_data_parallel` workers: every case for
one (D, wrapper) goes into a single call, so processes start once.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.collective import default_collective
from splitproof.config import LossConfig
from splitproof.engine import UpdateConfig, train_minibatch, wrap_model
from splitproof.models import unwrap, vocab_size_of

from .splits import SplitPlan

OPTIMIZERS = ("sgd", "adamw")


@dataclass(frozen=True)
class RunSettings:
    """Everything about a run except the loss and the split."""

    optimizer: str = "sgd"
    lr: float = 0.02
    grad_clip: float = 1.0
    cov_strategy: str = "auto"
    statistics_scope: str = "minibatch"
    device: str = "cpu"
    wrapper: str = "ddp"

    def with_(self, **changes) -> "RunSettings":
        return replace(self, **changes)


@dataclass
class RunResult:
    grads: list[Tensor]  # accumulated gradient per parameter, before clipping
    params: list[Tensor]  # parameters after the step
    objective: float  # the engine's metrics["loss"]
    metrics: dict[str, float]
    selected: frozenset | None  # canonical keys of the tokens the engine selected (Cov losses)
    skipped: bool
    microbatches: int
    strategy: str | None = None
    extra: dict = field(default_factory=dict)


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"optimizer: unknown {name!r}; expected one of {', '.join(OPTIMIZERS)}")


def update_config(loss: LossConfig, plan: SplitPlan, num_sequences: int, settings: RunSettings) -> UpdateConfig:
    """The engine config of a split (its microbatch fields also shape the `deferred` correction pass)."""
    micro = plan.split.micro
    extra = {}
    if micro is not None and micro[0] in ("tokens", "packed"):
        extra = dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=int(micro[1]),
                     use_remove_padding=micro[0] == "packed")
    elif micro is not None:
        extra = dict(ppo_micro_batch_size_per_gpu=max(1, max(len(mb) for mbs in plan.per_rank for mb in mbs)))
    return UpdateConfig(loss=loss, ppo_mini_batch_size=num_sequences, grad_clip=settings.grad_clip,
                        cov_strategy=settings.cov_strategy, statistics_scope=settings.statistics_scope, **extra)


def _full(t: Tensor) -> Tensor:
    """A plain tensor of the whole parameter (FSDP2 shards are DTensors: gather them)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def parameters_of(model: nn.Module) -> list[nn.Parameter]:
    return [p for _, p in unwrap(model).named_parameters()]


class SelectionRecorder:
    """Collects the canonical keys of every token the engine selects (KL-Cov / Clip-Cov)."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, int]] = set()

    def __call__(self, selection: Tensor, seq_ids: Tensor) -> None:
        rows, pos = selection.nonzero(as_tuple=True)
        self.keys.update(zip(seq_ids[rows].tolist(), pos.tolist()))


def run_update(template: nn.Module, batch: RolloutBatch, loss: LossConfig, plan: SplitPlan,
               settings: RunSettings) -> RunResult:
    """One optimizer step of ``template``'s copy over ``batch`` split as ``plan``.

    With ``plan.ranks > 1`` this must run on every rank of an initialised process group of that size.
    """
    model = copy.deepcopy(template)
    collective = default_collective(settings.device)
    if plan.ranks > 1:
        if collective.world_size != plan.ranks:
            raise RuntimeError(f"{plan.split.spec}: needs {plan.ranks} ranks, running on {collective.world_size}")
        model = wrap_model(model, settings.wrapper, device=settings.device)
    rank = collective.rank
    params = parameters_of(model)
    optimizer = make_optimizer(settings.optimizer, model.parameters(), settings.lr)
    config = update_config(loss, plan, len(batch), settings)
    data = plan.batch_for(batch).validate(vocab_size_of(model)).to(settings.device)
    grads: list[Tensor] = []

    def on_gradients(_model) -> None:
        grads[:] = [torch.zeros_like(_full(p.detach())) if p.grad is None else _full(p.grad).detach().clone()
                    for p in params]

    recorder = SelectionRecorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the microbatch strategy's warning is the point of a legacy run
        result = train_minibatch(model, optimizer, data, plan.minibatch_plan(rank, data), config, collective=collective,
                                 step=0, on_gradients=on_gradients, on_selection=recorder)
    keys = recorder.keys
    after = [_full(p.detach()).clone() for p in params]
    selected = None
    if loss.is_cov:
        selected = frozenset(keys)
        if plan.ranks > 1:
            gathered = collective.gather_objects(sorted(keys))
            selected = frozenset(k for part in gathered for k in part)
    return RunResult(grads, after, float(result.metrics.get("loss", float("nan"))), dict(result.metrics),
                     selected, bool(result.skipped), plan.microbatches, result.cov_strategy)


def initial_parameters(template: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in parameters_of(template)]
