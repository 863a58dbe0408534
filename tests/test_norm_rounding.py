"""The float64 bound docs/semantics.md states for layouts: Hugging Face's RMSNorm rounds its input to
float32 first, also in a float64 model, so its output is a function of fl32(input): a last-bit change of the
input leaves it unchanged unless the input crosses a float32 rounding midpoint, and then the normalized
vector moves by about 2^-24 of itself (what one such crossing does to an update: scripts/norm_crossing.py)."""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm


def test_a_float64_rms_norm_sees_its_input_at_float32_resolution():
    norm = LlamaRMSNorm(8).double()
    x = torch.randn(3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x32 = x.float().double()
    with torch.no_grad():
        base = norm(x32)
        nudged = norm(torch.nextafter(x32, x32 + 1))  # one float64 ulp: the same float32 input
        up = torch.nextafter(x32.float(), x32.float() + 1).double()  # the next float32 value
        crossed = x32.clone()
        crossed[0, 0] = up[0, 0]
        moved = norm(crossed)
    assert torch.equal(base, nudged)
    change = (moved[0] - base[0]).abs().max() / base[0].abs().max()
    assert 0 < change <= 2.0**-22 and torch.equal(moved[1:], base[1:])
