"""The critic's value objective J_V of one whole minibatch, in float64."""

from __future__ import annotations

import torch
from torch import Tensor

from splitproof.loss_config import LossConfig
from splitproof.oracle.rows import Norm, Seq, aggregate, token_mean


def oracle_value_objective(
    vpreds,
    values,
    returns,
    response_mask,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    index=None,
) -> tuple[Tensor, dict[str, float]]:
    """The critic's minibatch objective J_V (float64, differentiable w.r.t. ``vpreds``) and its metrics.

    Per valid token: lo = V_old − c, hi = V_old + c, v̂ = lo if v < lo, hi if v > hi, else v;
    ℓ = ½·max((v − R)², (v̂ − R)²), clipped when (v̂ − R)² > (v − R)². Aggregated like the policy loss
    (``index``: one group id per row, for group-mean-token-mean).
    """
    mask = response_mask.bool()
    if mask.dim() != 2:
        raise ValueError(f"response_mask: must be [B, T], got shape {tuple(mask.shape)}")
    for name, x in (("vpreds", vpreds), ("values", values), ("returns", returns)):
        if tuple(x.shape) != tuple(mask.shape):
            raise ValueError(f"{name}: shape {tuple(x.shape)} does not match response_mask {tuple(mask.shape)}")
    seqs, losses, clipped, preds = [], [], [], []
    for row in range(mask.shape[0]):
        valid = mask[row]
        n = int(valid.sum())
        if n == 0:
            continue
        v = vpreds[row][valid].to(torch.float64)
        old = values[row][valid].to(torch.float64)
        r = returns[row][valid].to(torch.float64)
        lo, hi = old - cliprange_value, old + cliprange_value
        v_clip = torch.where(v < lo, lo, torch.where(v > hi, hi, v))
        err, err_clip = (v - r) ** 2, (v_clip - r) ** 2
        losses.append(0.5 * torch.where(err_clip > err, err_clip, err))
        clipped.append((err_clip > err).double())
        preds.append(v.detach())
        group = None if index is None else int(index[row])
        seqs.append(Seq(row, row, group, valid.nonzero().flatten().tolist(), v, old, r, None, None, None))
    if not seqs:
        raise ValueError("response_mask: empty minibatch: no valid response token (N = 0)")
    norm = Norm(seqs, mask.shape[1], LossConfig(loss_scale_factor=loss_scale_factor))
    total = aggregate(losses, seqs, loss_agg_mode, norm)
    metrics = {
        "critic/vf_loss": float(total.detach()),
        "critic/vf_clipfrac": token_mean(clipped, norm),
        "critic/vpred_mean": token_mean(preds, norm),
    }
    return total, metrics
