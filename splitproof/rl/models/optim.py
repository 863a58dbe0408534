"""The optimizer and its learning-rate schedule, from verl's ``optim`` keys.

Schedules (the LR multiplier at optimizer-schedule step s, W warm-up steps, S total steps, m =
``min_lr_ratio``, c = ``num_cycles``):
  constant: s/W during warm-up, then 1.
  cosine:   m + (1 − m)·s/W during warm-up, then max(m, m + (1 − m)·½(1 + cos(2πc·p))), p = (s − W)/(S − W).
The schedule steps once per training step (after the step's updates), as verl's does.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from ...loss_config import ConfigError


def make_optimizer(model: nn.Module, optim) -> torch.optim.Optimizer:
    """AdamW (verl's default) or SGD over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    name = optim.optimizer.lower()
    if name == "adamw":
        return torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas), weight_decay=optim.weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)
    raise ConfigError("optim.optimizer", f"unknown {optim.optimizer!r}; expected AdamW or SGD")


def warmup_steps(optim, total_steps: int) -> int:
    """``lr_warmup_steps`` when > 0, else ``lr_warmup_steps_ratio`` × total steps (verl's rule)."""
    if optim.lr_warmup_steps is not None and optim.lr_warmup_steps > 0:
        return int(optim.lr_warmup_steps)
    return int(optim.lr_warmup_steps_ratio * total_steps)


def lr_multiplier(
    kind: str, step: int, *, warmup: int, total: int, min_lr_ratio: float = 0.0, num_cycles: float = 0.5
) -> float:
    if kind == "constant":
        return step / max(1, warmup) if step < warmup else 1.0
    if kind == "cosine":
        if step < warmup:
            return min_lr_ratio + (1.0 - min_lr_ratio) * step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * num_cycles * progress))
        return max(min_lr_ratio, min_lr_ratio + (1.0 - min_lr_ratio) * cosine)
    raise ConfigError("optim.lr_scheduler_type", f"unknown {kind!r}; expected constant or cosine")


def make_scheduler(optimizer: torch.optim.Optimizer, optim, total_steps: int) -> LambdaLR:
    kind = optim.warmup_style or optim.lr_scheduler_type
    total = optim.total_training_steps if optim.total_training_steps and optim.total_training_steps > 0 else total_steps
    warmup = warmup_steps(optim, total)
    lr_multiplier(kind, 0, warmup=warmup, total=total)  # refuse an unknown kind now, not at the first step
    return LambdaLR(
        optimizer,
        lambda s: lr_multiplier(
            kind, s, warmup=warmup, total=total, min_lr_ratio=optim.min_lr_ratio, num_cycles=optim.num_cycles
        ),
    )
