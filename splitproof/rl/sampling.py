"""Counter-based randomness and the per-token sampling rule.

Randomness. Sample j of prompt uid at step s, in stream ``stream`` (0 = training, 1 = validation), owns the
64-bit key ``K = fold(fold(fold(fold(fold(0, seed), stream), step), uid), j)`` with
``fold(h, f) = mix64(mix64(h + γ) ^ f)``, ``mix64`` the splitmix64 finaliser and γ = 0x9E3779B97F4A7C15
(all arithmetic mod 2^64). ``fold`` is a bijection of f for a fixed h, so two keys can only collide
through a chance 64-bit coincidence between different prefixes. Its token t draws one uniform ``u_t = (x >> 12 + 1/2) · 2^-52 ∈ (0, 1)``
with ``x = mix64(K + (t + 1)·γ)`` — the (t + 1)-th output of a splitmix64 generator seeded with K.
Nothing is stateful: the uniform of a token is a function of (seed, stream, step, uid, j, t) alone, so
which sequences share a forward, in which order, on which rank, never changes it.

Sampling rule, per row of logits and nothing else (no batch-wide operation):
``z = logits / T``; top-k keeps exactly the k largest z (ties to the lower id); top-p then keeps the
smallest set of the most probable remaining tokens (descending probability, ties to the lower id) whose
renormalised mass reaches p; the token is the inverse CDF of the kept probabilities in vocabulary-index
order at ``u_t``: the smallest id i with ``cumsum(w)_i > u_t · sum(w)``. Greedy is ``argmax(logits)``,
ties to the lowest id. The log-prob is ``log_softmax(z)`` at the token (before top-k / top-p).
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
_UNIT = 2.0 ** -52


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
    """int64 keys [R] of the streams (seed, stream, step, uid_r, j_r), on the device of ``uids``."""
    uids = torch.as_tensor(uids, dtype=torch.int64)
    sample_indices = torch.as_tensor(sample_indices, dtype=torch.int64, device=uids.device)
    if uids.shape != sample_indices.shape:
        raise ValueError(f"uids {tuple(uids.shape)} and sample_indices {tuple(sample_indices.shape)} differ in shape")

    def scalar(v: int) -> Tensor:
        return torch.tensor(_int64(v), dtype=torch.int64, device=uids.device)

    h = _fold(_fold(_fold(scalar(0), scalar(seed)), scalar(stream)), scalar(step))
    return _fold(_fold(h.expand(uids.shape), uids), sample_indices)


def uniform_from_bits(x: Tensor) -> Tensor:
    """float64 in (0, 1) from the top 52 bits of int64 ``x``: (x >>> 12 + 1/2) · 2^-52 (exact)."""
    return (_shift_right(x, 12).to(torch.float64) + 0.5) * _UNIT


def token_uniforms(keys: Tensor, t: int) -> Tensor:
    """The uniform of token ``t`` of each stream in ``keys`` [R]: float64 [R] in (0, 1)."""
    if t < 0:
        raise ValueError(f"token index t must be >= 0, got {t}")
    return uniform_from_bits(mix64(keys + _int64((t + 1) * GAMMA)))


# ------------------------------------------------------------------------------------------ the rule

def top_k_mask(z: Tensor, k: int) -> Tensor:
    """Bool [R, V]: exactly the ``k`` largest entries of each row, ties at the boundary to the lower id."""
    kth = torch.topk(z, k, dim=-1).values[..., -1:]
    above = z > kth
    at = z == kth
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


def inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Token ids [R]: the smallest id i with ``cumsum(weights)_i > u · sum(weights)`` (float64 sums)."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    total = cdf[..., -1:].contiguous()
    tokens = torch.searchsorted(cdf, uniforms.to(cdf.device).unsqueeze(-1) * total, right=True)
    # u·total can round up to total: then take the last token of positive weight.
    last_positive = torch.searchsorted(cdf, total, right=False)
    return torch.where(tokens < cdf.shape[-1], tokens, last_positive).squeeze(-1)


def sample_tokens(logits: Tensor, uniforms: Tensor, *, temperature: float = 1.0, top_k: int = -1,
                  top_p: float = 1.0, greedy: bool = False) -> tuple[Tensor, Tensor]:
    """``(tokens [R], log_probs [R])`` for logits [R, V] and one uniform per row (ignored when greedy).

    ``log_probs`` are ``log_softmax(logits / T)`` at the token (T = 1 when ``temperature`` is 0), in
    float32 at least (float64 for float64 logits). ``top_k`` <= 0 and ``top_p`` = 1 switch a filter off.
    """
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    if temperature > 0 and temperature != 1.0:  # x / 1.0 == x: skip a pass
        z = z / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    if greedy or temperature == 0:
        tokens = torch.argmax(logits, dim=-1)  # first maximum: ties go to the lowest id
    else:
        weights = log_probs.exp()
        vocab = z.shape[-1]
        if 0 < top_k < vocab:
            weights = torch.where(top_k_mask(z, top_k), weights, torch.zeros_like(weights))
        if top_p < 1.0:
            weights = torch.where(top_p_mask(weights, top_p), weights, torch.zeros_like(weights))
        tokens = inverse_cdf(weights, uniforms)
    return tokens, log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
