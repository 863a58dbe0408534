"""Mixed precision: parameters stored in one dtype, the model's products computed in another.

``compute_in(model, dtype)``: every call of ``model`` runs under ``torch.autocast(device, dtype)`` — the
matmuls (``F.linear``, ``bmm``, attention) take their inputs cast to ``dtype`` and sum in float32, the
backward follows the forward's dtypes, so the parameters, their gradients (and so the DDP/FSDP2 gradient
reductions) and the optimizer state stay in the storage dtype. ``dtype`` None, or the storage dtype itself,
leaves the model as it is. A float64 model is never autocast (an error): float64 is the exactness lane.

The fixed-row products (``engine.row_invariant``) keep their guarantee under it: the rows are padded to the
fixed shape before the product, and autocast only casts the product's inputs.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn

COMPUTE_ATTR = "splitproof_compute_dtype"


def _autocast_forward(self: nn.Module, *args, **kwargs):
    dtype = getattr(self, COMPUTE_ATTR)
    device_type = next(self.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype):
        return type(self).forward(self, *args, **kwargs)


def compute_in(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """``model`` (the same object) computing in ``dtype`` under autocast (module docstring)."""
    storage = {p.dtype for p in model.parameters()}
    if dtype is None or storage == {dtype}:
        return model
    if torch.float64 in storage:
        raise ValueError(f"a float64 model is never autocast (asked for {dtype}): float64 computes in float64")
    setattr(model, COMPUTE_ATTR, dtype)
    # a bound method: copy.deepcopy of the model (a frozen reference) rebinds it to the copy
    model.forward = types.MethodType(_autocast_forward, model)
    return model


def compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype ``compute_in`` set on ``model`` (None: it computes in its parameters' dtype)."""
    return getattr(model, COMPUTE_ATTR, None)


def autocast_for(model: nn.Module):
    """A context computing in ``model``'s compute dtype, for code that calls its submodules directly."""
    dtype = compute_dtype(model)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(next(model.parameters()).device.type, dtype=dtype)
