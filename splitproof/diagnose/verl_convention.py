"""verl's calling convention for policy losses: an actor config with verl's fields and defaults.

Readable as attributes, through ``.get()``, ``[key]`` and ``in`` (verl's losses use all of them), with a
nested ``policy_loss`` and the per-minibatch ``global_batch_info`` that verl's engine writes in place.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from splitproof.loss_config import LossConfig


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class _ConfigAccess:
    """Attribute access plus the read-only mapping protocol verl's configs offer (``.get``, ``[]``, ``in``)."""

    def _keys(self) -> list[str]:
        return [f.name for f in fields(self)]  # type: ignore[arg-type]

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self._keys() else default

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys()

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def keys(self) -> list[str]:
        return self._keys()

    def items(self) -> list[tuple[str, Any]]:
        return [(k, getattr(self, k)) for k in self._keys()]

    def values(self) -> list[Any]:
        return [getattr(self, k) for k in self._keys()]

    def to_dict(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]


@dataclass
class VerlRolloutCorrection(_ConfigAccess):
    """``actor.policy_loss.rollout_correction`` (used by verl's ``bypass_mode`` only)."""

    loss_type: str = "ppo_clip"
    rollout_is: str | None = "sequence"
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False


@dataclass
class VerlPolicyLossConfig(_ConfigAccess):
    """``actor.policy_loss`` with verl's defaults."""

    loss_mode: str = "vanilla"
    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    rollout_correction: VerlRolloutCorrection = field(default_factory=VerlRolloutCorrection)


_POLICY_LOSS_FIELDS = {f.name for f in fields(VerlPolicyLossConfig)}


@dataclass
class VerlActorConfig(_ConfigAccess):
    """The actor fields a verl policy-loss function may read, with verl's defaults.

    ``global_batch_info`` is written per minibatch (per call) by the audit, as verl's engine does.
    """

    strategy: str = "fsdp"
    ppo_mini_batch_size: int = 256
    ppo_micro_batch_size: int | None = None
    ppo_micro_batch_size_per_gpu: int | None = None
    ppo_infer_micro_batch_size_per_gpu: int | None = None
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_infer_max_token_len_per_gpu: int = 16384
    rollout_n: int = 1
    freeze_vision_tower: bool = False
    ppo_epochs: int = 1
    shuffle: bool = False
    data_loader_seed: int = 42
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    entropy_coeff: float = 0.0
    calculate_entropy: bool = False
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    calculate_sum_pi_squared: bool = False
    use_torch_compile: bool = False
    use_fused_kernels: bool = False
    policy_loss: VerlPolicyLossConfig = field(default_factory=VerlPolicyLossConfig)
    global_batch_info: dict = field(default_factory=dict)

    @classmethod
    def from_loss_config(cls, cfg: LossConfig | None = None, **overrides: Any) -> VerlActorConfig:
        """Build from splitproof's LossConfig where the fields overlap, then apply ``overrides``.

        ``overrides`` take verl's names, flat: actor fields and ``policy_loss`` fields alike
        (``dro_beta=0.1`` lands in ``policy_loss``).
        """
        cfg = cfg or LossConfig()
        shared = {f.name: getattr(cfg, f.name) for f in fields(LossConfig)}
        policy = {name: shared[name] for name in _POLICY_LOSS_FIELDS if name in shared}
        actor = {f.name: shared[f.name] for f in fields(cls) if f.name in shared}
        actor.update(
            clip_ratio_low=cfg.eps_low,
            clip_ratio_high=cfg.eps_high,  # verl reads them as set
            calculate_entropy=cfg.entropy_coeff != 0,
            policy_loss=VerlPolicyLossConfig(**policy),
        )
        config = cls(**actor)
        config.update(**overrides)
        return config

    def update(self, **values: Any) -> VerlActorConfig:
        actor_fields = set(self._keys()) - {"policy_loss", "global_batch_info"}
        for key, value in values.items():
            if key in actor_fields:
                setattr(self, key, value)
            elif key in _POLICY_LOSS_FIELDS and key != "rollout_correction":
                setattr(self.policy_loss, key, value)
            else:
                raise ValueError(f"unknown verl actor field {key!r}")
        return self


def native_verl_config(config: VerlActorConfig) -> Any:
    """The same values in verl's own ``ActorConfig`` (for functions that check ``isinstance``).

    Needs verl importable in the running environment; it is never a dependency of splitproof.
    Raises ValueError when verl (or its config classes) cannot be imported or built.
    """
    try:
        from verl.workers.config import ActorConfig, PolicyLossConfig  # type: ignore[import-not-found]
    except Exception as exc:
        raise ValueError(f"a native verl config needs verl importable: {one_line(exc)}") from None
    try:
        from verl.trainer.config import RolloutCorrectionConfig  # type: ignore[import-not-found]
    except Exception:
        try:
            from verl.trainer.config.algorithm import RolloutCorrectionConfig  # type: ignore[import-not-found]
        except Exception:
            RolloutCorrectionConfig = None

    def build(cls, values: dict) -> Any:
        accepted = {f.name for f in fields(cls) if f.init}
        return cls(**{k: v for k, v in values.items() if k in accepted})

    policy_values = {f.name: getattr(config.policy_loss, f.name) for f in fields(config.policy_loss)}
    rc = config.policy_loss.rollout_correction
    if RolloutCorrectionConfig is not None:
        policy_values["rollout_correction"] = build(
            RolloutCorrectionConfig, {f.name: getattr(rc, f.name) for f in fields(rc)}
        )
    else:
        policy_values.pop("rollout_correction")
    actor_values = {f.name: getattr(config, f.name) for f in fields(config)}
    actor_values["policy_loss"] = build(PolicyLossConfig, policy_values)
    actor_values["global_batch_info"] = {}
    if (
        not actor_values["use_dynamic_bsz"]
        and actor_values["ppo_micro_batch_size"] is None
        and actor_values["ppo_micro_batch_size_per_gpu"] is None
    ):
        actor_values["ppo_micro_batch_size_per_gpu"] = 1  # verl requires one of them; unused by the losses
    try:
        return build(ActorConfig, actor_values)
    except Exception as exc:
        raise ValueError(f"cannot build verl's ActorConfig: {one_line(exc)}") from None


def set_global_batch_info(config: Any, info: dict) -> None:
    """Write the minibatch's figures as verl's engine does: into the config's dict, in place."""
    current = getattr(config, "global_batch_info", None)
    if isinstance(current, dict):
        current.clear()
        current.update(info)
    else:
        config.global_batch_info = dict(info)
