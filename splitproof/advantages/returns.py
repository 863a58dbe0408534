"""Token-level discounted returns and GAE: right-to-left recurrences along each row.

Masked positions (m = 0, e.g. observation tokens of a multi-turn response or padding) are skipped:
the running return or advantage is carried across them unchanged, and their own rewards and values are
never read (``torch.where``, so a NaN there cannot leak).
"""

from __future__ import annotations

import torch
from torch import Tensor


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + γ G_{t'} at valid t (t' the next valid position; G = 0 past the last), 0 at masked t."""
    valid = mask.bool()
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        updated = rewards[:, t] + gamma * running
        returns[:, t] = torch.where(valid[:, t], updated, 0.0)
        running = torch.where(valid[:, t], updated, running)
    return returns


def reward_to_go(rewards: Tensor, mask: Tensor) -> Tensor:
    """Undiscounted Σ_{s ≥ t} m_s r_s at every position t (masked positions included)."""
    kept = torch.where(mask.bool(), rewards, 0.0)
    return kept.flip(-1).cumsum(-1).flip(-1)


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> Tensor:
    """Â_t = δ_t + γλ Â_{t'},  δ_t = r_t + γ V_{t'} − V_t  (t' the next valid position; V = Â = 0 past the last).

    At a masked position Â carries the value of the next valid position.
    """
    valid = mask.bool()
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = torch.where(valid[:, t], delta + gamma * lam * next_advantage, next_advantage)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = next_advantage
    return advantages
