"""Per-token log-probs (and entropy) of the response tokens under a causal LM.

A microbatch is trimmed to its own real width first (all-padding prompt columns on the left, all-padding
response columns on the right), and logits are computed only for the positions that predict response
tokens. With ``position_ids = cumsum(attention_mask) - 1`` and the engine's own attention mask
(``engine.attention``) a row's result does not depend on which other rows share its microbatch (exactly
so in float64 with sdpa attention).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from splitproof.batch import BatchError, RolloutBatch, TokenLayout
from splitproof.engine.attention import attention_mask, check_attention
from splitproof.engine.forward_output import logits_of, takes_logits_to_keep
from splitproof.engine.microbatch import budget_microbatches, fixed_microbatches
from splitproof.engine.packing import packed_response_log_probs
from splitproof.engine.row_invariant import aligned_width, row_invariant, rows_per_forward
from splitproof.loss_config import ConfigError

_LOW_PRECISION = (torch.bfloat16, torch.float16)


def param_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (torch's default without one)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def output_dtypes(model: nn.Module) -> tuple[torch.dtype, torch.dtype]:
    """(the model's parameter dtype, the dtype its per-token results are kept in: float32 for bf16/fp16)."""
    dtype = param_dtype(model)
    return dtype, (torch.float32 if dtype in _LOW_PRECISION else dtype)


def response_window(batch: RolloutBatch) -> tuple[int, int]:
    """(p0, t1): the microbatch trimmed to prompt columns p0.. and response columns ..t1 (t1 = 0: no
    response token to compute). A sequence with response tokens and no prompt token is a BatchError."""
    P = batch.prompt_width
    attention = batch.attention_mask.bool()
    prompt_att, resp_att = attention[:, :P], attention[:, P:]
    # Trim: leading prompt columns and trailing response columns that are padding in every row.
    prompt_cols = prompt_att.any(dim=0).nonzero()
    p0 = int(prompt_cols[0]) if len(prompt_cols) else P
    resp_cols = resp_att.any(dim=0).nonzero()
    t1 = int(resp_cols[-1]) + 1 if len(resp_cols) else 0
    if t1 == 0:
        return p0, 0
    no_prompt = resp_att.any(dim=1) & ~prompt_att.any(dim=1)
    if no_prompt.any():
        row = int(no_prompt.nonzero()[0, 0])
        raise BatchError(
            "prompts", "a sequence with response tokens needs at least one prompt token", int(batch.seq_ids[row])
        )
    return p0, t1


def padded_outputs(
    model: nn.Module, batch: RolloutBatch, p0: int, t1: int, dtype: torch.dtype, *, align_within: float = 0
):
    """The model's outputs [b, t1 + 1, C] at the last t1 + 1 positions of the trimmed padded rows —
    position j predicts response token j, the final one predicts nothing — with the trimmed input ids
    [b, L] and the response tokens' attention [b, t1].

    ``align_within`` (the no-grad passes on a CPU): masked columns on the right up to
    ``row_invariant.aligned_width`` where the rows × that width fit this token budget, so that no product of
    the layers needs filler rows (the LM head skips those columns); and the forward in pieces of
    ``row_invariant.rows_per_forward`` sequences, each row computed as in one forward of all."""
    P = batch.prompt_width
    attention = batch.attention_mask.bool()
    prompt_att, resp_att = attention[:, :P], attention[:, P:]
    input_ids = torch.cat([batch.prompts[:, p0:], batch.responses[:, :t1]], dim=1)
    mask = torch.cat([prompt_att[:, p0:], resp_att[:, :t1]], dim=1)
    input_ids = torch.where(mask, input_ids, torch.zeros_like(input_ids))  # pad ids may be out of vocabulary
    b, width = mask.shape
    # Without padding the mask is plain causal: the model's own causal path, no [b, L, L] mask to hold
    # (the widening's columns come after every real token, so causality keeps them out of sight too).
    causal = bool(mask.all())
    cpu = align_within and mask.device.type == "cpu"
    extra = aligned_width(b, width) - width if cpu else 0
    if extra and b * (width + extra) <= align_within:
        input_ids, mask = F.pad(input_ids, (0, extra)), F.pad(mask, (0, extra), value=causal)
    else:
        extra = 0
    position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(use_cache=False)
    kept = slice(width - t1 - 1, width)  # the positions that predict response tokens, and the last one
    if takes_logits_to_keep(model):  # the LM head on those alone, never on the widening's columns
        kwargs["logits_to_keep"] = t1 + 1 if not extra else torch.arange(kept.start, kept.stop, device=mask.device)
        kept = slice(None)
    piece = rows_per_forward(width + extra) if cpu else b
    outputs = [
        logits_of(
            model(
                input_ids=input_ids[s : s + piece],
                attention_mask=None if causal else attention_mask(None, mask[s : s + piece], model, dtype),
                position_ids=position_ids[s : s + piece],
                **kwargs,
            )
        )[:, kept]
        for s in range(0, b, piece)
    ]
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs)), input_ids[:, :width], resp_att[:, :t1]


def response_log_probs(
    model: nn.Module,
    batch: RolloutBatch,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packed: bool = False,
    prefix_grouper: bool = False,
    align_within: float = 0,
) -> tuple[Tensor, Tensor | None]:
    """log pi(response token) as [b, T] (zeros past each row's response), and the entropy of the
    temperature-scaled distribution [b, T] when ``with_entropy``. Differentiable. ``packed`` puts
    several sequences in a row (``splitproof.engine.packing``) instead of padding each to the longest;
    ``prefix_grouper`` computes each distinct prompt once (``splitproof.engine.shared_prefix``; wins over
    ``packed``); ``align_within``: padded rows widened for the fixed-row products within this token budget
    (``padded_outputs``)."""
    if not temperature > 0:
        raise ConfigError("temperature", f"must be > 0, got {temperature}")
    check_attention(model)
    b, T = len(batch), batch.response_width
    dtype, out_dtype = output_dtypes(model)
    device = batch.responses.device
    if b == 0:
        empty = torch.zeros(0, T, dtype=out_dtype, device=device)
        return empty, (empty.clone() if with_entropy else None)
    p0, t1 = response_window(batch)
    if t1 == 0:
        zeros = torch.zeros(b, T, dtype=out_dtype, device=device)
        return zeros, (zeros.clone() if with_entropy else None)
    if prefix_grouper:
        from splitproof.engine.shared_prefix import shared_prefix_log_probs

        return shared_prefix_log_probs(
            model, batch, p0, t1, temperature=temperature, with_entropy=with_entropy, dtype=dtype, out_dtype=out_dtype
        )
    if packed:
        return packed_response_log_probs(
            model,
            batch,
            temperature=temperature,
            with_entropy=with_entropy,
            logits_of=logits_of,
            dtype=dtype,
            out_dtype=out_dtype,
        )

    # Position j predicts response token j; the final one predicts nothing. It is dropped after the
    # log-softmax, not before: the kept logits are then contiguous, and log_softmax on a strided slice first
    # copies it (benchmarks/rollout.py: 20-40 % of the head). Same values per row.
    logits, input_ids, valid = padded_outputs(model, batch, p0, t1, dtype, align_within=align_within)
    z = logits.float() if logits.dtype in _LOW_PRECISION else logits
    if temperature != 1.0:  # x / 1.0 == x exactly: skip a full [b, T, V] pass (and its backward)
        z = z / temperature

    tokens = input_ids[:, -t1:].long()
    # log_softmax, not z - logsumexp(z): one fused pass each way instead of ~6 full [b, T, V] passes
    # (benchmarks/engine_overhead.py), and one saved [b, T, V] tensor less at the backward's peak.
    logp = torch.log_softmax(z, dim=-1)[:, :-1].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logp = F.pad(torch.where(valid, logp, torch.zeros_like(logp)), (0, T - t1))
    entropy = None
    if with_entropy:
        z = z[:, :-1]
        lse = torch.logsumexp(z, dim=-1)
        h = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
        entropy = F.pad(torch.where(valid, h, torch.zeros_like(h)), (0, T - t1))
    return logp, entropy


def inference_microbatches(
    batch: TokenLayout, micro_batch_size: int | None, max_token_len: int | None, packed: bool, field: str
) -> list[list[int]]:
    """Rows of each microbatch of a no-grad pass: fixed ``micro_batch_size`` rows or a ``max_token_len``
    budget — exactly one of the two (``field`` names the setting in errors)."""
    if (micro_batch_size is None) == (max_token_len is None):
        raise BatchError(
            field,
            "give exactly one of micro_batch_size or max_token_len "
            f"({field.replace('micro_batch_size_per_gpu', 'max_token_len_per_gpu')})",
        )
    rows = list(range(len(batch)))
    if micro_batch_size is not None:
        return fixed_microbatches(rows, micro_batch_size)
    return budget_microbatches(
        rows,
        batch.token_spans().tolist(),
        max_token_len,
        seq_ids=batch.seq_ids.tolist(),
        prompt_lengths=batch.prompt_spans().tolist(),
        packed=packed,
    )


@torch.no_grad()
def compute_log_probs(
    model: nn.Module,
    batch: TokenLayout,
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    packed: bool = False,
    prefix_grouper: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """No-grad log-probs (and entropy) of the whole ``batch`` as [B, T], in the original row order; ``batch``
    is any token layout (a ``TokenBatch`` or a ``RolloutBatch``).

    Split into fixed microbatches of ``micro_batch_size`` rows or under a ``max_token_len`` padded-token
    budget: exactly one of the two. This is the "old log-probs" pass. Its matrix products run in fixed
    row blocks (``engine.row_invariant``), so no split changes a log-prob, not even in its last bit.
    ``prefix_grouper``: each distinct prompt of a microbatch computed once, a group's rows kept in one
    microbatch where the split allows (``engine.shared_prefix``).
    """
    field = "log_prob_micro_batch_size_per_gpu"
    if prefix_grouper:
        from splitproof.engine.shared_prefix import grouped_microbatches

        microbatches = grouped_microbatches(batch, micro_batch_size, max_token_len, field)
    else:
        microbatches = inference_microbatches(batch, micro_batch_size, max_token_len, packed, field)
    _, out_dtype = output_dtypes(model)
    device = batch.responses.device
    shape = (len(batch), batch.response_width)
    logp = torch.zeros(shape, dtype=out_dtype, device=device)
    entropy = torch.zeros(shape, dtype=out_dtype, device=device) if with_entropy else None
    with row_invariant(model):
        for mb in microbatches:
            lp, h = response_log_probs(
                model,
                batch.select(mb),
                temperature=temperature,
                with_entropy=with_entropy,
                packed=packed,
                prefix_grouper=prefix_grouper,
                align_within=max_token_len or math.inf,
            )
            index = torch.as_tensor(mb, dtype=torch.long, device=device)
            logp[index] = lp.to(out_dtype)
            if with_entropy:
                entropy[index] = h.to(out_dtype)
    return logp, entropy
