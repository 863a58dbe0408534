"""Everything about an update that the batch, the config and the model can tell, checked before it runs.

``update_policy`` calls :func:`validate_update` (``update_critic`` its own checks through
:func:`validate_plans`) on every rank before the first forward. Every rank holds
the same rollout batch and config (checked first, with one small gather of digests), so every rank
raises the same named error (``BatchError`` naming the field and the sequence, or ``ConfigError`` naming
the setting) and no weight, gradient or optimizer state has moved — instead of one rank failing
mid-update while the others wait in a collective.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields

import torch
from torch import nn

from ..batch import BatchError, RolloutBatch, require_group_index
from ..collective import LOCAL
from ..hf_models import max_positions_of, vocab_size_of
from ..loss_config import ConfigError
from .attention import check_attention
from .plan import MinibatchPlan, plan_update
from .update_config import UpdateConfig


def active_dropout(model: nn.Module) -> bool:
    """True if a forward in the current mode is random (the `deferred` strategy needs it deterministic)."""
    if not model.training:
        return False
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(getattr(model, "module", model), "config", None)
    names = ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop")
    return any(float(getattr(config, n, 0.0) or 0.0) > 0 for n in names)


def check_cov_strategy(model: nn.Module, config: UpdateConfig) -> None:
    """`deferred` recomputes the selected sequences' log-probs: it needs a deterministic forward."""
    if config.loss.is_cov and config.cov_strategy == "deferred" and active_dropout(model):
        raise ConfigError(
            "cov_strategy",
            "'deferred' needs a deterministic forward, but the model has active "
            "dropout; use 'prepass' or 'auto', or call model.eval()",
        )


def check_positions(model: nn.Module, batch: RolloutBatch) -> None:
    """A sequence's positions run 0 .. n−1 over its n real tokens: n must not exceed the model's limit."""
    limit = max_positions_of(model)
    if limit is None:
        return
    lengths = batch.token_lengths()
    too_long = lengths > limit
    if too_long.any():
        row = int(too_long.nonzero()[0, 0])
        raise BatchError(
            "attention_mask",
            f"{int(lengths[row])} real tokens (prompt + response), more than the "
            f"model's max_position_embeddings {limit}",
            int(batch.seq_ids[row]),
        )


def batch_fingerprint(batch: RolloutBatch) -> list[tuple[str, str]]:
    """(field, digest of its shape, dtype and bytes) for every tensor of the batch."""
    out = []
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is None:
            out.append((f.name, "None"))
            continue
        data = value.detach().contiguous().cpu()
        digest = hashlib.sha1(f"{tuple(data.shape)} {data.dtype}".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        out.append((f.name, digest.hexdigest()))
    return out


def check_same_inputs(batch: RolloutBatch, config, collective) -> None:
    """Every rank must pass the same rollout batch (each takes its own shard of it) and config."""
    if collective.world_size == 1:
        return
    prints = collective.gather_objects((batch_fingerprint(batch), repr(config)))
    for index, (name, digest) in enumerate(prints[0][0]):
        others = [rank for rank, (p, _) in enumerate(prints) if p[index][1] != digest]
        if others:
            raise BatchError(
                name,
                f"differs between ranks (rank 0 vs ranks {others}): every rank must pass the same "
                "rollout batch; the engine takes each rank's shard itself",
            )
    others = [rank for rank, (_, c) in enumerate(prints) if c != prints[0][1]]
    if others:
        raise ConfigError("config", f"the {type(config).__name__} differs between ranks (rank 0 vs ranks {others})")


def validate_update(
    model: nn.Module, batch: RolloutBatch, config: UpdateConfig, collective=LOCAL
) -> tuple[RolloutBatch, list[MinibatchPlan]]:
    """The validated batch (bool masks, [B, T] advantages) and this rank's plan of every optimizer step."""

    def policy_checks(batch: RolloutBatch) -> None:
        if config.loss.use_kl_loss and batch.ref_log_probs is None:
            raise BatchError("ref_log_probs", "loss.use_kl_loss is set but the batch has no ref_log_probs")
        require_group_index(batch.index, config.loss.loss_agg_mode)
        check_positions(model, batch)
        check_cov_strategy(model, config)

    return validate_plans(model, batch, config, collective, policy_checks)


def validate_plans(
    model: nn.Module, batch: RolloutBatch, config, collective, checks
) -> tuple[RolloutBatch, list[MinibatchPlan]]:
    """What every update checks — attention implementation, the same inputs on every rank, the batch
    contract — then the update's own ``checks(validated batch)``, then the plan (token budget, minibatch
    size) and N > 0 in every minibatch."""
    check_attention(model)
    check_same_inputs(batch, config, collective)
    batch = batch.validate(vocab_size_of(model))
    checks(batch)
    plans = plan_update(batch, config, collective.world_size, collective.rank)  # budget, minibatch size
    for index, plan in enumerate(plans):
        if not batch.response_mask[plan.rows].any():
            raise BatchError("response_mask", f"minibatch {index} has no valid response token (N = 0)")
    return batch, plans
