"""Matrix products whose rows do not depend on how many rows share them (the no-grad passes).

A CPU BLAS picks its GEMM kernel by the shape, the row count M included, and kernels round differently.
Measured with torch 2.13's MKL on an AVX2 machine (float64): a row rounds the same in every product
only if it lies in a full tile of 4 rows — rows 4⌊M/4⌋ … M−1 take an edge kernel — and with
``MKL_CBWR`` set, products of many rows take another kernel altogether. So the same token's log-prob
moved in its last bits with the number of rows in its forward: a log-prob micro-batch of 1, a token
budget or a DP shard changed it.

``row_invariant(model)`` makes every ``nn.Linear`` of the model compute its rows in blocks of exactly
``ROWS`` rows: y = x Wᵀ + b as one batched product over [n, ROWS, K] (zero rows fill the last block), so
every GEMM the BLAS runs has M = ROWS whatever the layout, and a row's output is a function of the row,
the weights and the kernel family alone. A product has at least two blocks: a batch of one block with one
output column (a value head) took another kernel. Attention, norms and element-wise operations were measured
row-independent already (``tests/test_row_invariant.py``).

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

ROWS = 16  # rows per block product: a multiple of every tile height measured (4 on AVX2)


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


def _blocked_forward(module: nn.Linear):
    def forward(x: Tensor) -> Tensor:
        return blocked_linear(x, module.weight, module.bias)
    return forward


@contextlib.contextmanager
def row_invariant(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every ``nn.Linear`` of ``model`` computes in fixed row blocks (no grad only).

    Re-entrant: an already swapped module is left to the outer block, which restores it."""
    if torch.is_grad_enabled():
        raise RuntimeError("row_invariant is for no-grad passes: wrap it in torch.no_grad()")
    swapped = [m for m in model.modules() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
    for module in swapped:
        module.forward = _blocked_forward(module)
    try:
        yield model
    finally:
        for module in swapped:
            del module.forward
