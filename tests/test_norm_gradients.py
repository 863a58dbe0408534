"""Float64 RMSNorm gradients in the update: Hugging Face's norm rounds a float64 model's values and upstream
gradients to float32; within ``float64_norm_gradients`` the forward keeps its bits and the gradient is the
exact formula's in float64, so it no longer jumps by 2⁻²⁴ when its inputs move in their last bits."""

import pytest
import torch

from splitproof.engine.norm_gradients import float64_norm_gradients
from splitproof.hf_models import tiny_causal_lm


def _exact_norm(x, weight, eps):
    """The formula in float64 throughout: w · x · (mean(x²) + ε)^(-1/2)."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _grads(norm, x, upstream):
    x = x.clone().requires_grad_(True)
    norm.zero_grad()
    y = norm(x)
    (y * upstream).sum().backward()
    return y.detach(), x.grad, norm.weight.grad.clone()


def test_same_values_and_the_exact_formulas_gradient():
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=3)
    norm = model.model.norm
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel(), dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, norm.weight.numel(), generator=g, dtype=torch.float64)
    upstream = torch.randn(x.shape, generator=g, dtype=torch.float64)
    plain = _grads(norm, x, upstream)
    with float64_norm_gradients(model):
        ours = _grads(norm, x, upstream)
    xr = x.clone().requires_grad_(True)
    (_exact_norm(xr, norm.weight.detach(), norm.variance_epsilon) * upstream).sum().backward()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert torch.equal(ours[0], plain[0])  # the forward's bits are Hugging Face's
    assert rel(ours[1], xr.grad) <= 1e-14
    assert rel(ours[2], plain[2]) <= 1e-14  # ∂y/∂w is the forward's own fl32(x·r): as Hugging Face's
    assert rel(plain[1], xr.grad) > 1e-10  # the control: Hugging Face's own backward is float32-accurate
    assert "forward" not in vars(norm)  # restored


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_every_norm_of_a_float64_model_is_swapped_and_no_other(arch):
    norms = lambda model: [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]  # noqa: E731
    model = tiny_causal_lm(arch, dtype=torch.float64)
    with float64_norm_gradients(model):
        assert norms(model) and all("forward" in vars(m) for m in norms(model))
        assert not any("forward" in vars(m) for m in model.modules() if m not in norms(model))
    model32 = tiny_causal_lm(arch, dtype=torch.float32)
    with float64_norm_gradients(model32):
        assert not any("forward" in vars(m) for m in model32.modules())
