"""Audit a third-party policy-loss function for split invariance (docs/diagnose.md, docs/audit-verl.md).

The function follows verl's calling convention::

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        -> (pg_loss, metrics)

It is called the way verl's FSDP engine calls it: once per microbatch, on padded ``[B_μ, T]`` tensors of
that microbatch only, with ``config.global_batch_info`` holding the *minibatch's* figures (``dp_size``,
``batch_num_tokens`` N, ``global_batch_size`` G, ``loss_scale_factor``), and ``backward()`` on each returned
loss. Under data parallelism the gradients of the ranks are averaged, as DDP/FSDP do.

The audit compares, at the level of the gradient w.r.t. ``log_prob``, the gradient accumulated over a
split with the gradient of one call on the whole minibatch. No model is needed: the log-probs are leaf
tensors, and the chain rule from them to the parameters is the same for every split, so equal gradients
w.r.t. the log-probs mean equal parameter gradients.

Everything runs in float64. A control — a token-mean PPO-clip loss known to be split-invariant, run on
the same data and splits — measures the floating-point floor; a split passes when the candidate's
relative difference is within ``max(16 × control, 1e-12)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from splitproof.diagnose.verl_convention import VerlActorConfig, native_verl_config, one_line, set_global_batch_info
from splitproof.loss_config import AGG_MODES, GROUP_AGG, LossConfig

from .audit_data import SPLIT_KINDS, AuditMinibatch, AuditSplit, make_minibatch, make_splits
from .audit_loading import function_name, load_loss_fn, verl_importable
from .audit_report import CONTRACT, TOLERANCE_FACTOR, TOLERANCE_FLOOR, AuditReport

CONVENTIONS = ("verl",)
VERL_AGG_MODES = tuple(m for m in AGG_MODES if m != GROUP_AGG)  # verl's loss functions get no group ids

__all__ = [
    "CONVENTIONS",
    "SPLIT_KINDS",
    "AuditError",
    "AuditReport",
    "VerlActorConfig",
    "check_agg_mode",
    "control_token_mean",
    "likely_cause",
    "load_loss_fn",
    "run_audit",
]


class AuditError(ValueError):
    """The audit cannot run: the loss function failed or returned something unusable on the whole minibatch."""


# --------------------------------------------------------------------------------------------------------
# The control: a token-mean PPO-clip loss in verl's convention, invariant by construction


def control_token_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """PPO clip, Σ_μ m·ℓ × D / N with the minibatch-global N and D from ``config.global_batch_info``."""
    info = config.global_batch_info
    eps_low, eps_high = config.clip_ratio_low, config.clip_ratio_high
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    loss = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    if rollout_is_weights is not None:
        loss = loss * rollout_is_weights
    mask = response_mask.bool()
    total = torch.where(mask, loss, torch.zeros_like(loss)).sum()
    return total * info["dp_size"] / info["batch_num_tokens"], {}


# --------------------------------------------------------------------------------------------------------
# Running the function


def _extract_loss(out: Any) -> Tensor:
    if isinstance(out, (tuple, list)):
        if not out:
            raise TypeError("the loss function returned an empty tuple")
        out = out[0]
    if not isinstance(out, Tensor):
        raise TypeError(f"the loss function returned {type(out).__name__}, not a tensor loss")
    if out.numel() != 1:
        raise TypeError(f"the loss function returned a loss of shape {tuple(out.shape)}, not a scalar")
    return out.reshape(())


def _grad_of(
    loss_fn: Callable, mb: AuditMinibatch, rows: list[int], config: Any, agg_mode: str, seed: int
) -> tuple[Tensor, float]:
    """Call ``loss_fn`` on the rows, backward; the gradient w.r.t. log_prob [len(rows), T] and the loss value."""
    index = torch.tensor(rows, dtype=torch.long)
    log_prob = mb.log_prob[index].clone().requires_grad_(True)
    torch.manual_seed(seed)  # functions that draw from the global RNG see the same state on every call
    out = loss_fn(
        mb.old_log_prob[index].clone(),
        log_prob,
        mb.advantages[index].clone(),
        mb.response_mask[index].clone(),
        agg_mode,
        config,
        None,
    )
    loss = _extract_loss(out)
    if loss.requires_grad:
        loss.backward()
    grad = log_prob.grad if log_prob.grad is not None else torch.zeros_like(log_prob)
    return grad.detach(), float(loss.detach())


def _global_info(mb: AuditMinibatch, dp_size: int, config: Any) -> dict:
    return {
        "dp_size": dp_size,
        "batch_num_tokens": mb.num_tokens,
        "global_batch_size": len(mb.lengths),
        "loss_scale_factor": getattr(config, "loss_scale_factor", None),
    }


def _accumulate(
    loss_fn: Callable, mb: AuditMinibatch, split: AuditSplit, config: Any, agg_mode: str, seed: int
) -> tuple[Tensor, float]:
    """The gradient w.r.t. log_prob accumulated over the split's microbatches, averaged over ranks."""
    total = torch.zeros_like(mb.log_prob)
    loss_total = 0.0
    for rank in split.ranks:
        for rows in rank:
            set_global_batch_info(config, _global_info(mb, split.dp_size, config))
            grad, loss = _grad_of(loss_fn, mb, rows, config, agg_mode, seed)
            total[torch.tensor(rows, dtype=torch.long)] += grad / split.dp_size  # DDP: mean over ranks
            loss_total += loss / split.dp_size
    return total, loss_total


def _compare(grad: Tensor, base: Tensor, mask: Tensor) -> tuple[float, float]:
    """Max abs difference and its ratio to the max abs baseline gradient, on valid tokens."""
    g, b = grad[mask], base[mask]
    if not (torch.isfinite(g).all() and torch.isfinite(b).all()):
        return math.inf, math.inf
    diff = float((g - b).abs().max()) if g.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    if scale == 0.0:
        return diff, (0.0 if diff == 0.0 else math.inf)
    return diff, diff / scale


def likely_cause(
    split: AuditSplit, grad: Tensor | None, base: Tensor, mask: Tensor, tolerance: float, error: str | None = None
) -> tuple[str, float | None]:
    """Why a split's gradient differs from the whole minibatch's, as far as its shape tells: (text, factor).

    ``factor`` is c of the best fit grad ≈ c·base when that fit is exact (within ``tolerance``, relative
    to max |base|), else None. An exact 1/D under D ranks is the missing ``dp_size``; another constant is
    a per-microbatch normaliser; anything else reweights tokens or sequences per microbatch.
    """
    if error is not None or grad is None:
        return (
            "the function raises on a microbatch this split makes (e.g. one whose sequences have no valid "
            "token), so whether training crashes depends on the split"
        ), None
    g, b = grad[mask], base[mask]
    factor = float((g * b).sum() / (b * b).sum()) if float((b * b).sum()) > 0 else math.nan
    scale = float(b.abs().max()) if b.numel() else 0.0
    exact = math.isfinite(factor) and scale > 0 and float((g - factor * b).abs().max()) / scale <= tolerance
    if not exact:
        return (
            "the gradient is reweighted, not just rescaled: the loss uses statistics of the microbatch (a mean "
            "over its rows or tokens, its own token count, or tokens selected inside it: a top-k, a random "
            "draw) where the minibatch's are needed (config.global_batch_info)"
        ), None
    if split.dp_size > 1 and abs(factor * split.dp_size - 1.0) <= 1e-6:
        return (
            f"the gradient is exactly 1/{split.dp_size} of the whole-minibatch one: the loss is not multiplied "
            f"by global_batch_info['dp_size'] (DDP/FSDP average the {split.dp_size} ranks' gradients, so each "
            "rank's loss must be scaled by dp_size)"
        ), factor
    return (
        f"the gradient is a constant multiple (x{factor:.4g}) of the whole-minibatch one: the loss divides by a "
        "quantity of the microbatch (its token or sequence count, a torch.mean, its padded width) instead of "
        "global_batch_info's batch_num_tokens / global_batch_size / loss_scale_factor"
    ), factor


def check_agg_mode(agg_mode: str) -> None:
    """verl's five modes; group-mean-token-mean needs group ids, which verl's convention does not pass."""
    if agg_mode == GROUP_AGG:
        raise ValueError(
            f"aggregation mode {agg_mode!r} cannot be audited in verl's convention: its loss functions "
            f"get no group ids; expected one of {', '.join(VERL_AGG_MODES)}"
        )
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown aggregation mode {agg_mode!r}; expected one of {', '.join(VERL_AGG_MODES)}")


def run_audit(
    loss_fn: Callable,
    *,
    convention: str = "verl",
    loss_mode: str | None = None,
    agg_mode: str = "token-mean",
    seed: int = 0,
    sequences: int = 16,
    response_length: int = 24,
    loss_config: LossConfig | None = None,
    overrides: dict | None = None,
    native_config: bool | None = None,
    name: str | None = None,
) -> AuditReport:
    """Audit ``loss_fn`` (verl convention) for split invariance of its gradient w.r.t. the log-probs.

    ``loss_mode`` sets ``config.policy_loss.loss_mode``; ``agg_mode`` is passed as ``loss_agg_mode`` and set
    on the config. ``loss_config`` (splitproof's LossConfig) supplies the shared hyper-parameters;
    ``overrides`` sets further verl fields by name (e.g. ``{"dro_beta": 0.1}``).

    The config passed is a :class:`VerlActorConfig`, or — with ``native_config=True``, or by default when
    the function lives in a ``verl`` module and verl is importable — the same values in verl's own
    ``ActorConfig`` (some verl losses assert ``isinstance(config, ActorConfig)``).

    ``name`` is how the function is shown (default ``module:qualname``; the CLI passes what the user typed).

    Raises ValueError for an unsupported convention or bad settings, and AuditError (a ValueError) when
    the function fails on the whole minibatch. A failure on a split is reported in that row (verdict
    ``"error"``).
    """
    _check_arguments(loss_fn, convention, loss_mode, agg_mode, sequences, response_length)
    label = name or function_name(loss_fn)
    config = _audit_config(loss_fn, loss_mode, agg_mode, loss_config, overrides, native_config)
    control_config = VerlActorConfig.from_loss_config(loss_config)

    mb = make_minibatch(seed, sequences, response_length)
    splits, budget = make_splits(mb)
    whole = AuditSplit("whole", [[list(range(sequences))]], "one microbatch")
    mask = mb.response_mask

    with torch.random.fork_rng(devices=[]):
        try:
            base, base_loss = _accumulate(loss_fn, mb, whole, config, agg_mode, seed)
        except Exception as exc:
            raise AuditError(f"{label} failed on the whole minibatch: {one_line(exc)}") from None
        if not torch.isfinite(base[mask]).all():
            raise AuditError(f"{label} gives a non-finite gradient on the whole minibatch")
        control_base, _ = _accumulate(control_token_mean, mb, whole, control_config, agg_mode, seed)
        rows = []
        for split in splits:
            control_grad, _ = _accumulate(control_token_mean, mb, split, control_config, agg_mode, seed)
            _, control_rel = _compare(control_grad, control_base, mask)
            rows.append(_split_row(loss_fn, mb, split, config, agg_mode, seed, base, base_loss, control_rel))

    settings = {
        "loss_fn": label,
        "convention": convention,
        "loss_mode": config.policy_loss.loss_mode,
        "agg_mode": agg_mode,
        "seed": seed,
        "sequences": sequences,
        "response_length": response_length,
        "dtype": "float64",
        "batch_num_tokens": mb.num_tokens,
        "global_batch_size": sequences,
        "sequence_lengths": list(mb.lengths),
        "token_budget": budget,
        "baseline_grad_max_abs": float(base[mask].abs().max()),
        "baseline_loss": base_loss,
        "compared": "gradient w.r.t. log_prob on valid tokens, accumulated over microbatches (mean over ranks)",
        "control": "token-mean PPO clip with the minibatch-global N (splitproof.diagnose.audit.control_token_mean)",
        "tolerance": f"grad_rel_diff <= max({TOLERANCE_FACTOR:g} x control_rel_diff, {TOLERANCE_FLOOR:g})",
        "overrides": dict(overrides or {}),
        "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
        "contract": " ".join(CONTRACT.split()),
    }
    passed = all(r["verdict"] == "pass" for r in rows)
    return AuditReport(passed=passed, rows=rows, settings=settings)


def _check_arguments(loss_fn, convention: str, loss_mode, agg_mode: str, sequences, response_length) -> None:
    """A one-line ValueError for an unsupported convention or a bad setting, before anything runs."""
    if convention not in CONVENTIONS:
        raise ValueError(f"unsupported convention {convention!r}; supported: {', '.join(CONVENTIONS)}")
    check_agg_mode(agg_mode)
    if loss_mode is not None and (not isinstance(loss_mode, str) or not loss_mode):
        raise ValueError(f"loss_mode must be a non-empty string, got {loss_mode!r}")
    if not isinstance(sequences, int) or sequences < 4:
        raise ValueError(f"sequences must be an int >= 4, got {sequences!r}")
    if not isinstance(response_length, int) or response_length < 2:
        raise ValueError(f"response_length must be an int >= 2, got {response_length!r}")
    if not callable(loss_fn):
        raise ValueError(f"the loss function is not callable: {loss_fn!r}")


def _audit_config(
    loss_fn,
    loss_mode: str | None,
    agg_mode: str,
    loss_config: LossConfig | None,
    overrides: dict | None,
    native_config: bool | None,
):
    """The actor config the function sees: ours, or verl's own ``ActorConfig`` (see :func:`run_audit`)."""
    config = VerlActorConfig.from_loss_config(loss_config, **(overrides or {}))
    config.loss_agg_mode = agg_mode
    if loss_mode is not None:
        config.policy_loss.loss_mode = loss_mode
    if native_config is None:
        module = getattr(loss_fn, "__module__", None) or ""
        native_config = (module == "verl" or module.startswith("verl.")) and verl_importable()
    return native_verl_config(config) if native_config else config


def _split_row(
    loss_fn: Callable,
    mb: AuditMinibatch,
    split: AuditSplit,
    config: Any,
    agg_mode: str,
    seed: int,
    base: Tensor,
    base_loss: float,
    control_rel: float,
) -> dict:
    """One split's row: the candidate's gradient against the whole minibatch's, its verdict and likely cause."""
    mask = mb.response_mask
    row = {
        "split": split.name,
        "microbatches": len(split.microbatches()),
        "ranks": split.dp_size,
        "sequences_per_microbatch": [len(m) for m in split.microbatches()],
        "tokens_per_microbatch": [sum(mb.lengths[i] for i in m) for m in split.microbatches()],
        "description": split.description,
        "grad_max_abs_diff": None,
        "grad_rel_diff": None,
        "control_rel_diff": control_rel,
        "tolerance": max(TOLERANCE_FACTOR * control_rel, TOLERANCE_FLOOR),
        "loss_abs_diff": None,
        "verdict": "error",
        "error": None,
        "cause": None,
        "grad_scale": None,
    }
    grad = None
    try:
        grad, loss = _accumulate(loss_fn, mb, split, config, agg_mode, seed)
    except Exception as exc:
        row["error"] = one_line(exc)
    else:
        abs_diff, rel_diff = _compare(grad, base, mask)
        row["grad_max_abs_diff"] = abs_diff
        row["grad_rel_diff"] = rel_diff
        row["loss_abs_diff"] = abs(loss - base_loss)
        row["verdict"] = "pass" if rel_diff <= row["tolerance"] else "fail"
    if row["verdict"] != "pass":
        row["cause"], row["grad_scale"] = likely_cause(split, grad, base, mask, row["tolerance"], row["error"])
    return row
