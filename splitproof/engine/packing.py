"""Padding-free microbatches: several sequences share a row, each attending only to itself.

A microbatch's sequences (prompt then response, back to back) are packed first-fit-decreasing into rows
of one width, chosen between its longest sequence and three times that (or one row for everything) to
compute the fewest tokens. Position ids restart at every sequence and a block-diagonal causal mask keeps
sequences apart, so each sequence's log-probs are those it has alone (identical in float64 with sdpa
attention). Padding is what bin packing leaves over; a row's dense attention stays within 9× a padded
row's (varlen kernels on a GPU would not pay for the masked blocks at all).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch


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
        self.widths = sorted({longest + (longest * i) // WIDTH_STEPS for i in range(WIDTH_STEPS * (MAX_WIDTH_FACTOR - 1) + 1)})
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


def packed_response_log_probs(model: nn.Module, batch: RolloutBatch, *, temperature: float, with_entropy: bool,
                              logits_of, out_dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """log π of the response tokens [b, T] (and entropy), computed on packed rows."""
    b, P, T = len(batch), batch.prompt_width, batch.response_width
    attention = batch.attention_mask.bool()
    prompt_lengths = attention[:, :P].sum(dim=1).tolist()
    response_lengths = attention[:, P:].sum(dim=1).tolist()
    lengths = [p + r for p, r in zip(prompt_lengths, response_lengths)]
    width = row_width(lengths)
    layout = pack_into_rows(lengths, width)
    device = batch.responses.device

    input_ids = torch.zeros(len(layout), width, dtype=torch.long, device=device)
    position_ids = torch.zeros_like(input_ids)
    segment = torch.full_like(input_ids, -1)
    placed = []  # (sequence, row, offset)
    for row, members in enumerate(layout):
        offset = 0
        for i in members:
            tokens = torch.cat([batch.prompts[i, P - prompt_lengths[i]:], batch.responses[i, :response_lengths[i]]])
            input_ids[row, offset:offset + lengths[i]] = tokens
            position_ids[row, offset:offset + lengths[i]] = torch.arange(lengths[i], device=device)
            segment[row, offset:offset + lengths[i]] = i
            placed.append((i, row, offset))
            offset += lengths[i]
    same = segment[:, :, None] == segment[:, None, :]
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    padding = segment[:, :, None] < 0
    # padding queries attend to themselves only, so no softmax row is empty
    mask = ((same & (segment[:, :, None] >= 0)) | (padding & torch.eye(width, dtype=torch.bool, device=device))) & causal
    logits = logits_of(model(input_ids=input_ids, attention_mask=mask[:, None], position_ids=position_ids,
                             use_cache=False))
    z = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if temperature != 1.0:
        z = z / temperature

    rows_index, cols_index, seq_index, resp_index = [], [], [], []
    for i, row, offset in placed:
        r = response_lengths[i]
        if r:
            start = offset + prompt_lengths[i] - 1  # the last prompt token predicts the first response token
            rows_index += [row] * r
            cols_index += list(range(start, start + r))
            seq_index += [i] * r
            resp_index += list(range(r))
    rows_t = torch.tensor(rows_index, dtype=torch.long, device=device)
    cols_t = torch.tensor(cols_index, dtype=torch.long, device=device)
    seq_t = torch.tensor(seq_index, dtype=torch.long, device=device)
    resp_t = torch.tensor(resp_index, dtype=torch.long, device=device)
    picked = z[rows_t, cols_t]  # [n, V]: only the positions that predict response tokens
    tokens = batch.responses[seq_t, resp_t]
    logp = torch.log_softmax(picked, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    out = torch.zeros(b, T, dtype=out_dtype, device=device).index_put((seq_t, resp_t), logp.to(out_dtype))
    entropy = None
    if with_entropy:
        h = torch.logsumexp(picked, dim=-1) - (torch.softmax(picked, dim=-1) * picked).sum(dim=-1)
        entropy = torch.zeros(b, T, dtype=out_dtype, device=device).index_put((seq_t, resp_t), h.to(out_dtype))
    return out, entropy



