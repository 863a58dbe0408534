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

from ...batch import TokenBatch


@dataclass(frozen=True)
class SequenceTensors:
    """The token layout of a rollout batch: what every later stage indexes by row."""

    prompts: Tensor  # [B, P] left-padded
    responses: Tensor  # [B, T] right-padded
    attention_mask: Tensor  # [B, P + T] bool
    response_mask: Tensor  # [B, T] bool: the generated tokens, EOS included (a tool's tokens excluded)
    rollout_log_probs: Tensor  # [B, T], 0 on padding

    @property
    def tokens(self) -> TokenBatch:
        """The token layout alone, what the no-grad passes read."""
        return TokenBatch(self.prompts, self.responses, self.attention_mask, self.response_mask)

    @property
    def response_lengths(self) -> Tensor:
        return self.response_mask.sum(dim=1)

    @property
    def response_token_counts(self) -> Tensor:
        """Every token after the prompt, tools' included (verl's response length)."""
        return self.attention_mask[:, self.prompts.shape[1]:].sum(dim=1)

    @property
    def prompt_lengths(self) -> Tensor:
        return self.attention_mask[:, :self.prompts.shape[1]].sum(dim=1)


def pad_samples(samples: Sequence, *, response_width: int, pad_token_id: int,
                dtype: torch.dtype = torch.float32) -> SequenceTensors:
    """Lay the samples out as padded tensors (``samples[i]`` becomes row i); each tensor is built by one
    ``torch.tensor`` call from padded rows."""
    count = len(samples)
    prompt_width = max(len(s.prompt_ids) for s in samples)
    for sample in samples:
        t = len(sample.response_ids)
        if t > response_width:
            raise ValueError(f"sample (uid {sample.uid}, sample_index {sample.sample_index}) has {t} response tokens > "
                             f"max_response_length {response_width}")
        if len(sample.log_probs) != t:
            raise ValueError(f"sample (uid {sample.uid}, sample_index {sample.sample_index}) has {len(sample.log_probs)} "
                             f"log-probs for {t} response tokens")
    pad = [pad_token_id]
    prompts = torch.tensor([pad * (prompt_width - len(s.prompt_ids)) + list(s.prompt_ids) for s in samples],
                           dtype=torch.long).reshape(count, prompt_width)
    responses = torch.tensor([list(s.response_ids) + pad * (response_width - len(s.response_ids)) for s in samples],
                             dtype=torch.long).reshape(count, response_width)
    log_probs = torch.tensor([list(s.log_probs) + [0.0] * (response_width - len(s.log_probs)) for s in samples],
                             dtype=dtype).reshape(count, response_width)
    prompt_lengths = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long).unsqueeze(1)
    response_lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long).unsqueeze(1)
    prompt_mask = torch.arange(prompt_width) >= prompt_width - prompt_lengths
    response_attention = torch.arange(response_width) < response_lengths
    response_mask = response_attention
    if any(getattr(s, "token_mask", None) is not None for s in samples):  # multi-turn: tool tokens are not trained
        response_mask = torch.tensor([list(map(bool, s.token_mask)) + [False] * (response_width - len(s.token_mask))
                                      for s in samples], dtype=torch.bool).reshape(count, response_width)
    return SequenceTensors(prompts, responses, torch.cat([prompt_mask, response_attention], dim=1), response_mask,
                           log_probs)
