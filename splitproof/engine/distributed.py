"""Data-parallel glue: wrapping a model for DDP or FSDP2, and switching gradient sync per microbatch.

The engine accumulates every microbatch's gradient locally and lets the wrapper reduce once, on the last
backward of the step. Each rank backpropagates its shard's share of J(ℬ) as is, and the wrapper reduces
the gradients as a plain sum (``reduce_gradients_as_sum``): DDP and FSDP2 would average them, and scaling
the shares by D to undo that is not exact — Hugging Face's RMSNorm rounds upstream gradients to float32
even in a float64 model, and fl32(3g)/3 ≠ fl32(g).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from splitproof.hf_models import base_model_of

DP_STRATEGIES = ("none", "ddp", "fsdp2")


def is_ddp(model: nn.Module) -> bool:
    return isinstance(model, nn.parallel.DistributedDataParallel)


def is_fsdp2(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return False
    return isinstance(model, FSDPModule)


def wrap_model(
    model: nn.Module, strategy: str, *, device: torch.device | str | None = None, init_sync: bool = True
) -> nn.Module:
    """DDP: ``DistributedDataParallel``; FSDP2: ``fully_shard`` each decoder layer, then the root. Either
    way gradients are reduced as a sum (:func:`reduce_gradients_as_sum`).

    ``init_sync=False`` skips DDP's broadcast of rank 0's parameters, for ranks that hold the same
    parameters by construction (forked from one process): the broadcast writes every parameter, which
    would give each forked rank a private copy of pages it could otherwise keep sharing. ``device``: the
    rank's device (None: where the model's parameters are)."""
    if strategy not in DP_STRATEGIES:
        raise ValueError(f"strategy: unknown {strategy!r}; expected one of {', '.join(DP_STRATEGIES)}")
    if strategy == "none":
        return model
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"strategy {strategy!r} needs torch.distributed to be initialised (launch with torchrun)")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if strategy == "ddp":
        ids = (
            [device.index if device.index is not None else torch.cuda.current_device()]
            if device.type == "cuda"
            else None
        )
        # gradients as views into DDP's communication buckets: one gradient-sized buffer, not two
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=ids, gradient_as_bucket_view=True, init_sync=init_sync
        )
        return reduce_gradients_as_sum(ddp)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return reduce_gradients_as_sum(model)


def _sum_hook(group, bucket):
    """DDP communication hook: all-reduce the bucket as a sum (DDP's own reduction averages)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


_SUM_HOOK_FLAG = "_splitproof_sums_gradients"


def reduce_gradients_as_sum(model: nn.Module) -> nn.Module:
    """Make a DDP or FSDP2 model reduce gradients over ranks as a sum, not a mean (idempotent).

    DDP: a communication hook (a DDP model with a hook of its own is refused). FSDP2: gradient divide
    factor 1 with sum-only collectives, on every sharded module.
    """
    if is_ddp(model) and not getattr(model, _SUM_HOOK_FLAG, False):
        try:
            model.register_comm_hook(model.process_group, _sum_hook)
        except RuntimeError as exc:
            raise ValueError(
                "model: this DDP model already has a communication hook; splitproof needs gradients "
                "reduced as a sum: wrap the plain model with splitproof.engine.wrap_model"
            ) from exc
        setattr(model, _SUM_HOOK_FLAG, True)
    elif is_fsdp2(model):
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Hugging Face causal LM (``model.model.layers``, inside a LoRA wrapper too),
    else none."""
    inner = getattr(base_model_of(model), "model", None)
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
