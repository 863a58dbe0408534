"""Value predictions of the response tokens under a value model (the critic), verl's convention.

The value at response position t is the value head's output at the token *before* response token t —
the state in which token t is chosen (verl's critic reads ``values[:, -response_length - 1:-1]``). So a
value model runs exactly the forward of :mod:`splitproof.engine.logprobs` at exactly the positions whose
logits predict response tokens, padded or packed, and a row's values do not depend on which other rows
share its microbatch.

A value model is any module with a causal LM's call signature whose output (``.logits``, or the tensor
itself) has one channel per position: a Hugging Face ``AutoModelForTokenClassification`` with
``num_labels=1`` (``splitproof.value_model``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from splitproof.batch import RolloutBatch, TokenLayout
from splitproof.engine.attention import check_attention
from splitproof.engine.logprobs import inference_microbatches, logits_of, output_dtypes, padded_outputs, response_window
from splitproof.engine.packing import packed_outputs
from splitproof.engine.row_invariant import row_invariant
from splitproof.loss_config import ConfigError


def _scalar(outputs: Tensor) -> Tensor:
    if outputs.shape[-1] != 1:
        raise ConfigError(
            "model",
            f"a value model has one output per position (num_labels=1), got {outputs.shape[-1]}; "
            "build it with splitproof.value_model.value_model_from_pretrained",
        )
    return outputs[..., 0]


def response_values(model: nn.Module, batch: RolloutBatch, *, packed: bool = False, align_within: float = 0) -> Tensor:
    """V(state before response token t) as [b, T], 0 past each row's response. Differentiable. ``align_within``:
    the padded rows widened for the fixed-row products within this token budget (``engine.logprobs.padded_outputs``)."""
    check_attention(model)
    b, P, T = len(batch), batch.prompt_width, batch.response_width
    dtype, out_dtype = output_dtypes(model)
    device = batch.responses.device
    p0, t1 = response_window(batch) if b else (P, 0)
    if t1 == 0:
        return torch.zeros(b, T, dtype=out_dtype, device=device)
    if packed:
        picked, seq_t, resp_t, _ = packed_outputs(model, batch, logits_of=logits_of, dtype=dtype)
        v = _scalar(picked).to(out_dtype)
        return torch.zeros(b, T, dtype=out_dtype, device=device).index_put((seq_t, resp_t), v)
    outputs, _, valid = padded_outputs(model, batch, p0, t1, dtype, align_within=align_within)
    v = _scalar(outputs)[:, :-1].to(out_dtype)
    return F.pad(torch.where(valid, v, torch.zeros_like(v)), (0, T - t1))


@torch.no_grad()
def compute_values(
    model: nn.Module,
    batch: TokenLayout,
    *,
    micro_batch_size: int | None = None,
    max_token_len: int | None = None,
    packed: bool = False,
) -> Tensor:
    """No-grad value predictions of the whole ``batch`` as [B, T] (0 on padding), in the original row order.

    The value at response position t is the value head's output at the token before response token t
    (verl's convention). Split into fixed microbatches of ``micro_batch_size`` rows or under a
    ``max_token_len`` token budget (exactly one of the two; ``packed`` shares rows between sequences);
    the split never changes the values, not even in their last bit (``engine.row_invariant``). This is the critic's
    pass before the update (the batch's ``values``).
    """
    microbatches = inference_microbatches(
        batch, micro_batch_size, max_token_len, packed, "forward_micro_batch_size_per_gpu"
    )
    _, out_dtype = output_dtypes(model)
    device = batch.responses.device
    values = torch.zeros(len(batch), batch.response_width, dtype=out_dtype, device=device)
    with row_invariant(model):
        for mb in microbatches:
            index = torch.as_tensor(mb, dtype=torch.long, device=device)
            part = batch.select(mb)
            values[index] = response_values(model, part, packed=packed, align_within=max_token_len or math.inf)
    return values
