"""How much disk a run's checkpoints take, said at the start (nothing fills a disk unnoticed).

One ``global_step_N`` holds the trainable weights and their optimizer state (``actor_state/``), the model
as a Hugging Face directory (``actor/``: the whole model, or the LoRA adapter alone), and the same for the
critic: about ``trainable × (1 + slots) + hf`` bytes, ``slots`` being the optimizer's tensors per weight
(AdamW 2, SGD with momentum 1). verl keeps every checkpoint by default
(``trainer.max_actor_ckpt_to_keep=null``), and so does splitproof; the notice says what that comes to.
"""

from __future__ import annotations

import torch

from ...lora import is_lora


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:  # tied weights (one tensor under two names) are saved once
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _slots(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 2
    return int(any(g.get("momentum", 0) for g in optimizer.param_groups))


def part_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes one model (and its optimizer) adds to a checkpoint (the estimate of the module docstring)."""
    trainable = _bytes(p for p in model.parameters() if p.requires_grad)
    hf = trainable if is_lora(model) else _bytes(model.state_dict(keep_vars=True).values())
    return trainable * (1 + _slots(optimizer)) + hf


def checkpoint_count(start_step: int, total_steps: int, save_freq: int) -> int:
    """The checkpoints a launch from ``start_step`` writes: every ``save_freq`` steps and at the last."""
    if save_freq <= 0:
        return 0
    return sum(1 for s in range(start_step + 1, total_steps + 1) if s % save_freq == 0 or s == total_steps)


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def size_notice(each: int, count: int, keep: int | None, save_freq: int) -> str | None:
    """The start-up line about checkpoint disk use (None when this launch writes none)."""
    if count == 0:
        return None
    head = f"checkpoints: every {save_freq} steps and the last, about {_gb(each)} each"
    if keep is None:
        return (
            f"{head}; trainer.max_actor_ckpt_to_keep=null (verl's default) keeps all {count} this run "
            f"writes: about {_gb(each * count)} by its end (trainer.max_actor_ckpt_to_keep=N keeps the newest N)"
        )
    kept = min(keep, count)
    return f"{head}; trainer.max_actor_ckpt_to_keep={keep} keeps the newest {keep}: at most {_gb(each * kept)}"
