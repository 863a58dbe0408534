"""What the diagnosis reads from inside an optimizer step: the accumulated gradient and the Cov selection.

:class:`Watched` wraps any objective of the engine's optimizer step
(:func:`splitproof.engine.optimizer_step.optimizer_step`) and changes nothing it computes: after the step's
passes (the microbatch loop and the objective's closing pass: the gradient is whole, reduced over ranks and
not yet clipped) it hands the model to ``on_gradients``, and the KL-Cov/Clip-Cov selection the objective made
(its ``selection``, a [B_rollout, T] mask of this rank's shard) to ``on_selection(mask, seq_ids)``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.engine.optimizer_step import Objective, Part
from splitproof.stats import MinibatchStats


class SelectionRecorder:
    """Collects the canonical keys (sequence id, response position) of every token an objective selects."""

    def __init__(self) -> None:
        self.keys: set[tuple[int, int]] = set()

    def __call__(self, selection: Tensor, seq_ids: Tensor) -> None:
        rows, pos = selection.nonzero(as_tuple=True)
        self.keys.update(zip(seq_ids[rows].tolist(), pos.tolist()))


class Watched:
    """``inner`` with two read-only hooks after its passes: ``on_gradients(model)`` and
    ``on_selection(mask, seq_ids)`` (the latter only when ``inner`` made a selection)."""

    def __init__(
        self,
        inner: Objective,
        batch: RolloutBatch,
        *,
        on_gradients: Callable[[nn.Module], None] | None = None,
        on_selection: Callable[[Tensor, Tensor], None] | None = None,
    ):
        self.inner, self.seq_ids = inner, batch.seq_ids
        self.on_gradients, self.on_selection = on_gradients, on_selection
        self.grad_norm_metric, self.skipped_metric = inner.grad_norm_metric, inner.skipped_metric
        self.group_index = inner.group_index

    def begin(self, model: nn.Module, stats: MinibatchStats) -> str | None:
        return self.inner.begin(model, stats)

    @property
    def syncs_in_loop(self) -> bool:
        return self.inner.syncs_in_loop

    def before(self, model: nn.Module) -> None:
        self.inner.before(model)

    def share(self, model: nn.Module, part: Part, stats: MinibatchStats) -> tuple[Tensor, dict[str, Tensor]]:
        return self.inner.share(model, part, stats)

    def after(self, model: nn.Module, stats: MinibatchStats, metric_sums: dict[str, Tensor]) -> None:
        self.inner.after(model, stats, metric_sums)
        selection = getattr(self.inner, "selection", None)
        if self.on_selection is not None and selection is not None:
            self.on_selection(selection, self.seq_ids)
        if self.on_gradients is not None:
            self.on_gradients(model)

    def metric_names(self) -> list[str]:
        return self.inner.metric_names()


def watched(make_objective, *, on_gradients=None, on_selection=None):
    """A ``make_objective`` for ``update_policy`` / ``update_critic``: ``make_objective``'s objective, watched."""

    def make(config, batch: RolloutBatch, plan, collective, step: int) -> Watched:
        return Watched(
            make_objective(config, batch, plan, collective, step),
            batch,
            on_gradients=on_gradients,
            on_selection=on_selection,
        )

    return make
