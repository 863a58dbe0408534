"""Where a run computes: ``cpu``, ``cuda`` or ``cuda:N`` — resolved, checked and made deterministic.

``resolve_device(spec, local_rank, world_size)``: ``cpu`` is the CPU; ``cuda`` is GPU ``LOCAL_RANK`` (0 for
one process, each torchrun rank its own); ``cuda:N`` is GPU N, for one process only (two ranks on one GPU
are refused by NCCL). Each mistake is one ``ConfigError`` line naming the key, before any model is loaded:
CUDA missing, an index past the device count, a rank without a GPU of its own, a dtype the GPU cannot run
(bf16 before compute capability 8.0).

``process_group_backend(device)``: gloo for the CPU; on CUDA ``cpu:gloo,cuda:nccl`` — NCCL for the
tensors on the GPU (the gradient sync), gloo for the host-side objects and the barriers.

``deterministic(device)``: what run-to-run determinism needs on the device, set for the process, and the
notice that says what was set and what it costs: on CUDA ``torch.use_deterministic_algorithms(True)``,
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS's deterministic workspace), cuDNN deterministic without
autotuning, no TF32 and no reduced-precision reductions in bf16 products (bf16 operands, fp32 sums). On
the CPU the kernels are deterministic, and the row dependence of their products is ``engine.row_invariant``'s
concern and MKL's strict mode's (``mkl_mode``, asked for when splitproof is imported): the notice says
when that mode is off.
"""

from __future__ import annotations

import os

import torch

from .loss_config import ConfigError
from .mkl_mode import strict_mode_notice

CUBLAS_WORKSPACE = ":4096:8"
CUDA_DTYPES_NEED_CC = {torch.bfloat16: (8, 0)}  # dtype -> the first compute capability that runs it


def parse_device(spec, key: str = "trainer.device") -> tuple[str, int | None]:
    """``("cpu", None)``, ``("cuda", None)`` or ``("cuda", N)`` from the setting; anything else is an error."""
    if spec == "cpu":
        return "cpu", None
    if spec == "cuda":
        return "cuda", None
    if isinstance(spec, str) and spec.startswith("cuda:") and spec[5:].isdigit():
        return "cuda", int(spec[5:])
    raise ConfigError(key, f"must be cpu, cuda or cuda:N, got {spec!r}")


def resolve_device(spec, *, local_rank: int = 0, world_size: int = 1, key: str = "trainer.device") -> torch.device:
    """The torch device of this process for the setting ``spec`` (see the module docstring)."""
    kind, index = parse_device(spec, key)
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(key, f"{spec!r} needs CUDA, and this machine has no CUDA device; set {key}=cpu")
    count = torch.cuda.device_count()
    if index is not None:
        if world_size > 1:
            raise ConfigError(
                key,
                f"{spec!r} puts all {world_size} ranks on one GPU (NCCL needs one GPU per rank); "
                f"set {key}=cuda: rank r then runs on cuda:LOCAL_RANK",
            )
        if index >= count:
            raise ConfigError(key, f"{spec!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
        return torch.device("cuda", index)
    if local_rank >= count:
        raise ConfigError(
            key,
            f"'cuda' runs rank LOCAL_RANK={local_rank} on cuda:{local_rank}, and this machine has {count} CUDA "
            f"device(s); start at most {count} processes per node",
        )
    return torch.device("cuda", local_rank)


def this_process_device(spec, key: str = "trainer.device") -> torch.device:
    """``resolve_device`` with this process's ``LOCAL_RANK`` and ``WORLD_SIZE`` (torchrun's variables)."""
    return resolve_device(
        spec,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        key=key,
    )


def check_dtype(device: torch.device, dtype: torch.dtype, key: str) -> None:
    """A ``ConfigError`` naming ``key`` when ``device`` cannot compute in ``dtype``."""
    need = CUDA_DTYPES_NEED_CC.get(dtype)
    if device.type != "cuda" or need is None:
        return
    have = torch.cuda.get_device_capability(device)
    if tuple(have) < need:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            key,
            f"{str(dtype).removeprefix('torch.')} needs a GPU of compute capability {need[0]}.{need[1]} or newer; "
            f"{device} ({name}) has {have[0]}.{have[1]}; use fp32",
        )


def process_group_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for ranks computing on ``device``."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


def deterministic(device: torch.device | str) -> str | None:
    """Set what run-to-run determinism needs on ``device`` (module docstring); the notice (on the CPU: only
    when MKL's strict mode is off)."""
    device = torch.device(device)
    if device.type != "cuda":
        return strict_mode_notice()
    set_before = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if set_before is None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # read when cuBLAS starts: before any product
    torch.cuda.set_device(device)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    workspace = f"CUBLAS_WORKSPACE_CONFIG={os.environ['CUBLAS_WORKSPACE_CONFIG']}" + (
        " (yours)" if set_before is not None else ""
    )
    return (
        f"trainer.device={device}: deterministic kernels for run-to-run identical results — "
        f"torch.use_deterministic_algorithms(True), {workspace}, cuDNN deterministic without autotuning, "
        "no TF32, fp32 sums in bf16 products; this costs GPU time (slower kernels, no autotuning; "
        "docs/gpu.md), and an operation with no deterministic kernel stops the run naming it"
    )
