"""Fixed-row products for an accelerator (``engine.device_rows``) and the sampler without host round trips:
checked on the CPU for what does not need a GPU — the result, its independence of the row count, the
dispatch of ``row_invariant`` by the input's device, and the top-k rule's device path."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitproof.engine import device_rows
from splitproof.engine.device_rows import fixed_block_linear
from splitproof.engine.row_invariant import row_invariant
from splitproof.rl.rollout.sampling import lower_ids_at_boundary, top_k_mask


def test_fixed_blocks_compute_the_linear_layer():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 37, 24, generator=g, dtype=torch.float64)
    w, b = torch.randn(40, 24, generator=g, dtype=torch.float64), torch.randn(40, generator=g, dtype=torch.float64)
    for rows in (1, 16, 256):
        assert torch.allclose(fixed_block_linear(x, w, b, rows=rows), F.linear(x, w, b), rtol=0, atol=1e-12)
    assert fixed_block_linear(x[:, :0], w).shape == (2, 0, 40)


def test_a_row_does_not_depend_on_the_rows_beside_it():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(600, 64, generator=g)
    w, b = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    whole = fixed_block_linear(x, w, b)
    for m in (1, 3, 17, 255, 256, 257, 599):
        assert torch.equal(fixed_block_linear(x[:m], w, b), whole[:m]), m
        assert torch.equal(fixed_block_linear(x[-m:], w, b), whole[-m:]), m  # another offset in its block


def test_row_invariant_dispatches_by_the_input_device(monkeypatch):
    seen = []
    real = fixed_block_linear

    def spy(x, weight, bias=None, rows=device_rows.DEVICE_ROWS):
        seen.append(x.device.type)
        return real(x, weight, bias, rows)

    monkeypatch.setattr("splitproof.engine.row_invariant.fixed_block_linear", spy)
    layer = nn.Linear(8, 20)
    with torch.no_grad(), row_invariant(layer):
        layer(torch.ones(3, 8))
        assert seen == []  # the CPU keeps its tile rule
        meta = nn.Linear(8, 20, device="meta")
        with row_invariant(meta):
            assert meta(torch.ones(3, 8, device="meta")).shape == (3, 20)
    assert seen == ["meta"]


def test_top_k_device_path_is_the_same_set():
    g = torch.Generator().manual_seed(2)
    z = torch.randint(0, 4, (64, 50), generator=g).double()  # many ties at every boundary
    z[::2] = torch.randn(32, 50, generator=g, dtype=torch.float64)  # and rows without ties
    for k in (1, 3, 7, 50):
        want = top_k_mask(z, k)
        assert bool((want.sum(-1) == k).all())
        kth = torch.topk(z, k, dim=-1).values[..., -1:]
        assert torch.equal(lower_ids_at_boundary(z > kth, z == kth, k), want)  # what a device computes
        got = top_k_mask(z.to("meta"), k)  # the device path: no host round trip, no data needed to trace
        assert got.device.type == "meta" and got.shape == want.shape
