"""Which dtype a model is stored in and which it computes in, per model, device and setting.

verl's FSDP engine keeps ``fsdp_config.model_dtype`` (fp32) parameters and computes in ``fsdp_config.dtype``
(bf16) with fp32 gradient reductions. Here, for the actor (``actor_rollout_ref.actor.fsdp_config``; the
reference model and the rollout compute like it) and the critic (``critic.fsdp``, by default the actor's):

- ``model_dtype`` is the storage dtype: parameters, gradients, their reductions, the optimizer state;
- ``dtype`` null (splitproof's default; verl's is bfloat16) or equal to ``model_dtype``: the model computes
  in ``model_dtype``;
- ``dtype`` narrower than ``model_dtype`` (bf16 over fp32) on a CUDA device: every forward and backward of the
  model computes under autocast in ``dtype`` (``engine.precision.compute_in``);
- on the CPU ``dtype`` is not applied (a notice naming the key, its value and its origin): the CPU computes
  in ``model_dtype``, so a config written for a GPU runs unchanged, and exactly, on a CPU.

Errors (``ConfigError``, one line, before any model is loaded): on every device an unknown dtype and fp16
(no loss scaling here); on a GPU a compute dtype wider than the storage dtype, and a narrower one over fp64
storage (float64 is never autocast). bf16 before compute capability 8.0 is ``devices.check_dtype``'s error.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...loss_config import ConfigError

ACTOR = "actor_rollout_ref.actor.fsdp_config"
CRITIC = "critic.fsdp"
NAMES = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16", "fp64": "fp64", "float64": "fp64"}
BITS = {"bf16": 16, "fp32": 32, "fp64": 64}


@dataclass(frozen=True)
class Precision:
    """One model's dtypes (``fp32`` | ``bf16`` | ``fp64``): ``storage`` its parameters', ``compute`` its products'."""

    storage: str
    compute: str

    @property
    def mixed(self) -> bool:
        return self.compute != self.storage


def resolve(prefix: str, model_dtype: str, dtype, device: str) -> Precision:
    """The ``Precision`` of the model configured at ``prefix`` on ``device`` (``cpu``, ``cuda``, ``cuda:N``)."""
    storage = NAMES.get(model_dtype, model_dtype)
    if dtype is None:
        return Precision(storage, storage)
    key = f"{prefix}.dtype"
    if dtype in ("fp16", "float16"):
        raise ConfigError(key, f"{dtype!r} needs loss scaling, which splitproof does not do; use bf16 (or null)")
    if dtype not in NAMES:
        raise ConfigError(key, f"must be null or one of {', '.join(NAMES)}, got {dtype!r}")
    compute = NAMES[dtype]
    if compute == storage or str(device) == "cpu":
        return Precision(storage, storage)
    if storage == "fp64":
        raise ConfigError(
            key, f"{dtype} over {prefix}.model_dtype=fp64: float64 is never autocast; set {key}=null or fp64"
        )
    if BITS[compute] > BITS[storage]:
        raise ConfigError(
            key, f"{dtype} is wider than {prefix}.model_dtype={model_dtype}: the compute dtype cannot widen it"
        )
    return Precision(storage, compute)


def actor_precision(cfg) -> Precision:
    """The actor's (and the reference model's and the rollout's) ``Precision`` on ``trainer.device``."""
    fsdp = cfg.actor_rollout_ref.actor.fsdp_config
    return resolve(ACTOR, fsdp.model_dtype, fsdp.dtype, cfg.trainer.device)


def critic_precision(cfg) -> Precision:
    """The critic's ``Precision`` on ``trainer.device``."""
    return resolve(CRITIC, cfg.critic.fsdp.model_dtype, cfg.critic.fsdp.dtype, cfg.trainer.device)


def precision_notices(cfg, origins) -> list[str]:
    """On the CPU, the notice for each ``dtype`` you (or a file) set that differs from ``model_dtype``: the
    CPU computes in ``model_dtype``. The critic's is named when set apart from the actor's."""
    if str(cfg.trainer.device) != "cpu":
        return []
    notices = []
    for prefix, fsdp in ((ACTOR, cfg.actor_rollout_ref.actor.fsdp_config), (CRITIC, cfg.critic.fsdp)):
        key = f"{prefix}.dtype"
        if fsdp.dtype is None or NAMES.get(fsdp.dtype) == NAMES.get(fsdp.model_dtype, fsdp.model_dtype):
            continue
        if prefix == CRITIC and key not in origins.user:
            continue  # the actor's value, interpolated
        _, origin = origins.of(key)
        notices.append(
            f"{key}={fsdp.dtype} ({origin}) is honoured only on a GPU (trainer.device=cuda): on the CPU the "
            f"model computes in {prefix}.model_dtype={fsdp.model_dtype}, as it is stored (docs/gpu.md)"
        )
    return notices
