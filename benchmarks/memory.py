"""Peak memory of one update step vs microbatch size and vs minibatch size.

The peak is the high-water mark of tensor memory allocated during the step above what was allocated
when it began (so the gradients, allocated by the first backward, are in it; weights and the rollout
batch are not). On CUDA: torch.cuda.max_memory_allocated. On CPU: every allocation and free the torch
CPU allocator reports to the profiler (profile_memory=True), replayed in time order (tracemalloc does
not see torch's allocations, and the process RSS keeps freed pages, so neither measures this). Beside it,
the largest single tensor any module returned in the step (forward hooks), usually the logits.

    python benchmarks/memory.py [--quick] [--device cuda] [--threads N]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import benchlib as bl  # noqa: E402

NAME = "memory"
GOAL_FLAT = 1.10  # peak at the largest minibatch / peak at the smallest


def _largest_tensor_bytes(out) -> int:
    if isinstance(out, torch.Tensor):
        return out.numel() * out.element_size()
    if isinstance(out, dict):
        return max((_largest_tensor_bytes(v) for v in out.values()), default=0)
    if isinstance(out, (tuple, list)):
        return max((_largest_tensor_bytes(v) for v in out), default=0)
    if hasattr(out, "to_tuple"):
        return _largest_tensor_bytes(out.to_tuple())
    return 0


class LargestActivation:
    """Forward hooks on every module: the largest tensor any module returned."""

    def __init__(self, model):
        self.bytes = 0
        self.handles = [m.register_forward_hook(self._hook) for m in model.modules()]

    def _hook(self, module, args, out):
        self.bytes = max(self.bytes, _largest_tensor_bytes(out))

    def remove(self):
        for h in self.handles:
            h.remove()


def _replay_peak(deltas: list[tuple[int, int]]) -> int:
    current = peak = 0
    for _, delta in sorted(deltas):
        current += delta
        peak = max(peak, current)
    return peak


def cpu_peak_bytes(fn) -> tuple[int, str]:
    """High-water mark of torch CPU allocations during fn(), from the profiler's memory records."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    try:  # every allocation and free, with its time stamp
        events = prof.profiler.kineto_results.events()
        deltas = [(e.start_ns(), e.nbytes()) for e in events
                  if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
        if deltas:
            return _replay_peak(deltas), "profiler memory records"
    except (AttributeError, RuntimeError):
        pass
    # Fallback: net allocation per profiled op, in start order (misses peaks inside one op).
    deltas = [(e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()]
    return _replay_peak(deltas), "profiler per-op memory (approximate)"


def peak_bytes(env: bl.Env, fn) -> tuple[int, str]:
    if env.device.type == "cuda":
        torch.cuda.synchronize(env.device)
        torch.cuda.reset_peak_memory_stats(env.device)
        base = torch.cuda.memory_allocated(env.device)
        fn()
        torch.cuda.synchronize(env.device)
        return torch.cuda.max_memory_allocated(env.device) - base, "torch.cuda.max_memory_allocated"
    return cpu_peak_bytes(fn)


def run(env: bl.Env) -> dict:
    from splitproof.config import LossConfig
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine.config import UpdateConfig
    from splitproof.engine.update import update_policy

    if env.quick:
        P, T, micro_sizes, mini_fixed, mini_sizes, micro_fixed = 8, 16, (2, 4), 8, (4, 8), 2
    else:
        P, T, micro_sizes, mini_fixed, mini_sizes, micro_fixed = 32, 128, (4, 8, 16, 32), 64, (16, 32, 64, 128), 8
    model = bl.bench_model(env)
    batch = synthetic_rollout(model, max(mini_sizes + (mini_fixed,)), P, T, seed=1, vary_lengths=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = bl.WeightSnapshot(model)
    losses = {"vanilla": LossConfig(), "kl_cov (auto)": LossConfig(loss_mode="kl_cov", kl_cov_ratio=2e-4)}
    settings = [("microbatch size", "vanilla", mini_fixed, m) for m in micro_sizes]
    settings += [("minibatch size", loss, b, micro_fixed) for loss in losses for b in mini_sizes]

    def step(loss, mini, micro):
        part = batch.select(list(range(mini)))
        config = UpdateConfig(loss=losses[loss], ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro)
        return lambda: update_policy(model, optimizer, part, config)

    for loss in losses:  # warm-up: first-call allocations (kernels, caches) stay out of the measurements
        snapshot.restore()
        step(loss, mini_fixed, max(micro_sizes))()
    rows = []
    for sweep, loss, mini, micro in settings:
        bl.log(f"[{NAME}] {sweep}: loss {loss}, minibatch {mini}, microbatch {micro}")
        snapshot.restore()
        hooks = LargestActivation(model)
        try:
            peak, method = peak_bytes(env, step(loss, mini, micro))
        finally:
            hooks.remove()
        rows.append(dict(sweep=sweep, loss=loss, minibatch=mini, microbatch=micro, peak=peak,
                         largest_activation=hooks.bytes, method=method))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = {}
    for loss in losses:
        sweep = [r for r in rows if r["sweep"] == "minibatch size" and r["loss"] == loss]
        flat[loss] = sweep[-1]["peak"] / sweep[0]["peak"]
    for r in rows:
        first = next(x for x in rows if x["sweep"] == r["sweep"] and x["loss"] == r["loss"])
        r["relative"] = r["peak"] / first["peak"]
    return dict(rows=rows, flat=flat, flat_ok=all(v <= GOAL_FLAT for v in flat.values()), param_bytes=param_bytes,
                model=bl.describe_model(model), prompt=P, response=T, method=rows[0]["method"],
                mini_sizes=mini_sizes, micro_sizes=micro_sizes)


def _mib(x: int) -> str:
    return f"{x / 2**20:.2f}"


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    headers = ["sweep", "loss", "minibatch (sequences)", "microbatch (sequences)", "peak MiB",
               "peak / first of sweep", "largest activation MiB"]
    rows = [[r["sweep"], r["loss"], r["minibatch"], r["microbatch"], _mib(r["peak"]), f"{r['relative']:.3f}",
             _mib(r["largest_activation"])] for r in result["rows"]]
    goal = bl.table(["goal", "loss", "measured (peak at the largest / smallest minibatch)", "verdict"],
                    [[f"flat in minibatch size (≤ {GOAL_FLAT})", loss, f"{ratio:.3f}", bl.verdict(ratio, GOAL_FLAT)]
                     for loss, ratio in result["flat"].items()])
    setup = (f"Setup: {result['model']} (weights {_mib(result['param_bytes'])} MiB; the gradients add as much "
             f"to every peak); every sequence {result['prompt']} prompt + {result['response']} response tokens, "
             f"so every microbatch has the same width; one optimizer step, SGD. Peak measured by: "
             f"{result['method']}. Single measurement per setting (memory is deterministic).")
    return bl.section(NAME, "Peak memory", command, env, load_before, [setup, bl.table(headers, rows), goal])


def main(argv: list[str] | None = None) -> dict:
    args = bl.parser(__doc__.splitlines()[0], repeats=1, quick_repeats=1).parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
