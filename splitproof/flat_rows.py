"""Plain per-sequence lists laid out in one pass (the fast path of ``splitproof.sequences``).

The rows a run builds itself — lists of Python ints (token ids) and floats (log-probs) — become one flat
tensor each, padded by a boolean mask in row-major order, instead of one tensor per row. The values are
the same: each number is converted as ``torch.as_tensor`` converts it in a row of its own. Anything else
(tensors, NumPy arrays, bools, a negative id, a row of the wrong length) returns None, and the row-by-row
checks of ``splitproof.sequences`` then name the bad row.
"""

from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor

HOST = torch.device("cpu")


def plain_rows(rows, kinds: frozenset) -> tuple[list, list[int]] | None:
    """(every value of ``rows`` in order, each row's length) when ``rows`` is a list or tuple of lists or
    tuples whose values are all of the Python types ``kinds`` (``type(v) in kinds``: no bool for int)."""
    if type(rows) not in (list, tuple) or not all(type(r) in (list, tuple) for r in rows):
        return None
    flat = list(chain.from_iterable(rows))
    if not set(map(type, flat)) <= kinds:
        return None
    return flat, [len(r) for r in rows]


def end_mask(lengths: list[int], width: int, *, left: bool) -> Tensor:
    """[rows, width] bool: the last ``lengths[i]`` columns of row i (``left`` padding), else the first."""
    columns = torch.arange(width, device=HOST)
    n = torch.tensor(lengths, dtype=torch.long, device=HOST).unsqueeze(1)
    return columns >= width - n if left else columns < n


def padded(flat: Tensor, mask: Tensor, fill, dtype: torch.dtype) -> Tensor:
    """``mask``'s shape filled with ``fill``, ``flat``'s values at its True entries in row-major order."""
    out = torch.full(mask.shape, fill, dtype=dtype, device=HOST)
    out[mask] = flat
    return out


def int_tensor(values: list) -> Tensor | None:
    """Python ints as int64 (None when one does not fit in 64 bits)."""
    try:
        return torch.tensor(values, dtype=torch.long, device=HOST)
    except (RuntimeError, OverflowError):
        return None


def flat_token_fields(prompt_ids, response_ids, width_of, pad_token_id: int) -> dict[str, Tensor] | None:
    """``sequences.pad_tokens``'s layout (every response token in the loss) of plain int lists, or None;
    ``width_of(lengths)`` gives the responses' padded width (and raises on a response too long)."""
    prompts, responses = plain_rows(prompt_ids, INT), plain_rows(response_ids, INT)
    if prompts is None or responses is None or not prompts[1] or len(responses[1]) != len(prompts[1]):
        return None
    if min(prompts[1]) == 0 or (prompts[0] and min(prompts[0]) < 0) or (responses[0] and min(responses[0]) < 0):
        return None
    prompt_flat, response_flat = int_tensor(prompts[0]), int_tensor(responses[0])
    if prompt_flat is None or response_flat is None:
        return None
    prompt_mask = end_mask(prompts[1], max(prompts[1]), left=True)
    response_mask = end_mask(responses[1], width_of(responses[1]), left=False)
    return dict(
        prompts=padded(prompt_flat, prompt_mask, pad_token_id, torch.long),
        responses=padded(response_flat, response_mask, pad_token_id, torch.long),
        attention_mask=torch.cat([prompt_mask, response_mask], dim=1).long(),
        response_mask=response_mask.long(),
    )


def flat_per_token(rows, lengths: list[int], width: int, dtype: torch.dtype) -> Tensor | None:
    """``sequences.pad_per_token`` of plain float lists of exactly ``lengths``, or None."""
    plain = plain_rows(rows, FLOAT)
    if plain is None or plain[1] != list(lengths):
        return None
    return padded(torch.tensor(plain[0], dtype=dtype, device=HOST), end_mask(lengths, width, left=False), 0.0, dtype)


INT = frozenset({int})
FLOAT = frozenset({float})
