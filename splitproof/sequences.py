"""The fields of a :class:`~splitproof.batch.RolloutBatch` from plain per-sequence lists
(``RolloutBatch.from_sequences``).

Row i of the batch is sequence i of the lists. Prompts are left-padded and responses right-padded with
``pad_token_id``; the attention mask marks the real tokens of both; per-token values are padded with 0
(padding is never read). Every list is checked row by row first, so that an error names the field and the
row (``old_log_probs[3]: 5 values for 6 response tokens``); ``RolloutBatch.from_sequences`` then builds
the batch and validates the whole contract. The layout is built on the host (``HOST``) and moved to a
device in one copy per field (``from_sequences(device=...)``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral, Real

import torch
from torch import Tensor

from .batch_error import BatchError
from .flat_rows import flat_per_token, flat_token_fields

HOST = torch.device("cpu")  # plain lists become tensors here, whatever device the batch goes to


def _rows(name: str, values, count: int | None) -> list:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
        raise BatchError(name, f"must be a list with one entry per sequence, got {type(values).__name__}")
    rows = list(values)
    if count is not None and len(rows) != count:
        raise BatchError(name, f"has {len(rows)} sequences, prompt_ids has {count}")
    return rows


def _row_tensor(name: str, row, i: int, dtype: torch.dtype | None = None) -> Tensor:
    """One row as a 1-D tensor (a list, tuple, NumPy array or tensor), read in ``dtype`` when given."""
    try:
        tensor = torch.as_tensor(row, dtype=dtype, device=HOST)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise BatchError(f"{name}[{i}]", f"not a list of numbers ({exc})") from None
    if tensor.dim() != 1:
        raise BatchError(f"{name}[{i}]", f"must be a flat list, got shape {tuple(tensor.shape)}")
    return tensor


def _token_ids(name: str, rows: list, allow_empty: bool) -> list[Tensor]:
    out = []
    for i, row in enumerate(rows):
        ids = _row_tensor(name, row, i)
        if ids.numel() == 0 and not allow_empty:
            raise BatchError(
                f"{name}[{i}]",
                "empty: the first response token is predicted from the prompt, so a prompt needs at least one token",
            )
        if ids.numel() and (ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool):
            raise BatchError(f"{name}[{i}]", f"token ids must be integers, got {ids.dtype}")
        if ids.numel() and int(ids.min()) < 0:
            raise BatchError(f"{name}[{i}]", f"negative token id {int(ids.min())}")
        out.append(ids.long())
    return out


def _per_token_row(name: str, row, i: int, n: int, dtype: torch.dtype) -> Tensor:
    values = _row_tensor(name, row, i, dtype)  # read in dtype: no detour through float32
    if values.numel() != n:
        raise BatchError(f"{name}[{i}]", f"{values.numel()} values for {n} response tokens (response_ids[{i}])")
    return values


def _per_token(name: str, rows: list, lengths: list[int], dtype: torch.dtype) -> list[Tensor]:
    return [_per_token_row(name, row, i, n, dtype) for i, (row, n) in enumerate(zip(rows, lengths))]


def _advantages(rows: list, lengths: list[int], dtype: torch.dtype) -> list[float | Tensor]:
    """Per row a float (one advantage for the sequence) or a tensor (one per response token)."""
    out: list[float | Tensor] = []
    for i, (row, n) in enumerate(zip(rows, lengths)):
        if (isinstance(row, Real) and not isinstance(row, bool)) or (isinstance(row, Tensor) and row.dim() == 0):
            out.append(float(row))
        elif hasattr(row, "__len__") and not isinstance(row, (str, bytes)):
            out.append(_per_token_row("advantages", row, i, n, dtype))
        else:
            raise BatchError(
                f"advantages[{i}]",
                f"must be a number or a list of one number per response token, got {type(row).__name__}",
            )
    return out


def _group_ids(values, count: int) -> Tensor:
    """One integer group id per sequence; an error names the row (``index[3]: ...``)."""
    rows = _rows("index", values.tolist() if hasattr(values, "tolist") else values, count)
    ids = []
    for i, g in enumerate(rows):
        if isinstance(g, Real) and not isinstance(g, Integral) and not math.isfinite(g):
            raise BatchError(f"index[{i}]", f"non-finite group id {g!r}")
        if isinstance(g, bool) or not isinstance(g, Integral):
            raise BatchError(f"index[{i}]", f"a group id must be an integer, got {g!r}")
        if not -(2**63) <= int(g) < 2**63:
            raise BatchError(f"index[{i}]", f"group id {int(g)} does not fit in 64 bits")
        ids.append(int(g))
    return torch.tensor(ids, dtype=torch.long, device=HOST)


def _pad(rows: Sequence[Tensor], width: int, fill, dtype: torch.dtype, *, left: bool) -> Tensor:
    out = torch.full((len(rows), width), fill, dtype=dtype, device=HOST)
    for i, row in enumerate(rows):
        n = row.numel()
        if n:
            if left:
                out[i, width - n :] = row
            else:
                out[i, :n] = row
    return out


def checked_masks(response_mask, count: int, lengths: list[int]) -> list[Tensor]:
    """The 0/1 mask of each response (default: every token), as integers."""
    if response_mask is None:
        return [torch.ones(n, dtype=torch.long, device=HOST) for n in lengths]
    masks = _per_token("response_mask", _rows("response_mask", response_mask, count), lengths, torch.float64)
    for i, m in enumerate(masks):
        if not bool(((m == 0) | (m == 1)).all()):
            raise BatchError(f"response_mask[{i}]", "must contain only 0 and 1")
    return [m.long() for m in masks]


def check_pad_token_id(pad_token_id) -> None:
    if not isinstance(pad_token_id, Integral) or isinstance(pad_token_id, bool) or pad_token_id < 0:
        raise BatchError("pad_token_id", f"must be an integer >= 0, got {pad_token_id!r}")


def checked_tokens(prompt_ids, response_ids) -> tuple[list[Tensor], list[Tensor]]:
    """Every prompt (at least one token) and response as a 1-D integer tensor, one per sequence."""
    prompts = _token_ids("prompt_ids", _rows("prompt_ids", prompt_ids, None), allow_empty=False)
    if len(prompts) == 0:
        raise BatchError("prompt_ids", "no sequences")
    responses = _token_ids("response_ids", _rows("response_ids", response_ids, len(prompts)), allow_empty=True)
    return prompts, responses


def response_width_of(lengths: list[int], response_width: int | None) -> int:
    """The responses' padded width: ``response_width`` (a fixed width, e.g. ``data.max_response_length``),
    else the longest response."""
    if response_width is None:
        return max(lengths)
    if not isinstance(response_width, Integral) or isinstance(response_width, bool) or response_width < 0:
        raise BatchError("response_width", f"must be an integer >= 0, got {response_width!r}")
    longest = max(range(len(lengths)), key=lambda i: lengths[i])
    if lengths[longest] > response_width:
        raise BatchError(f"response_ids[{longest}]", f"{lengths[longest]} tokens > response_width {response_width}")
    return int(response_width)


def pad_tokens(
    prompts: list[Tensor], responses: list[Tensor], masks: list[Tensor], width: int, pad_token_id: int
) -> dict[str, Tensor]:
    """The padded token layout (checked rows in): prompts left-padded, responses right-padded to ``width``
    with ``pad_token_id``; ``attention_mask`` 1 on the real tokens of both, ``response_mask`` as given."""
    prompt_width = max(p.numel() for p in prompts)
    lengths = [r.numel() for r in responses]
    real_prompt = [torch.ones(p.numel(), dtype=torch.long, device=HOST) for p in prompts]
    real_response = [torch.ones(n, dtype=torch.long, device=HOST) for n in lengths]
    return dict(
        prompts=_pad(prompts, prompt_width, pad_token_id, torch.long, left=True),
        responses=_pad(responses, width, pad_token_id, torch.long, left=False),
        attention_mask=torch.cat(
            [
                _pad(real_prompt, prompt_width, 0, torch.long, left=True),
                _pad(real_response, width, 0, torch.long, left=False),
            ],
            dim=1,
        ),
        response_mask=_pad(masks, width, 0, torch.long, left=False),
    )


def token_fields(
    prompt_ids, response_ids, *, response_mask=None, response_width: int | None = None, pad_token_id: int = 0
) -> dict[str, Tensor]:
    """The token layout of plain per-sequence lists (``TokenBatch.from_sequences``): every row checked."""
    check_pad_token_id(pad_token_id)
    if response_mask is None:  # plain int lists (the run's own samples): one pass, the same layout
        fast = flat_token_fields(prompt_ids, response_ids, lambda n: response_width_of(n, response_width), pad_token_id)
        if fast is not None:
            return fast
    prompts, responses = checked_tokens(prompt_ids, response_ids)
    lengths = [r.numel() for r in responses]
    masks = checked_masks(response_mask, len(prompts), lengths)
    return pad_tokens(prompts, responses, masks, response_width_of(lengths, response_width), pad_token_id)


def pad_per_token(name: str, rows, lengths: list[int], width: int, dtype: torch.dtype) -> Tensor:
    """One value per response token of each row (checked against ``lengths``), right-padded with 0 to
    ``width`` in ``dtype``."""
    fast = flat_per_token(rows, lengths, width, dtype)  # plain float lists: one pass, the same values
    if fast is not None:
        return fast
    return _pad(_per_token(name, _rows(name, rows, len(lengths)), lengths, dtype), width, 0.0, dtype, left=False)


def fields_from_sequences(
    prompt_ids,
    response_ids,
    old_log_probs,
    advantages,
    *,
    response_mask=None,
    ref_log_probs=None,
    rollout_is_weights=None,
    values=None,
    returns=None,
    seq_ids=None,
    index=None,
    pad_token_id: int = 0,
    dtype: torch.dtype = torch.float32,
    response_width: int | None = None,
) -> dict[str, Tensor | None]:
    """The keyword arguments of ``RolloutBatch(...)``; see :meth:`RolloutBatch.from_sequences`."""
    check_pad_token_id(pad_token_id)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise BatchError("dtype", f"must be a floating-point torch dtype, got {dtype!r}")
    prompts, responses = checked_tokens(prompt_ids, response_ids)
    count = len(prompts)
    lengths = [r.numel() for r in responses]
    old = _per_token("old_log_probs", _rows("old_log_probs", old_log_probs, count), lengths, dtype)
    adv = _advantages(_rows("advantages", advantages, count), lengths, dtype)
    optional = {}
    for name, rows in (
        ("ref_log_probs", ref_log_probs),
        ("rollout_is_weights", rollout_is_weights),
        ("values", values),
        ("returns", returns),
    ):
        if rows is not None:
            optional[name] = _per_token(name, _rows(name, rows, count), lengths, dtype)
    masks = checked_masks(response_mask, count, lengths)
    if seq_ids is not None:
        ids = _row_tensor("seq_ids", seq_ids, 0) if not isinstance(seq_ids, Tensor) else seq_ids
        if ids.dim() != 1 or ids.numel() != count:
            raise BatchError("seq_ids", f"must hold one id per sequence ({count}), got shape {tuple(ids.shape)}")
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise BatchError("seq_ids", f"must be integers, got {ids.dtype}")
        seq_ids = ids.long()
    if index is not None:
        index = _group_ids(index, count)

    width = response_width_of(lengths, response_width)
    if any(isinstance(a, Tensor) for a in adv):  # per token; a number broadcasts over its row
        adv_rows = [
            a if isinstance(a, Tensor) else torch.full((n,), a, dtype=dtype, device=HOST) for a, n in zip(adv, lengths)
        ]
        adv_tensor = _pad(adv_rows, width, 0.0, dtype, left=False)
    else:
        adv_tensor = torch.tensor(adv, dtype=dtype, device=HOST)
    return dict(
        **pad_tokens(prompts, responses, masks, width, pad_token_id),
        old_log_probs=_pad(old, width, 0.0, dtype, left=False),
        advantages=adv_tensor,
        seq_ids=seq_ids,
        index=index,
        **{name: _pad(rows, width, 0.0, dtype, left=False) for name, rows in optional.items()},
    )
