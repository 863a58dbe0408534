"""Fixed-row products on an accelerator (``engine.row_invariant`` on a device other than the CPU).

A GPU's BLAS (cuBLAS) also picks its GEMM kernel — tile shape, split-K, the order of the K sums — by the
problem's shape, the row count M included, so a row's result can change with the rows that share its
product. The CPU's rule (a multiple of the AVX2 row tile) is MKL's; nothing like it is documented for
cuBLAS. What holds for any BLAS is that one shape takes one kernel: ``fixed_block_linear`` computes
y = x Wᵀ + b as products of exactly ``DEVICE_ROWS`` rows each (zero rows fill the last one), so a row's
output is a function of the row and the weights alone, whatever the batch.

The cost is the filler rows: a decode step of r rows computes ``DEVICE_ROWS`` (on a GPU a small product
is bound by reading the weights, not by its rows), and a long pass runs ⌈M / DEVICE_ROWS⌉ products.
``DEVICE_ROWS`` = 256 is a guess that keeps both small; scripts/device_check.py measures a pass with and
without it on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

DEVICE_ROWS = 256  # rows of every product on an accelerator


def fixed_block_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, rows: int = DEVICE_ROWS) -> Tensor:
    """F.linear(x, weight, bias) as products of exactly ``rows`` rows each."""
    k, n_out = x.shape[-1], weight.shape[0]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if m == 0:
        return F.linear(x, weight, bias)
    blocks = -(-m // rows)
    flat = F.pad(flat, (0, 0, 0, blocks * rows - m))
    out = torch.cat([F.linear(flat[i * rows : (i + 1) * rows], weight, bias) for i in range(blocks)])
    return out[:m].view(*x.shape[:-1], n_out)
