"""The ``hf`` rollout backend: a KV-cached decode loop for any Hugging Face causal LM, with
layout-independent sampling (``splitproof.rl.rollout.sampling``).

A request is ``(uid, j, prompt_ids)``: sample j of prompt uid. Token t of that sample draws its uniform
from the stream (seed, stream, step, uid, j, t) and is chosen from its own logits row alone, so the
tokens do not depend on ``max_num_seqs``, on the order of the requests, on which requests share a chunk,
or on how the requests are split across data-parallel ranks — provided the model computes a row's logits
independently of the rest of the batch. Two rules make that so on CPU (measured: float64 identical;
float32 identical up to 512 keys per sequence, past which the attention kernel's key blocks move and
log-probs differ by about 1e-6; docs/rollout.md):

- canonical padding: a prompt of length L is left-padded to ``ceil((L + 1) / pad_multiple) · pad_multiple``
  columns, and a chunk to the widest of those. A row's tokens then move by a multiple of ``pad_multiple``
  from one chunk to another, which keeps the vectorised reductions of the attention kernel (sums over
  keys, in lanes of 8 doubles / 16 floats) in the same lanes; the "+ 1" keeps at least one padding
  column, so the attention mask is always materialised (no switch to the mask-free causal kernel);
- a row floor: every forward has at least ``min_rows`` rows (filler copies of a live row, their output
  discarded). BLAS picks different matrix kernels for 1–15 rows than for more, and those round
  differently; the model's linear layers also run in fixed blocks of rows (``engine.row_invariant``),
  since on AVX2 the rows past the last full tile of 4 round differently at any row count.

Cost rules that change no bit (rows are independent): the requests of a chunk with the same prompt (the
``n`` samples of a prompt) share one prefill row, whose cache and last logits are copied to each of them;
the KV cache has its room reserved up front (``kv_cache.reserve``: no growth by concatenation); finished
sequences stop costing compute: live rows are compacted (``index_select`` of the KV cache) whenever that
shrinks the decode batch by an eighth or more.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from splitproof.batch import RolloutBatch
from splitproof.engine.forward_output import cache_keyword, cache_of, logits_of
from splitproof.engine.logprobs import param_dtype
from splitproof.engine.row_invariant import row_invariant
from splitproof.hf_models import unwrap, vocab_size_of
from splitproof.loss_config import ConfigError
from splitproof.rl.rollout.assemble import token_masks
from splitproof.rl.rollout.kv_cache import select_rows
from splitproof.rl.rollout.prefill import TurnCache, keep_rows, prefill
from splitproof.rl.rollout.sampling import sample_tokens, shift_keys, stream_keys, stream_uniforms
from splitproof.rl.stop import decode_point

_INT64_MAX = (1 << 63) - 1
_COMPACT_SHARE = 8  # compact the decode batch when that removes at least 1/8 of its rows

Request = tuple[int, int, Sequence[int]]


class RolloutError(ValueError):
    """A bad generation request: names the field and the request (position, uid, sample index)."""

    def __init__(
        self, field: str, message: str, position: int | None = None, uid: int | None = None, index: int | None = None
    ):
        where = f" (requests[{position}], uid {uid}, sample {index})" if position is not None else ""
        super().__init__(f"{field}{where}: {message}")
        self.field, self.position, self.uid, self.index = field, position, uid, index


@dataclass(frozen=True)
class SamplingParams:
    """What to generate. ``top_k`` -1 (or 0) and ``top_p`` 1.0 are off; greedy when ``do_sample`` is
    False or ``temperature`` is 0. ``seed`` keys every sampling stream."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    max_response_length: int = 512
    seed: int = 42

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    def check(self) -> SamplingParams:
        def integer(name: str, low: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= _INT64_MAX:
                raise ConfigError(name, f"must be an integer in [{low}, 2^63), got {value!r}")

        integer("n", 1)
        integer("max_response_length", 1)
        integer("seed", 0)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError("top_k", f"must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if (
            not isinstance(self.temperature, (int, float))
            or not self.temperature >= 0
            or self.temperature == float("inf")
        ):
            raise ConfigError("temperature", f"must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.do_sample, bool):
            raise ConfigError("do_sample", f"must be a bool, got {self.do_sample!r}")
        return self


@dataclass
class Sample:
    """One generated response. ``response_ids`` end with the EOS token when ``finished``; ``log_probs``
    are the rollout's log-probs of each response token under the temperature-scaled distribution
    (before top-k / top-p)."""

    uid: int
    sample_index: int  # the sample's number within its prompt (0 .. n - 1)
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float]
    finished: bool


def requests_for(prompts: Iterable[tuple[int, Sequence[int]]], n: int) -> list[tuple[int, int, list[int]]]:
    """``n`` requests per ``(uid, prompt_ids)``, prompt-major: (u0, 0), (u0, 1), ..., (u1, 0), ..."""
    return [(uid, j, list(ids)) for uid, ids in prompts for j in range(n)]


def _is_int(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _first_bad_token(ids: Sequence, vocab_size: int) -> tuple | None:
    """``(id,)`` for the first entry of ``ids`` that is not an integer in [0, vocab_size), else None.
    Plain ``int`` lists (every prompt the run builds) take one pass of C-level ``min``/``max``."""
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < vocab_size)):
        return None
    for t in ids:
        if not _is_int(t) or not 0 <= t < vocab_size:
            return (t,)
    return None


def _eos_tuple(eos_token_ids) -> tuple[int, ...]:
    if eos_token_ids is None:
        return ()
    ids = (eos_token_ids,) if _is_int(eos_token_ids) else tuple(eos_token_ids)
    if not all(_is_int(i) and i >= 0 for i in ids):
        raise ConfigError("eos_token_ids", f"must be non-negative token ids, got {eos_token_ids!r}")
    return tuple(int(i) for i in ids)


def _log_prob_dtype(model: nn.Module) -> torch.dtype:
    """float64 for a float64 model, float32 otherwise (bf16 / fp16 logits are scored in float32)."""
    return torch.float64 if param_dtype(model) == torch.float64 else torch.float32


def check_requests(requests: Sequence[Request], params: SamplingParams, vocab_size: int) -> None:
    """A ``RolloutError`` naming the first bad request: its form, uid, sample index, duplicate, prompt ids."""
    seen: dict[tuple[int, int], int] = {}
    for pos, request in enumerate(requests):
        if not isinstance(request, (tuple, list)) or len(request) != 3:
            raise RolloutError("requests", f"each request is (uid, sample index, prompt_ids), got {request!r}", pos)
        uid, j, ids = request
        for name, value in (("uid", uid), ("sample index", j)):
            if not _is_int(value) or not 0 <= value <= _INT64_MAX:
                raise RolloutError(name, f"must be an integer in [0, 2^63), got {value!r}", pos, uid, j)
        uid, j = int(uid), int(j)
        if j >= params.n:
            raise RolloutError("sample index", f"must be < n = {params.n}", pos, uid, j)
        if (uid, j) in seen:
            raise RolloutError("requests", f"duplicate (uid, sample index): also requests[{seen[uid, j]}]", pos, uid, j)
        seen[uid, j] = pos
        if len(ids) == 0:
            raise RolloutError("prompt_ids", "empty prompt", pos, uid, j)
        bad = _first_bad_token(ids, vocab_size)
        if bad is not None:
            raise RolloutError(
                "prompt_ids",
                f"token id {bad[0]!r} outside the model's vocabulary [0, {vocab_size})",
                pos,
                uid,
                j,
            )


def check_generate_args(requests: Sequence[Request], params: SamplingParams, step, stream, positions, budgets):
    """``generate``'s arguments checked (params, step, stream, one position and budget per request); the
    positions (default 0) and budgets (default ``params.max_response_length``) as lists."""
    params.check()
    positions = [0] * len(requests) if positions is None else [int(p) for p in positions]
    budgets = [params.max_response_length] * len(requests) if budgets is None else [int(b) for b in budgets]
    if len(positions) != len(requests) or len(budgets) != len(requests):
        raise RolloutError("requests", f"{len(requests)} requests, {len(positions)} positions, {len(budgets)} budgets")
    if any(not 1 <= b <= params.max_response_length for b in budgets) or any(p < 0 for p in positions):
        raise RolloutError("budgets", f"need 1 <= budget <= {params.max_response_length} and position >= 0")
    for name, value in (("step", step), ("stream", stream)):
        if not _is_int(value) or not 0 <= value <= _INT64_MAX:
            raise ConfigError(name, f"must be an integer in [0, 2^63), got {value!r}")
    return positions, budgets


class HFRollout:
    """Generation with a Hugging Face causal LM (eval mode, no grad, KV cache).

    ``max_num_seqs`` sequences decode at once (requests are taken in chunks of that many, in order).
    ``pad_multiple`` and ``min_rows`` are the two layout rules of the module docstring; they change the
    cost, never the tokens.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: int | Iterable[int] | None,
        pad_token_id: int | None,
        max_num_seqs: int = 256,
        pad_multiple: int = 16,
        min_rows: int = 16,
    ):
        for name, value in (("max_num_seqs", max_num_seqs), ("pad_multiple", pad_multiple), ("min_rows", min_rows)):
            if not _is_int(value) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        self.model = model
        self.vocab_size = vocab_size_of(model)
        self.eos_token_ids = _eos_tuple(eos_token_ids)
        bad_eos = [i for i in self.eos_token_ids if i >= self.vocab_size]
        if bad_eos:
            raise ConfigError("eos_token_ids", f"{bad_eos} outside the model's vocabulary [0, {self.vocab_size})")
        # Padding columns are masked out; their input id only has to be a valid embedding row.
        pad_ok = _is_int(pad_token_id) and 0 <= pad_token_id < self.vocab_size
        self.pad_token_id = pad_token_id
        self._pad_input_id = int(pad_token_id) if pad_ok else 0
        self.max_num_seqs = max_num_seqs
        self.pad_multiple = pad_multiple
        self.min_rows = min_rows

    # ------------------------------------------------------------------------------------ generation

    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams,
        *,
        step: int,
        stream: int = 0,
        positions: Sequence[int] | None = None,
        budgets: Sequence[int] | None = None,
        turn_cache: TurnCache | None = None,
    ) -> list[Sample]:
        """One :class:`Sample` per request, in request order.

        ``positions`` (default 0): where each request's first new token sits in its stream, so token t
        draws the uniform of position ``positions[r] + t`` (a multi-turn episode continues its stream).
        ``budgets`` (default ``params.max_response_length``): new tokens of each request, at most.
        ``turn_cache`` (from :meth:`new_turn_cache`): a request continues the KV cache kept there for its
        (uid, sample index) when its ids extend the ones that cache covers, and keeps its own there
        (``rl/rollout/prefill.py``)."""
        positions, budgets = check_generate_args(requests, params, step, stream, positions, budgets)
        check_requests(requests, params, self.vocab_size)
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        samples: list[Sample] = []
        try:
            with torch.no_grad(), row_invariant(model):  # fixed-row products: engine.row_invariant
                for start in range(0, len(requests), self.max_num_seqs):
                    chunk = slice(start, start + self.max_num_seqs)
                    samples.extend(
                        self._generate_chunk(
                            model, requests[chunk], params, step, stream, positions[chunk], budgets[chunk], turn_cache
                        )
                    )
        finally:
            model.train(was_training)
        return samples

    def new_turn_cache(self) -> TurnCache:
        """An empty store of the KV caches that multi-turn episodes keep between their turns."""
        return TurnCache()

    def _sample(self, logits: Tensor, uniforms: Tensor, params: SamplingParams) -> tuple[Tensor, Tensor]:
        """The next token of each row (one uniform each) and its log-prob: ``splitproof.rl.rollout.sampling``'s rule."""
        return sample_tokens(
            logits,
            uniforms,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            greedy=params.greedy,
        )

    def _prefill(self, model, chunk, prompts, rows, T, turn_cache, device):
        """``(keys, logits, cache, mask)``: the chunk's prefill (``rl/rollout/prefill.py``), each request
        continuing the cache it kept in ``turn_cache``, if any; ``keys`` its (uid, sample index)."""
        keys = [(int(u), int(j)) for u, j, _ in chunk]
        kept = [turn_cache.take(k, p) for k, p in zip(keys, prompts)] if turn_cache is not None else [None] * len(chunk)
        pads = dict(pad_multiple=self.pad_multiple, pad_id=self._pad_input_id, device=device)
        return keys, *prefill(model, prompts, kept, rows, max(T - 1, 1), **pads)

    def _generate_chunk(
        self,
        model: nn.Module,
        chunk: Sequence[Request],
        params: SamplingParams,
        step: int,
        stream: int,
        positions: Sequence[int],
        budgets: Sequence[int],
        turn_cache: TurnCache | None = None,
    ) -> list[Sample]:
        device = next(model.parameters()).device
        real = len(chunk)
        rows = max(real, self.min_rows)
        prompts = [[int(t) for t in ids] for _, _, ids in chunk]
        uniforms = _chunk_uniforms(chunk, params, step, stream, positions, device)  # [real, T]: token t of row r
        prompt_lengths = torch.tensor([len(p) for p in prompts], device=device)
        eos = torch.tensor(self.eos_token_ids, dtype=torch.long, device=device)
        budget = torch.tensor(list(budgets) + [1] * (rows - real), dtype=torch.long, device=device)
        T = params.max_response_length

        # Batch position p holds chunk row row_of[p]; `live` marks real, unfinished rows (fillers are dead).
        row_of = torch.cat(
            [torch.arange(real, device=device), torch.zeros(rows - real, dtype=torch.long, device=device)]
        )
        live = torch.arange(rows, device=device) < real
        responses = torch.zeros(real, T, dtype=torch.long, device=device)
        log_probs = torch.zeros(real, T, dtype=_log_prob_dtype(model), device=device)
        lengths = torch.zeros(real, dtype=torch.long, device=device)
        finished = torch.zeros(real, dtype=torch.bool, device=device)

        cache_kw = cache_keyword(model)
        keys, logits, cache, mask = self._prefill(model, chunk, prompts, rows, T, turn_cache, device)
        for t in range(T):
            decode_point()  # a Ctrl-C abandons the step here (splitproof.rl.stop)
            tokens, lp = self._sample(logits, uniforms[row_of, t], params)
            writing = row_of[live]
            responses[writing, t] = tokens[live]
            log_probs[writing, t] = lp[live]
            lengths[writing] = t + 1
            at_eos = live & torch.isin(tokens, eos)
            finished[row_of[at_eos]] = True
            ended, live = live, live & ~at_eos & (budget[row_of] > t + 1)
            if turn_cache is not None:  # the rows that ended keep their cache for the next turn
                ended = (ended & ~live).nonzero().squeeze(1)
                _keep_ended(turn_cache, cache, mask, ended, row_of, keys, prompts, responses[:, :t], self.pad_multiple)
            n_live = int(live.sum())
            if n_live == 0 or t + 1 == T:
                break
            target = max(n_live, self.min_rows)
            if (live.numel() - target) * _COMPACT_SHARE >= live.numel():
                keep = live.nonzero().squeeze(1)
                keep = torch.cat([keep, keep[:1].expand(target - n_live)])
                cache = select_rows(cache, keep)
                mask, row_of, tokens = mask[keep], row_of[keep], tokens[keep]
                live = torch.arange(target, device=device) < n_live
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
            out = model(
                input_ids=tokens.unsqueeze(1),
                attention_mask=mask,
                position_ids=(prompt_lengths[row_of] + t).unsqueeze(1),
                use_cache=True,
                **{cache_kw: cache},
            )
            cache, logits = cache_of(out), logits_of(out)[:, -1]

        return _chunk_samples(chunk, prompts, responses, log_probs, lengths, finished)


def _keep_ended(turn_cache, cache, mask, ended, row_of, keys, prompts, fed, pad_multiple) -> None:
    """Keep the KV caches of the batch rows ``ended`` (they sampled their last token): the tokens they cover
    are the request's and the response's ``fed`` ones (the last sampled token was never fed)."""
    if ended.numel():
        rows = row_of[ended].tolist()
        ids = [prompts[r] + f for r, f in zip(rows, fed[rows].tolist())]
        keep_rows(turn_cache, cache, mask, ended.tolist(), [keys[r] for r in rows], ids, pad_multiple)


def _chunk_uniforms(
    chunk: Sequence[Request], params: SamplingParams, step: int, stream: int, positions, device
) -> Tensor:
    """The uniforms of a chunk's rows, ``[rows, T]``: each request's counter-based stream from its first token."""
    keys = stream_keys(
        params.seed,
        stream,
        step,
        torch.tensor([int(u) for u, _, _ in chunk], device=device),
        torch.tensor([int(j) for _, j, _ in chunk], device=device),
    )
    keys = shift_keys(keys, torch.tensor(positions, dtype=torch.long, device=device))
    return stream_uniforms(keys, params.max_response_length)


def _chunk_samples(chunk: Sequence[Request], prompts, responses, log_probs, lengths, finished) -> list[Sample]:
    """A chunk's generated rows (tensors) as ``Sample``s, in the chunk's order, each cut to its length."""
    responses, log_probs = responses.cpu().tolist(), log_probs.cpu().tolist()  # one conversion each
    lengths, finished = lengths.tolist(), finished.tolist()
    return [
        Sample(
            uid=int(uid),
            sample_index=int(j),
            prompt_ids=list(p),
            response_ids=responses[r][: lengths[r]],
            log_probs=log_probs[r][: lengths[r]],
            finished=finished[r],
        )
        for r, ((uid, j, _), p) in enumerate(zip(chunk, prompts))
    ]


def samples_to_batch(
    samples: Sequence[Sample],
    *,
    pad_token_id: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> RolloutBatch:
    """The samples as a :class:`splitproof.RolloutBatch` (``RolloutBatch.from_sequences``), one row each in
    the given order: prompts left-padded and responses right-padded with ``pad_token_id`` to the longest
    response (at least one column), ``response_mask`` = the generated tokens (EOS included; a multi-turn
    sample's ``token_mask``), ``old_log_probs`` = the rollout log-probs (``dtype``, default float64),
    advantages zero."""
    if not samples:
        raise RolloutError("samples", "no samples to batch")
    width = max(max(len(s.response_ids) for s in samples), 1)
    batch = RolloutBatch.from_sequences(
        [s.prompt_ids for s in samples],
        [s.response_ids for s in samples],
        [s.log_probs for s in samples],
        [0.0] * len(samples),
        response_mask=token_masks(samples),
        pad_token_id=pad_token_id,
        dtype=dtype or torch.float64,
        device=device,
        response_width=width,
    )
    return replace(batch, attention_mask=batch.attention_mask.bool(), response_mask=batch.response_mask.bool())
