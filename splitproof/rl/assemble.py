"""From generated samples to the engine's tensors.

Rows are in canonical order (the step's prompt order × sample index), prompts left-padded, responses
right-padded to ``data.max_response_length`` — a fixed width, as verl pads, so that
`seq-mean-token-sum-norm`'s default constant is the configured response length, never a batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SequenceTensors:
    """The token layout of a rollout batch: what every later stage indexes by row."""

    prompts: Tensor  # [B, P] left-padded
    responses: Tensor  # [B, T] right-padded
    attention_mask: Tensor  # [B, P + T] bool
    response_mask: Tensor  # [B, T] bool: the generated tokens, EOS included
    rollout_log_probs: Tensor  # [B, T], 0 on padding

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def prompt_lengths(self) -> Tensor:
        return self.attention_mask[:, :self.prompts.shape[1]].sum(dim=1)


def pad_samples(samples: Sequence, *, response_width: int, pad_token_id: int,
                dtype: torch.dtype = torch.float32) -> SequenceTensors:
    """Lay the samples out as padded tensors (``samples[i]`` becomes row i)."""
    count = len(samples)
    prompt_width = max(len(s.prompt_ids) for s in samples)
    prompts = torch.full((count, prompt_width), pad_token_id, dtype=torch.long)
    responses = torch.full((count, response_width), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(count, prompt_width, dtype=torch.bool)
    response_mask = torch.zeros(count, response_width, dtype=torch.bool)
    log_probs = torch.zeros(count, response_width, dtype=dtype)
    for row, sample in enumerate(samples):
        p, t = len(sample.prompt_ids), len(sample.response_ids)
        if t > response_width:
            raise ValueError(f"sample (uid {sample.uid}, index {sample.index}) has {t} response tokens > "
                             f"max_response_length {response_width}")
        if p:
            prompts[row, prompt_width - p:] = torch.as_tensor(sample.prompt_ids, dtype=torch.long)
            prompt_mask[row, prompt_width - p:] = True
        if t:
            responses[row, :t] = torch.as_tensor(sample.response_ids, dtype=torch.long)
            response_mask[row, :t] = True
            log_probs[row, :t] = torch.as_tensor(sample.log_probs, dtype=dtype)
    return SequenceTensors(prompts, responses, torch.cat([prompt_mask, response_mask], dim=1), response_mask,
                           log_probs)
