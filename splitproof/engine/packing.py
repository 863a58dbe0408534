"""Padding-free microbatches: several sequences share a row, each attending only to itself.

A microbatch's sequences (prompt then response, back to back) are packed first-fit-decreasing into rows
of one width, chosen between its longest sequence and three times that (or one row for everything) to
compute the fewest tokens. Position ids restart at every sequence and a block-diagonal causal mask keeps
sequences apart, so each sequence's log-probs are those it has alone (identical in float64 with sdpa
attention). A sequence's length here is its span (``RolloutBatch.token_spans``): padding inside it
travels with it, so every layout the batch accepts packs correctly. Padding is what bin packing leaves over; a row's
dense attention stays within 9× a padded
row's (varlen kernels on a GPU would not pay for the masked blocks at all).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.engine.attention import attention_mask


def pack_into_rows(lengths: list[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices of ``lengths`` grouped into rows of at most ``width`` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for k in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        slot = next((r for r, room in enumerate(free) if room >= lengths[k]), None)
        if slot is None:
            rows.append([])
            free.append(width)
            slot = len(rows) - 1
        rows[slot].append(k)
        free[slot] -= lengths[k]
    return rows


WIDTH_STEPS = 16  # candidate row widths: longest × (1 + i/16) up to 3 × longest, or one row for everything
MAX_WIDTH_FACTOR = 3


class RowPacking:
    """First-fit packing of sequences arriving longest first, tracked for every candidate row width.

    Lets the token-budget planner grow a microbatch one sequence at a time at O(widths × rows) a step;
    ``row_width`` replays the same packing, so the planner's cost is what the forward computes.
    """

    def __init__(self, longest: int):
        self.widths = sorted(
            {longest + (longest * i) // WIDTH_STEPS for i in range(WIDTH_STEPS * (MAX_WIDTH_FACTOR - 1) + 1)}
        )
        self.free: list[list[int]] = [[] for _ in self.widths]
        self.total = 0

    def _options(self, extra: int = 0) -> list[tuple[int, int]]:
        """(computed tokens, width) of each choice, with ``extra`` more tokens placed in each."""
        total = self.total + extra
        options = [(total, total)] if total <= self.widths[-1] else []  # everything in one row
        for width, free in zip(self.widths, self.free):
            if width < total:
                rows = len(free) + (extra > 0 and not any(room >= extra for room in free))
                options.append((rows * width, width))
        return options

    def cost_with(self, length: int) -> int:
        return min(self._options(length))[0]

    def add(self, length: int) -> None:
        for width, free in zip(self.widths, self.free):
            slot = next((r for r, room in enumerate(free) if room >= length), None)
            if slot is None:
                free.append(width)
                slot = len(free) - 1
            free[slot] -= length
        self.total += length

    def best(self) -> tuple[int, int]:
        """(computed tokens, row width) of the cheapest choice; ties go to the narrower row."""
        return min(self._options())


def _packing_of(lengths: list[int]) -> RowPacking:
    ordered = sorted(lengths, reverse=True)
    packing = RowPacking(ordered[0])
    for length in ordered:
        packing.add(length)
    return packing


def row_width(lengths: list[int]) -> int:
    """Width of a packed microbatch's rows: the candidate in [longest, 3 × longest] (one row for all, if
    that is narrower) whose first-fit packing computes the fewest tokens (ties: the narrower row)."""
    return _packing_of(lengths).best()[1]


def packed_cost(lengths: list[int]) -> int:
    """Tokens a packed microbatch computes, padding included: rows × row width."""
    return _packing_of(lengths).best()[0] if lengths else 0


def packed_outputs(model: nn.Module, batch: RolloutBatch, *, logits_of, dtype: torch.dtype):
    """The model's outputs at the positions that predict response tokens, computed on packed rows:
    ``(outputs [n, C], seq_index [n], resp_index [n], ids [b, P + T])`` — output k belongs to response
    position ``resp_index[k]`` of row ``seq_index[k]``, predicted from the token before it.

    A sequence occupies its span — from its first to its last real token, padding inside included (as a
    token 0 that no query sees, with the position of the real token before it) — so every layout the batch
    contract accepts gets the outputs of its padded row.
    """
    P = batch.prompt_width
    attention = batch.attention_mask.bool()
    starts = (P - batch.prompt_spans()).tolist()
    lengths = batch.token_spans().tolist()
    width = row_width(lengths)
    layout = pack_into_rows(lengths, width)
    device = batch.responses.device
    ids = torch.where(attention, batch.input_ids, torch.zeros_like(batch.input_ids)).long()

    input_ids = torch.zeros(len(layout), width, dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    segment = torch.full_like(input_ids, -1)
    real = torch.zeros(len(layout), width, dtype=torch.bool, device=device)
    rows_index, cols_index, seq_index, resp_index = [], [], [], []
    for row, members in enumerate(layout):
        offset = 0
        for i in members:
            span = slice(starts[i], starts[i] + lengths[i])
            place = slice(offset, offset + lengths[i])
            input_ids[row, place] = ids[i, span]
            real[row, place] = attention[i, span]
            position_ids[row, place] = (attention[i, span].long().cumsum(0) - 1).clamp(min=0)
            segment[row, place] = i
            # response token j (column P + j) is predicted at the column before it
            predicted = attention[i, P:].nonzero().flatten().tolist()
            rows_index += [row] * len(predicted)
            cols_index += [offset + P + j - 1 - starts[i] for j in predicted]
            seq_index += [i] * len(predicted)
            resp_index += predicted
            offset += lengths[i]
    mask = attention_mask(segment, real, model, dtype)
    outputs = logits_of(model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False))
    rows_t = torch.tensor(rows_index, dtype=torch.long, device=device)
    cols_t = torch.tensor(cols_index, dtype=torch.long, device=device)
    seq_t = torch.tensor(seq_index, dtype=torch.long, device=device)
    resp_t = torch.tensor(resp_index, dtype=torch.long, device=device)
    return outputs[rows_t, cols_t], seq_t, resp_t, ids


def packed_response_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float,
    with_entropy: bool,
    logits_of,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """log π of the response tokens [b, T] (and entropy), computed on packed rows (:func:`packed_outputs`)."""
    b, P, T = len(batch), batch.prompt_width, batch.response_width
    device = batch.responses.device
    picked, seq_t, resp_t, ids = packed_outputs(model, batch, logits_of=logits_of, dtype=dtype)
    z = picked.float() if picked.dtype in (torch.bfloat16, torch.float16) else picked  # [n, V]
    if temperature != 1.0:
        z = z / temperature
    tokens = ids[seq_t, P + resp_t]
    logp = torch.log_softmax(z, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    out = torch.zeros(b, T, dtype=out_dtype, device=device).index_put((seq_t, resp_t), logp.to(out_dtype))
    entropy = None
    if with_entropy:
        h = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        entropy = torch.zeros(b, T, dtype=out_dtype, device=device).index_put((seq_t, resp_t), h.to(out_dtype))
    return out, entropy
