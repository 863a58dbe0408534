"""The batch contract (docs/semantics.md, "The batch"): per-sequence tensors, validated once at the boundary.

Layout: prompts are left-padded ``[B, P]``, responses right-padded ``[B, T]``; ``attention_mask`` covers
both ``[B, P + T]``; ``response_mask`` ``[B, T]`` says which response tokens count in the loss (multi-turn
masks allowed, but only on real tokens). Per-token tensors are ``[B, T]``; advantages may be ``[B]``
(one scalar per sequence, broadcast). ``seq_ids`` are the canonical sequence keys (default: row index);
``index`` (optional) is each sequence's prompt-group id (verl's uid), which group-mean-token-mean needs.
The critic's update also reads ``values`` (its predictions before the update) and ``returns`` (its targets).
Other paddings are accepted too — after a prompt, holes inside a prompt or a response — as long as every
sequence with a response token has a prompt token; the engine computes each sequence over its span.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from .batch_error import BatchError
from .loss_config import GROUP_AGG
from .sequences import fields_from_sequences, token_fields


def _seq_label(seq_ids: Tensor | None, row: int) -> int:
    return int(seq_ids[row]) if seq_ids is not None else row


def check_binary_mask(name: str, mask: Tensor, seq_ids: Tensor | None = None) -> Tensor:
    """Return ``mask`` as bool, or raise naming the first sequence with a value other than 0/1."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.is_complex():
        bad = ~((mask == 0) | (mask == 1))
    else:
        bad = (mask != 0) & (mask != 1)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise BatchError(name, "must contain only 0 and 1", _seq_label(seq_ids, row))
    return mask.bool()


def check_finite_on(name: str, values: Tensor, valid: Tensor, seq_ids: Tensor | None = None) -> None:
    """Raise if ``values`` is non-finite where ``valid``; padding positions may hold anything."""
    bad = valid & ~torch.isfinite(values)
    if bad.any():
        row = int(bad.nonzero()[0, 0])
        raise BatchError(name, "non-finite value on a valid response token", _seq_label(seq_ids, row))


def check_per_token_shape(name: str, value: Tensor | None, shape: torch.Size) -> None:
    """A per-token tensor (None = absent) must be floating point and shaped like the response mask."""
    if value is not None and value.shape != shape:
        raise BatchError(name, f"shape {tuple(value.shape)} does not match response_mask {tuple(shape)}")
    if value is not None and not value.is_floating_point():
        raise BatchError(name, f"must be a floating-point tensor, got {value.dtype}")


def check_policy_tensors(
    log_prob: Tensor | None,
    old_log_prob: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    ref_log_prob: Tensor | None = None,
    rollout_is_weights: Tensor | None = None,
    entropy: Tensor | None = None,
    seq_ids: Tensor | None = None,
    names: dict[str, str] | None = None,
) -> tuple[Tensor, Tensor]:
    """Validate the per-token policy inputs. Returns ``(response_mask as bool, advantages as [B, T])``.

    Errors name the inputs as the caller knows them: ``names`` maps an argument name (``old_log_prob``)
    to the caller's (``RolloutBatch.old_log_probs``)."""
    names = names or {}
    if response_mask.dim() != 2:
        raise BatchError("response_mask", f"must be [B, T], got shape {tuple(response_mask.shape)}")
    shape = response_mask.shape
    if seq_ids is not None and tuple(seq_ids.shape) != (shape[0],):
        raise BatchError("seq_ids", f"must be [B] = [{shape[0]}], got shape {tuple(seq_ids.shape)}")
    mask = check_binary_mask("response_mask", response_mask, seq_ids)
    per_token = {
        "old_log_prob": old_log_prob,
        "log_prob": log_prob,
        "ref_log_prob": ref_log_prob,
        "rollout_is_weights": rollout_is_weights,
        "entropy": entropy,
    }
    per_token = {names.get(name, name): value for name, value in per_token.items()}
    for name, value in per_token.items():
        check_per_token_shape(name, value, shape)
    if advantages.shape == shape[:1]:
        advantages = advantages[:, None].expand(shape)
    elif advantages.shape != shape:
        raise BatchError("advantages", f"shape {tuple(advantages.shape)} must be [B] or [B, T] = {tuple(shape)}")
    if not advantages.is_floating_point():
        raise BatchError("advantages", f"must be a floating-point tensor, got {advantages.dtype}")
    for name, value in list(per_token.items()) + [("advantages", advantages)]:
        if value is not None:
            check_finite_on(name, value.detach(), mask, seq_ids)
    if rollout_is_weights is not None:
        negative = mask & (rollout_is_weights < 0)
        if negative.any():
            row = int(negative.nonzero()[0, 0])
            raise BatchError(
                names.get("rollout_is_weights", "rollout_is_weights"),
                "must be >= 0 on valid tokens",
                _seq_label(seq_ids, row),
            )
    if int(mask.sum()) == 0:
        raise BatchError("response_mask", "empty minibatch: no valid response token (N = 0)")
    return mask, advantages


def check_group_index(
    index: Tensor | None, batch_size: int, seq_ids: Tensor | None = None, name: str = "index"
) -> Tensor | None:
    """Validate group ids: one integer per row ([B]); returns them as int64 (None stays None)."""
    if index is None:
        return None
    if not isinstance(index, Tensor):
        index = torch.as_tensor(index)
    if tuple(index.shape) != (batch_size,):
        raise BatchError(
            name, f"must hold one group id per sequence, [B] = [{batch_size}], got shape {tuple(index.shape)}"
        )
    if index.dtype == torch.bool or index.is_complex():
        raise BatchError(name, f"group ids must be integers, got {index.dtype}")
    if index.is_floating_point():
        bad = ~torch.isfinite(index)
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise BatchError(name, f"non-finite group id {float(index[row])}", _seq_label(seq_ids, row))
        raise BatchError(name, f"group ids must be an integer tensor, got {index.dtype}")
    return index.long()


def require_group_index(index: Tensor | None, agg_mode: str, name: str = "index") -> None:
    """group-mean-token-mean without group ids is an error (not "each sequence its own group")."""
    if agg_mode == GROUP_AGG and index is None:
        raise BatchError(
            name,
            f"loss_agg_mode {GROUP_AGG!r} needs a group id per sequence (the prompt group, "
            "verl's uid), but none was given",
        )


# check_policy_tensors's argument names -> the RolloutBatch fields they come from
FIELD_NAMES = {"old_log_prob": "old_log_probs", "ref_log_prob": "ref_log_probs"}
# The critic's per-token fields: optional, checked like the others when present.
VALUE_FIELDS = ("values", "returns")


class TokenLayout:
    """The token layout every batch shares (``TokenBatch``, ``RolloutBatch``): ``prompts`` [B, P]
    left-padded, ``responses`` [B, T] right-padded, ``attention_mask`` [B, P + T], ``response_mask`` [B, T],
    ``seq_ids`` [B]; what a no-grad pass (log-probs, values) reads."""

    prompts: Tensor
    responses: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    seq_ids: Tensor | None

    def __post_init__(self) -> None:
        if self.seq_ids is None:
            self.seq_ids = torch.arange(self.prompts.shape[0], device=self.prompts.device)

    def __len__(self) -> int:
        return self.prompts.shape[0]

    @property
    def prompt_width(self) -> int:
        return self.prompts.shape[1]

    @property
    def response_width(self) -> int:
        return self.responses.shape[1]

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)

    def token_lengths(self) -> Tensor:
        """Real (unpadded) tokens per sequence, prompt + response: what a token budget counts."""
        return self.attention_mask.sum(dim=1)

    def prompt_lengths(self) -> Tensor:
        """Real prompt tokens per sequence."""
        return self.attention_mask[:, : self.prompt_width].sum(dim=1)

    def response_lengths(self) -> Tensor:
        """Real response tokens per sequence (a tool's tokens in a multi-turn response included)."""
        return self.attention_mask[:, self.prompt_width :].sum(dim=1)

    def prompt_spans(self) -> Tensor:
        """Columns from each sequence's first real prompt token to the end of the prompt block (0 if none):
        its prompt length when left-padded, more with padding inside or after it."""
        real = self.attention_mask[:, : self.prompt_width].bool()
        first = torch.where(real.any(dim=1), real.int().argmax(dim=1), self.prompt_width)
        return self.prompt_width - first

    def response_spans(self) -> Tensor:
        """Columns from the start of the response block to each sequence's last real response token (0 if
        none): its response length when right-padded, more with padding inside it."""
        real = self.attention_mask[:, self.prompt_width :].bool()
        last_from_end = real.flip(dims=[1]).int().argmax(dim=1)
        return torch.where(real.any(dim=1), self.response_width - last_from_end, 0)

    def token_spans(self) -> Tensor:
        """The columns a sequence occupies once the padding around it is cut: prompt span + response span.
        What the engine computes for it, in a padded row or a packed one; ``token_lengths`` without holes."""
        return self.prompt_spans() + self.response_spans()

    def select(self, rows: Tensor | list[int]):
        """The sub-batch of the given rows, in that order (keys travel with the rows)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.prompts.device)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = None if value is None else value.index_select(0, rows)
        return type(self)(**picked)

    def to(self, device: torch.device | str):
        return replace(
            self,
            **{
                f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device))
                for f in fields(self)
            },
        )


@dataclass
class TokenBatch(TokenLayout):
    """Sequences as tokens alone, for the no-grad passes (``engine.compute_log_probs``, ``compute_values``)."""

    prompts: Tensor  # [B, P] token ids, left-padded
    responses: Tensor  # [B, T] token ids, right-padded
    attention_mask: Tensor  # [B, P + T], 1 on real tokens
    response_mask: Tensor  # [B, T], 1 on response tokens that count in the loss
    seq_ids: Tensor | None = None  # [B] canonical keys; default arange(B)

    @classmethod
    def from_sequences(
        cls, prompt_ids, response_ids, *, response_mask=None, response_width: int | None = None, pad_token_id: int = 0
    ) -> TokenBatch:
        """The token layout of plain per-sequence lists, as :meth:`RolloutBatch.from_sequences` lays it out
        (masks as 0/1 integers); ``response_width``: the responses' padded width (default the longest)."""
        return cls(
            **token_fields(
                prompt_ids,
                response_ids,
                response_mask=response_mask,
                response_width=response_width,
                pad_token_id=pad_token_id,
            )
        )


@dataclass
class RolloutBatch(TokenLayout):
    """Every sequence of one RL step, as the engine consumes it."""

    prompts: Tensor  # [B, P] token ids, left-padded
    responses: Tensor  # [B, T] token ids, right-padded
    attention_mask: Tensor  # [B, P + T], 1 on real tokens
    response_mask: Tensor  # [B, T], 1 on response tokens that count in the loss
    old_log_probs: Tensor  # [B, T]
    advantages: Tensor  # [B, T] or [B]
    ref_log_probs: Tensor | None = None  # [B, T]
    rollout_is_weights: Tensor | None = None  # [B, T]
    seq_ids: Tensor | None = None  # [B] canonical keys; default arange(B)
    index: Tensor | None = None  # [B] prompt-group id per sequence (verl's uid); group-mean-token-mean needs it
    values: Tensor | None = None  # [B, T] the critic's predictions before its update (the critic's no-grad pass)
    returns: Tensor | None = None  # [B, T] the critic's targets (GAE returns)

    @classmethod
    def from_sequences(
        cls,
        prompt_ids,
        response_ids,
        old_log_probs,
        advantages,
        *,
        response_mask=None,
        ref_log_probs=None,
        rollout_is_weights=None,
        values=None,
        returns=None,
        seq_ids=None,
        index=None,
        pad_token_id: int = 0,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        response_width: int | None = None,
    ) -> RolloutBatch:
        """A validated batch from plain per-sequence data; row i is sequence i of every list.

        - ``prompt_ids[i]``: the prompt's token ids (at least one); left-padded with ``pad_token_id``.
        - ``response_ids[i]``: the response's token ids (EOS included when generated; may be empty);
          right-padded with ``pad_token_id``.
        - ``old_log_probs[i]``: log π_old of each response token (one per token).
        - ``advantages[i]``: a number for the whole sequence, or one per response token (computing them
          from rewards, e.g. GRPO, is the caller's step, done on the whole rollout batch).
        - ``response_mask[i]`` (optional): 0/1 per response token, which tokens count in the loss
          (multi-turn masks); default every response token.
        - ``ref_log_probs[i]``, ``rollout_is_weights[i]`` (optional): one per response token.
        - ``values[i]``, ``returns[i]`` (optional, the critic's update): one per response token.
        - ``seq_ids`` (optional): a unique integer id per sequence, its canonical key (default 0..B-1).
        - ``index`` (optional): an integer group id per sequence — the sequences sampled from one prompt
          share it (verl's uid); ``loss_agg_mode="group-mean-token-mean"`` needs it.
        - ``response_width`` (optional): the responses' padded width, e.g. ``data.max_response_length``
          (default: the longest response).

        A row may be a list, tuple, NumPy array or 1-D tensor. Bad input raises :class:`BatchError`
        naming the field and the row (``old_log_probs[3]: 5 values for 6 response tokens``). Per-token
        values are stored in ``dtype`` (padding holds 0); masks as 0/1 integers. See docs/semantics.md
        (the batch).
        """
        fields = fields_from_sequences(
            prompt_ids,
            response_ids,
            old_log_probs,
            advantages,
            response_mask=response_mask,
            ref_log_probs=ref_log_probs,
            rollout_is_weights=rollout_is_weights,
            values=values,
            returns=returns,
            seq_ids=seq_ids,
            index=index,
            pad_token_id=pad_token_id,
            dtype=dtype,
            response_width=response_width,
        )
        batch = cls(**fields)
        if device is not None:
            batch = batch.to(device)
        batch.validate()  # the whole contract: finite values on valid tokens, unique ids, a non-empty minibatch
        return batch

    def validate(self, vocab_size: int | None = None) -> RolloutBatch:
        """Check the whole contract; return the batch with bool masks and [B, T] advantages."""
        b = self.prompts.shape[0]
        if self.prompts.dim() != 2 or self.responses.dim() != 2:
            raise BatchError("prompts" if self.prompts.dim() != 2 else "responses", "must be [B, length]")
        if self.responses.shape[0] != b:
            raise BatchError("responses", f"has {self.responses.shape[0]} rows, prompts have {b}")
        for name in ("prompts", "responses"):
            ids = getattr(self, name)
            if ids.is_floating_point() or ids.dtype == torch.bool:
                raise BatchError(name, f"token ids must be an integer tensor, got {ids.dtype}")
        if self.seq_ids.shape != (b,):
            raise BatchError("seq_ids", f"must be [B] = [{b}], got shape {tuple(self.seq_ids.shape)}")
        if self.seq_ids.is_floating_point() or self.seq_ids.is_complex() or self.seq_ids.dtype == torch.bool:
            raise BatchError("seq_ids", f"canonical sequence ids must be an integer tensor, got {self.seq_ids.dtype}")
        if torch.unique(self.seq_ids).numel() != b:
            raise BatchError("seq_ids", "canonical sequence ids must be unique")
        index = check_group_index(self.index, b, self.seq_ids)
        expected = (b, self.prompt_width + self.response_width)
        if tuple(self.attention_mask.shape) != expected:
            raise BatchError("attention_mask", f"shape {tuple(self.attention_mask.shape)}, expected {expected}")
        attention = check_binary_mask("attention_mask", self.attention_mask, self.seq_ids)
        if tuple(self.response_mask.shape) != tuple(self.responses.shape):
            raise BatchError(
                "response_mask",
                f"shape {tuple(self.response_mask.shape)} does not match responses {tuple(self.responses.shape)}",
            )
        mask, advantages = check_policy_tensors(
            None,
            self.old_log_probs,
            self.advantages,
            self.response_mask,
            ref_log_prob=self.ref_log_probs,
            rollout_is_weights=self.rollout_is_weights,
            seq_ids=self.seq_ids,
            names=FIELD_NAMES,
        )
        for name in VALUE_FIELDS:
            value = getattr(self, name)
            check_per_token_shape(name, value, mask.shape)
            if value is not None:
                check_finite_on(name, value.detach(), mask, self.seq_ids)
        outside = mask & ~attention[:, self.prompt_width :]
        if outside.any():
            row = int(outside.nonzero()[0, 0])
            raise BatchError(
                "response_mask", "marks a token that attention_mask says is padding", int(self.seq_ids[row])
            )
        no_prompt = attention[:, self.prompt_width :].any(dim=1) & ~attention[:, : self.prompt_width].any(dim=1)
        if no_prompt.any():
            row = int(no_prompt.nonzero()[0, 0])
            raise BatchError(
                "prompts",
                "a sequence with response tokens needs at least one prompt token (the first "
                "response token is predicted from the last prompt token)",
                int(self.seq_ids[row]),
            )
        if vocab_size is not None:
            for name, ids, att in (
                ("prompts", self.prompts, attention[:, : self.prompt_width]),
                ("responses", self.responses, attention[:, self.prompt_width :]),
            ):
                bad = att & ((ids < 0) | (ids >= vocab_size))
                if bad.any():
                    row = int(bad.nonzero()[0, 0])
                    raise BatchError(
                        name,
                        f"token id {int(ids[bad][0])} outside the model's vocabulary [0, {vocab_size})",
                        int(self.seq_ids[row]),
                    )
        return replace(self, attention_mask=attention, response_mask=mask, advantages=advantages, index=index)
