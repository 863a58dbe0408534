"""What one float32 rounding crossing inside Hugging Face's RMSNorm does to a float64 update.

HF's RMSNorm casts its input to float32 before normalizing, also in a float64 model, so its output is a
step function of its input at float32 resolution. Two layouts whose activations differ in their last
float64 bits usually give the same norm output; when an input entry lies within that difference of a
float32 rounding midpoint, the token's normalized vector moves by up to 2^-24 of itself.

    python scripts/norm_crossing.py [--lr 1e-3] [--steps 3]

The built-in model in float64, a weighted log-prob loss over 16 x 24 random tokens (weights summing to 0,
as group advantages do), the update's backward (``float64_norm_gradients``). The final norm's input entry
nearest a float32 midpoint is moved across it, and, for comparison, the same distance away from it; printed:
the gradient change of three tensors, then the weights after ``--steps`` AdamW steps from the crossed
gradient (first step) against the plain one: the largest element difference and the difference relative
to the update (‖Δw‖ / ‖w − w0‖).
"""

from __future__ import annotations

import argparse

import torch

from splitproof.engine.norm_gradients import float64_norm_gradients
from splitproof.rl.config.schema import ModelConfig
from splitproof.rl.models.policy import load_policy


def nearest_midpoint(x: torch.Tensor) -> tuple[tuple[int, ...], float, float]:
    """The entry of ``x`` nearest a float32 rounding midpoint: (index, relative distance, direction ±1)."""
    x32 = x.float().double()
    up = (torch.nextafter(x.float(), torch.tensor(float("inf"))).double() - x32).abs()
    mid = x32 + torch.sign(x - x32) * up / 2
    distance = (x - mid).abs() / x.abs().clamp_min(1e-30)
    flat = int(distance.argmin())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), x.shape))
    return index, float(distance.view(-1)[flat]), float(torch.sign(mid - x)[index] * torch.sign(x[index]))


def gradients(model, ids, weights, norm, index, factor: float) -> dict[str, torch.Tensor]:
    """The loss's gradients with the norm's input entry ``index`` scaled by ``factor``."""

    def shift(module, args):
        x = args[0].clone()
        x[index] = x[index] * factor
        return (x,)

    hook = norm.register_forward_pre_hook(shift)
    model.zero_grad()
    with float64_norm_gradients(model):
        logits = model(input_ids=ids).logits
        log_probs = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        (-(weights * log_probs).mean()).backward()
    hook.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def adamw(start: torch.Tensor, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
    w = start.detach().clone().requires_grad_(True)
    optimizer = torch.optim.AdamW([w], lr=lr, weight_decay=0.01)
    for g in grads:
        w.grad = g.clone()
        optimizer.step()
    return w.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path="builtin://charlm"), dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (16, 24))
    weights = torch.randn(16, 1, dtype=torch.float64)
    weights -= weights.mean()
    norm, captured = model.model.norm, {}
    hook = norm.register_forward_pre_hook(lambda module, a: captured.update(x=a[0].detach().clone()))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    index, distance, toward = nearest_midpoint(captured["x"])
    print(f"final norm input {index}: {distance:.2e} (relative) from a float32 midpoint")
    away = gradients(model, ids, weights, norm, index, 1 - toward * 4 * distance)
    crossed = gradients(model, ids, weights, norm, index, 1 + toward * 4 * distance)
    farther = gradients(model, ids, weights, norm, index, 1 - toward * 8 * distance)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.1.mlp.down_proj.weight"):
        change, plain = (crossed[name] - away[name]).abs().view(-1), (farther[name] - away[name]).abs()
        top = change.sort().values
        print(
            f"{name}: crossing moves the gradient by {float(top[-1]):.2e} at most (an element of size "
            f"{float(away[name].view(-1)[int(change.argmax())].abs()):.2e}; the next {float(top[-2]):.2e}); "
            f"the same shift without crossing: {float(plain.max()):.2e}"
        )
    key = "model.embed_tokens.weight"
    start = model.model.embed_tokens.weight
    base = adamw(start, [away[key]] * args.steps, args.lr)
    bumped = adamw(start, [crossed[key]] + [away[key]] * (args.steps - 1), args.lr)
    diff = (bumped - base).abs()
    j = int(diff.argmax())
    print(
        f"AdamW x{args.steps} (lr {args.lr:g}): weights differ by {float(diff.max()):.2e} at most (an element "
        f"that moved {float((base - start.detach()).view(-1)[j]):.2e}, gradient {float(away[key].view(-1)[j]):.2e}); "
        f"{float(diff.norm() / (base - start.detach()).norm()):.2e} of the update"
    )


if __name__ == "__main__":
    main()
