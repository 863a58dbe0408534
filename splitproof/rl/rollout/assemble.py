"""From generated samples to the engine's tensors.

Rows are in canonical order (the step's prompt order × sample index), prompts left-padded, responses
right-padded to ``data.max_response_length`` — a fixed width, as verl pads, so that
`seq-mean-token-sum-norm`'s default constant is the configured response length, never a batch's. The
padding is ``TokenBatch.from_sequences``'s (the layout of ``RolloutBatch.from_sequences``); a multi-turn
sample's ``token_mask`` is its response mask (a tool's tokens are not trained).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...batch import TokenBatch
from ...sequences import pad_per_token


def token_masks(samples: Sequence) -> list | None:
    """Each sample's response mask: its ``token_mask`` (multi-turn), or None (every generated token)."""
    if any(getattr(s, "token_mask", None) is not None for s in samples):
        return [s.token_mask for s in samples]
    return None


def samples_to_tokens(
    samples: Sequence, *, response_width: int, pad_token_id: int, dtype: torch.dtype = torch.float32
) -> tuple[TokenBatch, Tensor]:
    """The samples' token layout (``samples[i]`` becomes row i; bool masks) and their rollout log-probs
    [B, response_width] in ``dtype`` (0 on padding); a sample that does not fit is named."""
    for sample in samples:
        t = len(sample.response_ids)
        where = f"sample (uid {sample.uid}, sample_index {sample.sample_index})"
        if t > response_width:
            raise ValueError(f"{where} has {t} response tokens > max_response_length {response_width}")
        if len(sample.log_probs) != t:
            raise ValueError(f"{where} has {len(sample.log_probs)} log-probs for {t} response tokens")
    tokens = TokenBatch.from_sequences(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        response_mask=token_masks(samples),
        response_width=response_width,
        pad_token_id=pad_token_id,
    )
    tokens.attention_mask, tokens.response_mask = tokens.attention_mask.bool(), tokens.response_mask.bool()
    log_probs = pad_per_token(
        "log_probs", [s.log_probs for s in samples], [len(s.response_ids) for s in samples], response_width, dtype
    )
    return tokens, log_probs
