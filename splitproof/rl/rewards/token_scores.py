"""verl's ``token_level_scores``: a batch's sequence scores placed on their last response tokens, the
tensor KL in the reward (``kl_penalty``) and the advantages start from."""

from __future__ import annotations

import torch


def token_level_scores(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's ``token_level_scores``: each sequence's score on its last response token, zero elsewhere."""
    mask = response_mask.bool()
    if mask.dim() != 2 or scores.shape != mask.shape[:1]:
        shapes = f"scores {tuple(scores.shape)} do not fit response_mask {tuple(mask.shape)}"
        raise ValueError(f"token_level_scores: {shapes}")
    empty = (~mask.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"token_level_scores: sequence {empty[0]} has no response token to hold its score")
    device = mask.device
    positions = torch.arange(mask.shape[1], device=device).expand_as(mask)
    last = torch.where(mask, positions, -1).amax(dim=1)
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=device)
    out[torch.arange(mask.shape[0], device=device), last] = scores.to(device)
    return out
