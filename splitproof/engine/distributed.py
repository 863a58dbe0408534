"""Data-parallel glue: wrapping a model for DDP or FSDP2, and switching gradient sync per microbatch.

The engine accumulates every microbatch's gradient locally and lets the wrapper reduce once, on the last
backward of the step. Both wrappers average over ranks; the engine multiplies each share by the DP size
so that the average is the minibatch gradient.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

DP_STRATEGIES = ("none", "ddp", "fsdp2")


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(model, FSDPModule)


def wrap_model(model: nn.Module, strategy: str, *, device: torch.device | str = "cpu") -> nn.Module:
    """DDP: ``DistributedDataParallel``; FSDP2: ``fully_shard`` each decoder layer, then the root."""
    if strategy not in DP_STRATEGIES:
        raise ValueError(f"strategy: unknown {strategy!r}; expected one of {', '.join(DP_STRATEGIES)}")
    if strategy == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"strategy {strategy!r} needs torch.distributed to be initialised (launch with torchrun)")
    device = torch.device(device)
    if strategy == "ddp":
        ids = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers``), else none."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


@contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Reduce gradients across ranks in this backward only if ``enabled`` (the step's last one)."""
    if is_fsdp2(model):
        model.set_requires_gradient_sync(enabled)
        yield
    elif is_ddp(model) and not enabled:
        with model.no_sync():
            yield
    else:
        with nullcontext():
            yield


def needs_lockstep(model: nn.Module) -> bool:
    """Wrapped models need every rank to run the same forwards/backwards (collectives inside)."""
    return is_ddp(model) or is_fsdp2(model)
