"""Matrix products whose rows do not depend on how many rows share them (the no-grad passes).

A CPU BLAS picks its GEMM kernel by the shape, the row count M included, and kernels round differently.
Measured with torch 2.13's MKL and its AVX2 kernels (``benchmarks/row_invariant.py --probe``): a float64 row
rounds the same in every product only if it lies in a full tile of 4 rows — rows 4⌊M/4⌋ … M−1 take an
edge kernel —, a product of fewer than 4 rows takes another kernel, and with ``MKL_CBWR=COMPATIBLE`` a
float32 product of 4 rows does too; one output column (a value head) takes a matrix-vector kernel at
every M. So the same token's log-prob moved in its last bits with the number of rows in its forward.

``row_invariant(model)`` makes every ``nn.Linear`` of the model compute y = x Wᵀ + b as products whose row
count is a multiple of ``TILE`` between ``MIN_ROWS`` and ``MAX_ROWS`` (zero rows fill the last one):
``fixed_tile_linear``. Every row then lies in a full tile of the same kernel whatever the layout — measured
for all such M on the SmolLM2-135M and built-in shapes, float32 and float64, with MKL's AVX2 kernels,
ATen's ``default`` ones, ``MKL_CBWR=COMPATIBLE`` and on 2 threads — so a row's output is a function of the row, the
weights and the kernel family alone, at the cost of one plain product (a decode step streams each weight
once). A product with fewer than ``NARROW`` output columns keeps ``blocked_linear``: batches of exactly
``ROWS`` rows, at least two blocks (a batch of one block with one output column took another kernel).
Attention, norms and element-wise operations were measured row-independent already
(``tests/test_row_invariant.py``). On CPUs where MKL takes its Intel code path, products below 56 rows and
narrow ones moved with the row count whatever their tile, and the attention kernel's rows with the padding;
MKL's strict mode, which importing splitproof asks for (``splitproof.mkl_mode``), made every row count give
the same bits there, so the tiles above are what MKL's AMD path needs.

Only for no-grad passes: the backward of a block product with a shared weight would hold a gradient per
block. The differentiable update keeps its plain products; its promise is a tolerance (the weight
gradient sums over rows in a layout-dependent order anyway).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .device_rows import fixed_block_linear

ROWS = 16  # rows per block product (narrow outputs): a multiple of every tile height measured (4 on AVX2)
TILE = 4  # every product's row count is a multiple of this: MKL's row tile on AVX2
MIN_ROWS = 16  # fewest rows of a product: below 4 (and at 4 in float32 under MKL_CBWR) another kernel
MAX_ROWS = 2048  # most rows of one product: larger ones run in several, each of these sizes
NARROW = 16  # fewer output columns than this: the batched 16-row blocks (one column took a GEMV kernel)
VECTOR_ROWS = 32  # sequences: 32 × any width × any layer width fills whole pairs of 64-byte float32 vectors


def blocked_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows: int = ROWS) -> Tensor:
    """F.linear(x, weight, bias), computed as products of exactly ``rows`` rows each."""
    k, n_out = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    blocks = max(2, -(-m // rows))  # a batch of one block takes another kernel for one output column
    if m == 0:
        return F.linear(x, weight, bias)
    if blocks * rows != m:
        flat = torch.cat([flat, flat.new_zeros(blocks * rows - m, k)])
    wt = weight.t().expand(blocks, k, n_out)
    flat = flat.view(blocks, rows, k)
    if bias is None:
        out = torch.bmm(flat, wt)
    else:
        out = torch.baddbmm(bias.expand(blocks, rows, n_out), flat, wt)
    return out.reshape(blocks * rows, n_out)[:m].reshape(*x.shape[:-1], n_out)


def fixed_tile_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias), computed in products of a multiple of ``TILE`` rows, ``MIN_ROWS`` to
    ``MAX_ROWS`` each (zero rows fill the last); ``blocked_linear`` for fewer than ``NARROW`` columns."""
    k, n_out = x.shape[-1], weight.shape[0]
    m = x.numel() // k if k else 0
    if m % TILE == 0 and MIN_ROWS <= m <= MAX_ROWS and n_out >= NARROW and x.is_contiguous():
        return F.linear(x, weight, bias)  # the common case: one product of the m rows as they are (footnote 1)
    if n_out < NARROW:
        return blocked_linear(x, weight, bias)
    if m == 0:
        return F.linear(x, weight, bias)
    flat = x.reshape(m, k)
    if m <= MAX_ROWS:  # one product with 1-15 zero rows after the real ones (cat: the cheapest copy measured)
        filler = flat.new_zeros(max(MIN_ROWS, -(-m // TILE) * TILE) - m, k)
        return F.linear(torch.cat([flat, filler]), weight, bias)[:m].view(*x.shape[:-1], n_out)
    starts = range(0, m, MAX_ROWS)
    last = max(MIN_ROWS, -(-(m - starts[-1]) // TILE) * TILE)  # rows of the last product, filler included
    flat = F.pad(flat, (0, 0, 0, starts[-1] + last - m))
    if len(starts) == 1:
        out = F.linear(flat, weight, bias)
    else:
        out = torch.cat([F.linear(flat[s : s + MAX_ROWS], weight, bias) for s in starts])
    return out[:m].view(*x.shape[:-1], n_out)


# (1) F.linear folds the leading dimensions of a contiguous x into one product of m rows (mm; addmm with a
# bias). A strided x can take other paths — mm and then the bias added, another rounding; a batched product
# when the weight does not require grad — so it is flattened (copied) first, like every other product here.


def aligned_width(rows: int, width: int) -> int:
    """The width to which a no-grad pass widens a padded micro-batch of ``rows`` sequences (masked columns on
    the right): the least one at which every product of its layers has a multiple of ``TILE`` rows, at least
    ``MIN_ROWS``, so that none copies filler rows in — where that adds no more rows than the filler would
    (one sequence, two, a multiple of four, ...); else ``width`` itself."""
    rows = max(1, rows)
    filled = max(MIN_ROWS, -(-rows * width // TILE) * TILE)  # a product's rows, filler included
    return filled // rows if filled % rows == 0 else width


def rows_per_forward(width: int) -> int:
    """Sequences per forward of a no-grad pass over padded rows of ``width`` tokens: a multiple of ``VECTOR_ROWS``
    whose products have at most ``MAX_ROWS`` rows (at least ``VECTOR_ROWS``). A row's numbers are those of one
    forward of all: its products lie in full tiles either way, attention and norms are per row, and every
    piece starts its element-wise passes on a whole pair of vectors (ATen's scalar tail rounds otherwise).
    Measured faster than one forward of a large micro-batch: its activations stay in the CPU's cache."""
    return max(VECTOR_ROWS, MAX_ROWS // max(1, width) // VECTOR_ROWS * VECTOR_ROWS)


def _fixed_forward(module: nn.Linear):
    if module.weight.device.type != "cpu":  # another BLAS: every product one shape (engine.device_rows)
        return lambda x: fixed_block_linear(x, module.weight, module.bias)
    k, wide = max(1, module.in_features), module.out_features >= NARROW

    def forward(x: Tensor) -> Tensor:
        m = x.numel() // k
        if wide and m % TILE == 0 and MIN_ROWS <= m <= MAX_ROWS and x.is_contiguous():
            return F.linear(x, module.weight, module.bias)  # fixed_tile_linear's common case, inlined
        return fixed_tile_linear(x, module.weight, module.bias)

    return forward


@contextlib.contextmanager
def row_invariant(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every ``nn.Linear`` of ``model`` computes ``fixed_tile_linear`` (no grad only).

    Re-entrant: an already swapped module is left to the outer block, which restores it."""
    if torch.is_grad_enabled():
        raise RuntimeError("row_invariant is for no-grad passes: wrap it in torch.no_grad()")
    swapped = [m for m in model.modules() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
    for module in swapped:
        module.forward = _fixed_forward(module)
    try:
        yield model
    finally:
        for module in swapped:
            del module.forward
