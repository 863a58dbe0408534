"""verl's LoRA keys, checked: a pure-Python module (no torch), so that reading a config needs none."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from splitproof.loss_config import ConfigError

DEFAULT_ALPHA = 16.0  # verl's lora_alpha default


@dataclass(frozen=True)
class LoraSettings:
    """verl's ``actor_rollout_ref.model`` LoRA keys. ``lora_rank`` 0 turns LoRA off; every other key then
    must keep its default (a key set on a disabled LoRA is an error, never ignored)."""

    lora_rank: int = 0
    lora_alpha: float = DEFAULT_ALPHA
    target_modules: str | tuple[str, ...] = "all-linear"
    exclude_modules: tuple[str, ...] | None = None
    lora_adapter_path: str | None = None
    prefix: str = field(default="", compare=False)  # how errors name the keys, e.g. "actor_rollout_ref.model."

    def __post_init__(self):
        p = self.prefix
        if isinstance(self.target_modules, list):
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if isinstance(self.exclude_modules, (list, str)):
            names = [self.exclude_modules] if isinstance(self.exclude_modules, str) else self.exclude_modules
            object.__setattr__(self, "exclude_modules", tuple(names))
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int):
            raise ConfigError(f"{p}lora_rank", f"must be an integer, got {self.lora_rank!r}")
        if self.lora_rank < 0:
            raise ConfigError(f"{p}lora_rank", f"must be >= 0 (0 = LoRA off), got {self.lora_rank}")
        if not self.enabled:
            set_keys = [f"{p}{k}={v!r}" for k, v in self._non_defaults().items()]
            if set_keys:
                raise ConfigError(
                    f"{p}lora_rank",
                    f"is {self.lora_rank} (LoRA off) but {', '.join(set_keys)} "
                    "is set: set lora_rank > 0 or remove the LoRA keys",
                )
            return
        if not (isinstance(self.lora_alpha, (int, float)) and math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(f"{p}lora_alpha", f"must be a finite number > 0, got {self.lora_alpha!r}")
        targets = self.target_modules
        if isinstance(targets, str):
            if targets != "all-linear":
                raise ConfigError(
                    f"{p}target_modules", f"must be 'all-linear' or a list of module names, got {targets!r}"
                )
        elif not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigError(
                f"{p}target_modules", f"must be 'all-linear' or a non-empty list of module names, got {list(targets)!r}"
            )
        if self.exclude_modules is not None and not all(isinstance(t, str) and t for t in self.exclude_modules):
            raise ConfigError(f"{p}exclude_modules", f"must be a list of module names, got {self.exclude_modules!r}")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    @property
    def scale(self) -> float:
        """s = lora_alpha / lora_rank."""
        return self.lora_alpha / self.lora_rank

    def _non_defaults(self) -> dict:
        defaults = {f.name: f.default for f in fields(self)}
        return {
            k: getattr(self, k)
            for k in ("lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path")
            if getattr(self, k) != defaults[k]
        }


# --- the model's modules -------------------------------------------------------------------------------------
