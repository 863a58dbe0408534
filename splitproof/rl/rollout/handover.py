"""The weight hand-over of a pipelined run, one copy per tensor: tied weights travel once.

A model with tied weights (the input embedding doubling as the output layer, as in SmolLM2 and the
built-in model) lists one tensor under several names in its ``state_dict``. The trainer copies each
distinct tensor once into a shared-memory buffer (keyed by the first name it has); the rollout process
ties its own model the same way (every other name made the same parameter) and copies each buffer
tensor once, so its tied weights stay one tensor.
"""

from __future__ import annotations

import torch
from torch import nn


def aliases(weights: dict[str, torch.Tensor]) -> dict[str, str]:
    """{name: the first name of the same tensor} for every name that repeats an earlier one — the same
    storage, offset, shape, stride and dtype (a tie). Empty tensors are never aliases."""
    first: dict[tuple, str] = {}
    repeats = {}
    for name, tensor in weights.items():
        if tensor.numel() == 0:
            continue
        key = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tensor.stride(),
            tensor.dtype,
        )
        if key in first:
            repeats[name] = first[key]
        else:
            first[key] = name
    return repeats


def shared_buffer(weights: dict[str, torch.Tensor], tied: dict[str, str]) -> dict[str, torch.Tensor]:
    """A shared-memory copy of every weight but the aliases (``tied``), on the host whatever the weights'
    device (each process copies them to its own)."""
    return {n: t.detach().to("cpu", copy=True).share_memory_() for n, t in weights.items() if n not in tied}


def tie(model: nn.Module, tied: dict[str, str]) -> None:
    """Make each alias in ``tied`` the same parameter (or buffer) as the name it repeats."""
    for alias, name in tied.items():
        module_name, _, attr = alias.rpartition(".")
        module = model.get_submodule(module_name)
        if attr in module._parameters:
            setattr(module, attr, model.get_parameter(name))
        else:
            module.register_buffer(attr, model.get_buffer(name))


@torch.no_grad()
def copy_weights(target: dict[str, torch.Tensor], source: dict[str, torch.Tensor]) -> None:
    """``target[name] = source[name]`` in place, for every name of ``source``."""
    for name, tensor in source.items():
        target[name].copy_(tensor)
