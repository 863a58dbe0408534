"""Validation and conversion of estimator inputs.

Everything is computed in float64 on the CPU: ``float64_copy`` makes that copy of a tensor (after
checking it), ``mask_copy`` turns a 0/1 mask of any dtype into float64, and ``group_rows`` groups the rows
by their hashable ids.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..batch import BatchError, check_binary_mask
from .errors import AdvantageError


def float64_copy(estimator: str, name: str, value, shape: tuple[int, ...]) -> Tensor:
    """A detached float64 CPU copy of a finite floating-point tensor of the given shape."""
    if not isinstance(value, Tensor):
        raise AdvantageError(estimator, f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise AdvantageError(estimator, f"{name} must be a floating-point tensor, got {value.dtype}")
    if tuple(value.shape) != shape:
        raise AdvantageError(estimator, f"{name} must have shape {list(shape)}, got {list(value.shape)}")
    copy = value.detach().to(device="cpu", dtype=torch.float64)
    bad = ~torch.isfinite(copy)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise AdvantageError(estimator, f"{name} (row {row}): non-finite value")
    return copy


def mask_copy(estimator: str, response_mask, shape: tuple[int, ...]) -> Tensor:
    """``response_mask`` (bool, integer or float, values 0/1) as a float64 CPU tensor."""
    if not isinstance(response_mask, Tensor):
        raise AdvantageError(estimator, f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    if tuple(response_mask.shape) != shape:
        raise AdvantageError(
            estimator,
            f"response_mask shape {list(response_mask.shape)} does not match token_level_rewards {list(shape)}",
        )
    try:
        as_bool = check_binary_mask("response_mask", response_mask.detach().cpu())
    except BatchError as error:
        raise AdvantageError(estimator, str(error).replace("(sequence", "(row")) from error
    return as_bool.to(torch.float64)


@dataclass(frozen=True)
class Groups:
    """Rows grouped by their id: ``members[g]`` lists the rows (in row order) whose id is ``ids[g]``."""

    members: list[list[int]]
    ids: list


def group_rows(estimator: str, index, batch_size: int) -> Groups:
    """Group the rows by ``index``: one hashable id per row (a list/tuple, NumPy array or tensor of ints,
    strings, ...), as verl passes its ``uid`` array. Rows with equal ids form a group."""
    if index is None:
        raise AdvantageError(estimator, "needs index (one group id per row, e.g. the prompt uid)")
    if getattr(index, "ndim", 1) != 1:
        raise AdvantageError(estimator, f"index must be one-dimensional, got {index.ndim} dimensions")
    ids = index.tolist() if hasattr(index, "tolist") else index
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise AdvantageError(estimator, f"index must be a sequence of group ids, got {type(index).__name__}")
    if len(ids) != batch_size:
        raise AdvantageError(estimator, f"index has {len(ids)} ids for {batch_size} rows")
    number: dict[Hashable, int] = {}
    groups = Groups(members=[], ids=[])
    for row, key in enumerate(ids):
        try:
            if isinstance(key, float) and math.isnan(key):
                raise TypeError("NaN never equals itself")
            g = number.setdefault(key, len(number))
        except TypeError as error:
            raise AdvantageError(estimator, f"index (row {row}): {key!r} is not a usable group id") from error
        if g == len(groups.members):
            groups.members.append([])
            groups.ids.append(key)
        groups.members[g].append(row)
    return groups
