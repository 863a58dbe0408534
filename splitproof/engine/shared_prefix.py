"""Shared-prefix forwards (verl's ``use_prefix_grouper``): each distinct prompt of a microbatch computed once.

The n samples of a GRPO group share their prompt, and a padded forward computes it n times. Here a
microbatch's rows are grouped by prompt (:func:`prompt_groups`: the same tokens on the same columns of
the span from the first real prompt token to the end of the prompt block — a function of the row alone);
one **prompt pass** computes every distinct prompt once (its KV cache, and the logits of its last column,
which predict response token 0); the cache is expanded to the rows (``index_select``: in the update the
gradient of every sample flows back into its prompt's pass, summed) and one **response pass** runs only
the response tokens against it. Response token j + 1 is predicted at response column j, so the last
response token is never an input. Both passes lay their rows out as the padded forward does — prompt
columns left-padded, responses right-padded, ``position_ids = cumsum(attention_mask) - 1`` over the whole
row, the engine's own attention mask (``engine.attention``) — so a row's numbers are a function of the
row and the weights: under ``engine.row_invariant`` (the no-grad passes) bitwise so, whatever else shares
its microbatch.

Against the padded forward the same function is computed with other roundings (the response queries
attend keys of two products instead of one); measured in float64 in ``tests/test_shared_prefix.py``.
Computed tokens per group of n samples: prompt + n × response instead of n × (prompt + response).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from splitproof.batch import BatchError, RolloutBatch, TokenLayout
from splitproof.engine.attention import attention_mask
from splitproof.engine.forward_output import cache_keyword, cache_of, logits_of, takes_logits_to_keep

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def prompt_groups(batch: TokenLayout) -> tuple[list[int], list[int]]:
    """(the group of each row, the first row of each group): rows whose prompt spans hold the same tokens
    on the same columns share a group; groups are numbered in order of first appearance."""
    P = batch.prompt_width
    attention = batch.attention_mask[:, :P].bool()
    ids = torch.where(attention, batch.prompts, torch.zeros_like(batch.prompts)).tolist()
    real = attention.tolist()
    starts = (P - batch.prompt_spans()).tolist()
    seen: dict[tuple, int] = {}
    groups, firsts = [], []
    for row, start in enumerate(starts):
        key = (tuple(ids[row][start:]), tuple(real[row][start:]))
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(row)
        groups.append(seen[key])
    return groups, firsts


def _cache_of(out):
    cache = cache_of(out)
    if cache is None:
        raise RuntimeError(
            "actor_rollout_ref.actor.use_prefix_grouper: the model returned no KV cache for the prompt pass "
            "(activation checkpointing turns the cache off in training); set use_prefix_grouper=false"
        )
    return cache


def _expand_cache(cache, index: Tensor):
    """The cache's batch rows ``index`` (repeats allowed), differentiably."""
    layers = getattr(cache, "layers", None)
    if layers is None:  # a legacy tuple cache
        return tuple(tuple(t.index_select(0, index) for t in layer) for layer in cache)
    for layer in layers:
        layer.keys = layer.keys.index_select(0, index)
        layer.values = layer.values.index_select(0, index)
    return cache


def shared_prefix_outputs(model: nn.Module, batch: RolloutBatch, p0: int, t1: int, dtype: torch.dtype):
    """The model's outputs [b, t1, C] at the positions predicting response tokens 0..t1-1 (prompt pass +
    response pass, module docstring), the response tokens [b, t1] and their attention [b, t1].
    ``p0``/``t1``: the microbatch's window (``engine.logprobs.response_window``)."""
    P = batch.prompt_width
    device = batch.responses.device
    attention = batch.attention_mask.bool()
    groups, firsts = prompt_groups(batch)
    index = torch.tensor(groups, dtype=torch.long, device=device)
    first = torch.tensor(firsts, dtype=torch.long, device=device)
    prompt_att = attention.index_select(0, first)[:, p0:P]  # [g, Pw]
    prompt_ids = batch.prompts.index_select(0, first)[:, p0:]
    prompt_ids = torch.where(prompt_att, prompt_ids, torch.zeros_like(prompt_ids))
    mask = None if bool(prompt_att.all()) else attention_mask(None, prompt_att, model, dtype)
    keep = {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}
    out = model(
        input_ids=prompt_ids,
        attention_mask=mask,
        position_ids=(prompt_att.long().cumsum(-1) - 1).clamp(min=0),
        use_cache=True,
        **keep,
    )
    outputs = logits_of(out)[:, -1:].index_select(0, index)  # [b, 1, C]: predicts response token 0
    resp_att = attention[:, P : P + t1]
    tokens = torch.where(resp_att, batch.responses[:, :t1], torch.zeros_like(batch.responses[:, :t1]))
    if t1 > 1:
        width = prompt_att.shape[1]
        keys_att = torch.cat([prompt_att.index_select(0, index), resp_att[:, :-1]], dim=1)  # [b, Pw + t1 - 1]
        full = attention_mask(None, keys_att, model, dtype)
        cache = _expand_cache(_cache_of(out), index)
        following = model(
            input_ids=tokens[:, :-1],
            attention_mask=full[:, :, width:],
            position_ids=(keys_att.long().cumsum(-1) - 1).clamp(min=0)[:, width:],
            use_cache=True,
            **{cache_keyword(model): cache},
        )
        outputs = torch.cat([outputs, logits_of(following)], dim=1)
    return outputs, tokens, resp_att


def shared_prefix_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    p0: int,
    t1: int,
    *,
    temperature: float,
    with_entropy: bool,
    dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """log π of the response tokens [b, T] (zeros past each response) and the entropy [b, T] of the
    temperature-scaled distribution, from :func:`shared_prefix_outputs`. Differentiable."""
    T = batch.response_width
    logits, tokens, valid = shared_prefix_outputs(model, batch, p0, t1, dtype)
    z = logits.float() if logits.dtype in _LOW_PRECISION else logits
    if temperature != 1.0:
        z = z / temperature
    logp = torch.log_softmax(z, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    logp = F.pad(torch.where(valid, logp, torch.zeros_like(logp)), (0, T - t1)).to(out_dtype)
    entropy = None
    if with_entropy:
        h = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        entropy = F.pad(torch.where(valid, h, torch.zeros_like(h)), (0, T - t1)).to(out_dtype)
    return logp, entropy


def grouped_microbatches(
    batch: TokenLayout, micro_batch_size: int | None, max_token_len: int | None, field: str
) -> list[list[int]]:
    """Rows of each microbatch of a shared-prefix no-grad pass, a group's rows kept together: rows in order
    of (group's first appearance, row), cut into ``micro_batch_size`` rows or under a ``max_token_len``
    budget on the tokens the two passes compute (distinct prompts × widest prompt + rows × widest response).
    Exactly one of the two; the cut never changes a value (the passes are row-invariant)."""
    if (micro_batch_size is None) == (max_token_len is None):
        raise BatchError(field, "give exactly one of micro_batch_size or max_token_len")
    groups, _ = prompt_groups(batch)
    order = sorted(range(len(batch)), key=lambda r: (groups[r], r))
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise BatchError(field, f"must be >= 1, got {micro_batch_size}")
        return [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    prompts, responses = batch.prompt_spans().tolist(), batch.response_spans().tolist()
    microbatches: list[list[int]] = []
    current: list[int] = []
    distinct, prompt_width, response_width = set(), 0, 0
    for row in order:
        if prompts[row] + responses[row] > max_token_len:
            raise BatchError(
                field.replace("micro_batch_size_per_gpu", "max_token_len_per_gpu"),
                f"sequence {int(batch.seq_ids[row])} has {prompts[row] + responses[row]} tokens > budget "
                f"{max_token_len}; raise the budget (a sequence is never split)",
                sequence=int(batch.seq_ids[row]),
            )
        wider = (len(distinct | {groups[row]}), max(prompt_width, prompts[row]), max(response_width, responses[row]))
        if current and wider[0] * wider[1] + (len(current) + 1) * wider[2] > max_token_len:
            microbatches.append(current)
            current, distinct, prompt_width, response_width = [], set(), 0, 0
        current.append(row)
        distinct.add(groups[row])
        prompt_width, response_width = max(prompt_width, prompts[row]), max(response_width, responses[row])
    if current:
        microbatches.append(current)
    return microbatches
