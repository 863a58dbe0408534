"""The update engine's settings, with verl's actor and critic field names and defaults where verl has them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..loss_config import ConfigError, LossConfig, ValueLossConfig, is_finite_number, require

COV_STRATEGIES = ("auto", "prepass", "deferred")


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True, kw_only=True)
class SplitSettings:
    """What the policy and the critic update have in common: how the rollout batch is cut into optimizer
    minibatches and microbatches, and the gradient clip (one planner cuts both).

    ``ppo_mini_batch_size`` counts prompts as in verl; a minibatch holds ``ppo_mini_batch_size ×
    rollout_n`` sequences. ``ppo_micro_batch_size_per_gpu`` counts sequences; None (and no dynamic
    batch size) runs each rank's whole shard as one microbatch.
    ``use_remove_padding`` packs each microbatch's sequences into shared rows (``engine.packing``);
    verl defaults it to True with varlen flash-attention, here it is opt-in (see docs/architecture.md).
    """

    ppo_mini_batch_size: int = 256
    rollout_n: int = 1
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int = 42
    ppo_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    use_remove_padding: bool = False
    grad_clip: float = 1.0

    def __post_init__(self) -> None:
        for name in ("ppo_mini_batch_size", "rollout_n", "ppo_epochs", "ppo_max_token_len_per_gpu"):
            value = getattr(self, name)
            require(_positive_int(value), name, f"must be an int >= 1, got {value!r}")
        micro = self.ppo_micro_batch_size_per_gpu
        require(
            micro is None or _positive_int(micro),
            "ppo_micro_batch_size_per_gpu",
            f"must be None or an int >= 1, got {micro!r}",
        )
        require(
            is_finite_number(self.grad_clip) and self.grad_clip > 0, "grad_clip", f"must be > 0, got {self.grad_clip!r}"
        )

    @property
    def minibatch_sequences(self) -> int:
        return self.ppo_mini_batch_size * self.rollout_n


@dataclass(frozen=True)
class UpdateConfig(SplitSettings):
    """One policy update over a rollout batch: the loss (verl's ``actor`` fields), the split settings
    (:class:`SplitSettings`), the sampling temperature, for KL-Cov/Clip-Cov how the selection is made, and
    ``use_prefix_grouper`` (verl's key): each distinct prompt of a microbatch computed once
    (``engine.shared_prefix``)."""

    loss: LossConfig = field(default_factory=LossConfig)
    temperature: float = 1.0
    cov_strategy: str = "auto"
    use_prefix_grouper: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            is_finite_number(self.temperature) and self.temperature > 0,
            "temperature",
            f"must be > 0, got {self.temperature!r}",
        )
        require(
            self.cov_strategy in COV_STRATEGIES,
            "cov_strategy",
            f"unknown {self.cov_strategy!r}; expected one of {', '.join(COV_STRATEGIES)}",
        )
        require(
            isinstance(self.use_prefix_grouper, bool),
            "use_prefix_grouper",
            f"must be true or false, got {self.use_prefix_grouper!r}",
        )
        if not isinstance(self.loss, LossConfig):
            raise ConfigError("loss", f"must be a LossConfig, got {type(self.loss).__name__}")


@dataclass(frozen=True, kw_only=True)
class CriticUpdateConfig(SplitSettings):
    """One critic (value model) update over a rollout batch: verl's ``critic`` field names and defaults.

    Minibatches, microbatches and token budgets as in :class:`SplitSettings` (verl's critic token budget
    defaults to 32768). The value loss is clipped by ``cliprange_value`` and aggregated by
    ``loss_agg_mode`` over the critic's whole minibatch (``loss_scale_factor``: S of
    ``seq-mean-token-sum-norm``).
    """

    ppo_max_token_len_per_gpu: int = 32768
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _ = self.value_loss  # checks cliprange_value, loss_agg_mode, loss_scale_factor

    @property
    def value_loss(self) -> ValueLossConfig:
        return ValueLossConfig(self.cliprange_value, self.loss_agg_mode, self.loss_scale_factor)
