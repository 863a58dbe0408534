"""Padding-free microbatches: several sequences share a row, each attending only to itself.

A microbatch's sequences (prompt then response, back to back) are packed first-fit-decreasing into rows
twice as wide as its longest sequence (or one row, if all fit). Position ids restart at every sequence
and a block-diagonal causal mask keeps sequences apart, so each sequence's log-probs are those it has
alone (identical in float64 with sdpa attention). Padding is what bin packing leaves over — little, since
no sequence takes more than half a row — and a row's dense attention stays within 4× a padded row's.
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


def row_width(lengths: list[int]) -> int:
    """Width of a packed microbatch's rows: twice its longest sequence, or all of it in one row."""
    return min(2 * max(lengths), sum(lengths))


def packed_cost(lengths: list[int]) -> int:
    """Tokens a packed microbatch computes, padding included: rows × row width."""
    if not lengths:
        return 0
    width = row_width(lengths)
    return len(pack_into_rows(lengths, width)) * width


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



