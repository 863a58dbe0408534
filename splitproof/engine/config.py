"""The update engine's settings, with verl's actor field names and defaults where verl has them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError, LossConfig, _check, _finite

COV_STRATEGIES = ("auto", "prepass", "deferred", "microbatch")
STATISTICS_SCOPES = ("minibatch", "microbatch")


@dataclass(frozen=True)
class UpdateConfig:
    """One policy update over a rollout batch.

    ``ppo_mini_batch_size`` counts prompts as in verl; a minibatch holds ``ppo_mini_batch_size ×
    rollout_n`` sequences. ``ppo_micro_batch_size_per_gpu`` counts sequences; None (and no dynamic
    batch size) runs each rank's whole shard as one microbatch. ``statistics_scope="microbatch"`` takes
    every statistic per microbatch, as frameworks with a local fallback do: for the diagnosis only.
    ``use_remove_padding`` packs each microbatch's sequences into shared rows (``engine.packing``);
    verl defaults it to True with varlen flash-attention, here it is opt-in (see docs/architecture.md).
    """

    loss: LossConfig = field(default_factory=LossConfig)
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
    temperature: float = 1.0
    cov_strategy: str = "auto"
    statistics_scope: str = "minibatch"

    def __post_init__(self) -> None:
        for name in ("ppo_mini_batch_size", "rollout_n", "ppo_epochs", "ppo_max_token_len_per_gpu"):
            value = getattr(self, name)
            _check(isinstance(value, int) and value >= 1, name, f"must be an int >= 1, got {value!r}")
        micro = self.ppo_micro_batch_size_per_gpu
        _check(micro is None or (isinstance(micro, int) and micro >= 1), "ppo_micro_batch_size_per_gpu",
               f"must be None or an int >= 1, got {micro!r}")
        _check(_finite(self.grad_clip) and self.grad_clip > 0, "grad_clip", f"must be > 0, got {self.grad_clip!r}")
        _check(_finite(self.temperature) and self.temperature > 0, "temperature", f"must be > 0, got {self.temperature!r}")
        _check(self.cov_strategy in COV_STRATEGIES, "cov_strategy",
               f"unknown {self.cov_strategy!r}; expected one of {', '.join(COV_STRATEGIES)}")
        _check(self.statistics_scope in STATISTICS_SCOPES, "statistics_scope",
               f"unknown {self.statistics_scope!r}; expected one of {', '.join(STATISTICS_SCOPES)}")
        if not isinstance(self.loss, LossConfig):
            raise ConfigError("loss", f"must be a LossConfig, got {type(self.loss).__name__}")

    @property
    def minibatch_sequences(self) -> int:
        return self.ppo_mini_batch_size * self.rollout_n
