"""Counter-based randomness and the per-token sampling rule.

Randomness. Sample j of prompt uid at step s, in stream ``stream`` (0 = training, 1 = validation), owns
the 64-bit key ``K = fold(fold(fold(fold(fold(0, seed), stream), step), uid), j)`` with
``fold(h, f) = mix64(mix64(h + γ) ^ f)``, ``mix64`` the splitmix64 finaliser and γ = 0x9E3779B97F4A7C15
(all arithmetic mod 2^64). ``fold`` is a bijection of f for a fixed h, so two keys can only collide
through a chance 64-bit coincidence between different prefixes. Token t draws one uniform
``u_t = (x >> 12 + 1/2) · 2^-52 ∈ (0, 1)`` with ``x = mix64(K + (t + 1)·γ)`` — the (t + 1)-th output of
a splitmix64 generator seeded with K. Nothing is stateful: the uniform of a token is a function of
(seed, stream, step, uid, j, t) alone, so which sequences share a forward, in which order, on which
rank, never changes it.

Sampling rule, per row of logits and nothing else (no batch-wide operation): ``z = logits / T``; top-k
keeps exactly the k largest z (ties to the lower id); top-p then keeps the smallest set of the most
probable remaining tokens (descending probability, ties to the lower id) whose renormalised mass reaches
p; the token is the inverse CDF of the kept probabilities in vocabulary-index order at ``u_t``: the
smallest id i with ``cumsum(w)_i > u_t · sum(w)``. One uniform per token: a Gumbel-max pick needs one
per vocabulary entry and measured over ten times dearer (docs/benchmarks.md). Greedy is
``argmax(logits)``, ties to the lowest id. The log-prob is ``log_softmax(z)`` at the token, before
top-k / top-p.
"""

from __future__ import annotations

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1


def _int64(value: int) -> int:
    """The two's-complement int64 with the same low 64 bits as ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


GAMMA = 0x9E3779B97F4A7C15
_GAMMA = _int64(GAMMA)
_MIX1 = _int64(0xBF58476D1CE4E5B9)
_MIX2 = _int64(0x94D049BB133111EB)
_UNIT = 2.0**-52


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 (``>>`` is arithmetic on signed tensors)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finaliser, a bijection of 64-bit words: int64 in, int64 out (wrapping arithmetic)."""
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def _fold(h: Tensor, field: Tensor) -> Tensor:
    return mix64(mix64(h + _GAMMA) ^ field)


def stream_keys(seed: int, stream: int, step: int, uids: Tensor, sample_indices: Tensor) -> Tensor:
    """int64 keys [R] of the streams (seed, stream, step, uid_r, j_r), on the device of ``uids`` (a list: the CPU)."""
    uids = torch.as_tensor(uids, dtype=torch.int64, device=uids.device if isinstance(uids, Tensor) else "cpu")
    sample_indices = torch.as_tensor(sample_indices, dtype=torch.int64, device=uids.device)
    if uids.shape != sample_indices.shape:
        raise ValueError(f"uids {tuple(uids.shape)} and sample_indices {tuple(sample_indices.shape)} differ in shape")

    def scalar(v: int) -> Tensor:
        return torch.tensor(_int64(v), dtype=torch.int64, device=uids.device)

    h = _fold(_fold(_fold(scalar(0), scalar(seed)), scalar(stream)), scalar(step))
    return _fold(_fold(h.expand(uids.shape), uids), sample_indices)


def shift_keys(keys: Tensor, positions: Tensor) -> Tensor:
    """Keys whose token t is token ``positions + t`` of the streams ``keys``: K + p·γ (mod 2^64), since
    the uniform of token t is mix64(K + (t + 1)·γ). A multi-turn episode continues one stream per
    sample across its turns this way."""
    return keys + positions.to(torch.int64) * _GAMMA  # wraps mod 2^64


def uniform_from_bits(x: Tensor) -> Tensor:
    """float64 in (0, 1) from the top 52 bits of int64 ``x``: (x >>> 12 + 1/2) · 2^-52 (exact)."""
    return (_shift_right(x, 12).to(torch.float64) + 0.5) * _UNIT


def token_uniforms(keys: Tensor, t: int) -> Tensor:
    """The uniform of token ``t`` of each stream in ``keys`` [R]: float64 [R] in (0, 1)."""
    if t < 0:
        raise ValueError(f"token index t must be >= 0, got {t}")
    return uniform_from_bits(mix64(keys + _int64((t + 1) * GAMMA)))


def stream_uniforms(keys: Tensor, count: int) -> Tensor:
    """The uniforms of tokens 0 .. count - 1 of each stream in ``keys`` [R]: float64 [R, count];
    column t equals ``token_uniforms(keys, t)``."""
    steps = torch.arange(1, count + 1, dtype=torch.int64, device=keys.device) * _GAMMA  # wraps mod 2^64
    return uniform_from_bits(mix64(keys.unsqueeze(-1) + steps))


# ------------------------------------------------------------------------------------------ the rule


def top_k_mask(z: Tensor, k: int) -> Tensor:
    """Bool [R, V]: exactly the ``k`` largest entries of each row, ties at the boundary to the lower id."""
    kth = torch.topk(z, k, dim=-1).values[..., -1:]
    above = z > kth
    at = z == kth
    if z.device.type == "cpu" and not bool(((above | at).sum(dim=-1) > k).any()):  # no excess ties: the set
        return above | at
    return lower_ids_at_boundary(above, at, k)  # on a device always: no host round trip


def lower_ids_at_boundary(above: Tensor, at: Tensor, k: int) -> Tensor:
    """The top-k set from the entries ``above`` the k-th value and those ``at`` it: the lower ids at it take
    the room left (a row without excess ties keeps all of them)."""
    room = k - above.sum(dim=-1, keepdim=True)
    return above | (at & (torch.cumsum(at, dim=-1) <= room))


def top_p_mask(weights: Tensor, p: float) -> Tensor:
    """Bool [R, V]: the nucleus of each row of non-negative ``weights`` (any positive scale): the most
    probable tokens, in descending order (ties to the lower id), while the mass before a token is < p."""
    ordered, order = torch.sort(weights, dim=-1, descending=True, stable=True)
    cumulative = torch.cumsum(ordered, dim=-1, dtype=torch.float64)
    before = cumulative - ordered.to(torch.float64)
    keep_sorted = before < p * cumulative[..., -1:]
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


CDF_BLOCK = 128
_BELOW_ONE = 1.0 - 2.0**-53  # the largest uniform; u · x < x for every positive float64 x


def _first_above(cdf: Tensor, target: Tensor) -> Tensor:
    """Per row of the non-decreasing ``cdf`` [R, n]: the first index whose entry exceeds ``target`` [R]."""
    return torch.searchsorted(cdf, target.unsqueeze(-1), right=True).squeeze(-1)


def inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids [R]: per row of non-negative ``weights`` [R, V] (some positive), the smallest id i with
    ``cumsum(w)_i > u · sum(w)`` for ``u`` in (0, 1); ids of zero weight are never chosen.

    Evaluated in two levels, which is the same search: the masses of blocks of ``CDF_BLOCK`` consecutive
    ids pick the block (float64 cumulative sum over the blocks), then the float64 cumulative sum inside
    that block alone picks the id, at the target's share of the block's mass. One vectorised pass over
    the vocabulary instead of a sequential float64 scan of all of it.
    """
    rows, vocab = weights.shape
    pad = -vocab % CDF_BLOCK
    padded = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    blocks = padded.reshape(rows, -1, CDF_BLOCK)
    mass = blocks.sum(dim=-1).to(torch.float64)
    outer = torch.cumsum(mass, dim=-1)
    u = uniforms.to(device=outer.device, dtype=torch.float64).clamp(max=_BELOW_ONE)
    target = u * outer[:, -1]  # < total, as u <= 1 - 2^-53
    block = _first_above(outer, target).unsqueeze(-1)  # a block of positive mass
    before = torch.nn.functional.pad(outer[:, :-1], (1, 0)).gather(-1, block).squeeze(-1)
    share = ((target - before) / mass.gather(-1, block).squeeze(-1)).clamp(max=_BELOW_ONE)
    inner = torch.cumsum(
        blocks.gather(1, block.unsqueeze(-1).expand(-1, 1, CDF_BLOCK)).squeeze(1), dim=-1, dtype=torch.float64
    )
    return block.squeeze(-1) * CDF_BLOCK + _first_above(inner, share * inner[:, -1])


def scaled_log_probs(logits: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``(z, log_softmax(z))`` with ``z = logits / T`` (T = 1 when ``temperature`` is 0), in float32 at
    least (float64 for float64 logits)."""
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    if temperature > 0 and temperature != 1.0:  # x / 1.0 == x: skip a pass
        z = z / temperature
    return z, torch.log_softmax(z, dim=-1)


def truncated_weights(z: Tensor, log_probs: Tensor, top_k: int, top_p: float) -> Tensor:
    """The probabilities ``exp(log_probs)`` with everything outside top-k, then outside the top-p nucleus
    of what is left, set to 0 (unnormalised). ``top_k`` <= 0 and ``top_p`` = 1 switch a filter off."""
    weights = log_probs.exp()
    if 0 < top_k < z.shape[-1]:
        kept = top_k_mask(z, top_k)
        if top_p < 1.0:  # the nucleus of the k survivors: sort k entries per row, not the vocabulary
            ids = kept.nonzero()[:, 1].view(z.shape[0], top_k)  # exactly k per row, ascending ids
            kept = torch.zeros_like(kept).scatter(-1, ids, top_p_mask(weights.gather(-1, ids), top_p))
        weights = torch.where(kept, weights, torch.zeros_like(weights))
    elif top_p < 1.0:
        weights = torch.where(top_p_mask(weights, top_p), weights, torch.zeros_like(weights))
    return weights


def sample_tokens(
    logits: Tensor,
    uniforms: Tensor,
    *,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    greedy: bool = False,
) -> tuple[Tensor, Tensor]:
    """``(tokens [R], log_probs [R])`` for logits [R, V] and one uniform per row (ignored when greedy).

    ``log_probs`` are ``log_softmax(logits / T)`` at the token, before top-k / top-p (see
    :func:`scaled_log_probs`). Greedy (or ``temperature`` 0) is ``argmax(logits)``, ties to the lowest id.
    """
    z, log_probs = scaled_log_probs(logits, temperature)
    if greedy or temperature == 0:
        tokens = torch.argmax(logits, dim=-1)  # first maximum: ties go to the lowest id
    else:
        tokens = inverse_cdf(truncated_weights(z, log_probs, top_k, top_p), uniforms)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
