"""Peak memory of one update step vs microbatch size and vs minibatch size; and of `splitproof diagnose`.

The peak is the high-water mark of tensor memory allocated during the step above what was allocated
when it began (so the gradients, allocated by the first backward, are in it; weights and the rollout
batch are not). On CUDA: torch.cuda.max_memory_allocated. On CPU: every allocation and free the torch
CPU allocator reports to the profiler (profile_memory=True), replayed in time order (tracemalloc does
not see torch's allocations, and the process RSS keeps freed pages, so neither measures this). Beside it,
the largest single tensor any module returned in the step (forward hooks), usually the logits.

The diagnosis part runs a KL-Cov diagnosis (8 sequences × 16 response tokens, float64) with one split
and with three, on ``--diagnose-model`` (a local Hugging Face directory; default: the embedded tiny
model), and samples the machine memory of this process and its data-parallel workers (the sum of
their proportional set sizes, so pages the forked workers share are counted once) every 50 ms. It
reports the peak above the memory before the model was loaded, in model sizes (parameter bytes).

    python benchmarks/memory.py [--quick] [--device cuda] [--threads N] [--diagnose-model DIR]
"""

from __future__ import annotations

import gc
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch

import bench_models as bm
import benchlib as bl

NAME = "memory"
GOAL_FLAT = 1.10  # peak at the largest minibatch / peak at the smallest
DIAGNOSE_SPLITS = (("dp:2",), ("even:8", "dp:2+sizes:1,3", "packed:64"))
GOAL_SPLITS = 1.10  # diagnosis peak with three splits / with one: constant in the number of splits
GOAL_MODEL_SIZES = 6.0  # diagnosis peak, machine-wide, in model sizes (the loaded model counts as 1)


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
        deltas = [
            (e.start_ns(), e.nbytes())
            for e in events
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
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


def _pss_bytes(pid: int) -> int:
    """Proportional set size of a process (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children.get(pid, [])
    return out


def tree_pss_bytes(root: int | None = None) -> int:
    """Machine memory of a process and every process below it (forked workers share pages: PSS)."""
    return sum(_pss_bytes(pid) for pid in _descendants(os.getpid() if root is None else root))


class PeakMemory:
    """Samples ``tree_pss_bytes`` (and this process's own PSS) on a thread; ``total`` and ``own`` peaks."""

    def __init__(self, interval: float = 0.05):
        self.interval, self.total, self.own = interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.total = max(self.total, tree_pss_bytes())
            self.own = max(self.own, _pss_bytes(os.getpid()))
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def diagnosis_memory(env: bl.Env) -> dict:
    """Peak machine memory of a KL-Cov diagnosis with one split and with three, in model sizes."""
    from splitproof.diagnose import scenarios as sc
    from splitproof.diagnose.baseline_store import spills_to_disk
    from splitproof.diagnose.context import ModelSpec, build_model
    from splitproof.diagnose.diagnosis import Diagnosis

    spec = ModelSpec(path=env.args.diagnose_model, dtype="float64")
    gc.collect()
    before = tree_pss_bytes()
    model = build_model(spec)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = tree_pss_bytes() - before
    rows = []
    for splits in DIAGNOSE_SPLITS:
        bl.log(f"[{NAME}] diagnosis with splits {', '.join(splits)}")
        scenario = sc.custom(
            seed=0, loss_mode="kl_cov", kl_cov_ratio=0.01, sequences=8, response_length=16, splits=splits
        )
        gc.collect()
        with PeakMemory() as peak:
            diagnosis = Diagnosis([scenario], spec, model=model).run()
            passed = diagnosis.results(scenario)["passed"]
        del diagnosis
        rows.append(
            dict(
                splits=" ".join(splits),
                peak=peak.total - before,
                own=peak.own - before,
                ratio=(peak.total - before) / model_bytes,
                own_ratio=(peak.own - before) / model_bytes,
                passed=passed,
            )
        )
    growth = rows[-1]["peak"] / rows[0]["peak"]
    name = os.path.basename(os.path.normpath(spec.path)) if spec.path else "the embedded tiny random Llama"
    params = sum(p.numel() for p in model.parameters())
    return dict(
        rows=rows,
        model=f"{name} ({type(model).__name__}, {params / 1e6:.1f} M parameters)",
        model_bytes=model_bytes,
        loaded=loaded,
        growth=growth,
        spilled=spills_to_disk(),
    )


def run(env: bl.Env) -> dict:
    from splitproof.diagnose.synthetic import synthetic_rollout
    from splitproof.engine.update import update_policy
    from splitproof.engine.update_config import UpdateConfig
    from splitproof.loss_config import LossConfig

    if env.quick:
        P, T, micro_sizes, mini_fixed, mini_sizes, micro_fixed = 8, 16, (2, 4), 8, (4, 8), 2
    else:
        P, T, micro_sizes, mini_fixed, mini_sizes, micro_fixed = 32, 128, (4, 8, 16, 32), 64, (16, 32, 64, 128), 8
    model = bm.bench_model(env)
    batch = synthetic_rollout(model, max(mini_sizes + (mini_fixed,)), P, T, seed=1, vary_lengths=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    snapshot = bm.WeightSnapshot(model)
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
        rows.append(
            dict(
                sweep=sweep,
                loss=loss,
                minibatch=mini,
                microbatch=micro,
                peak=peak,
                largest_activation=hooks.bytes,
                method=method,
            )
        )
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    flat = {}
    for loss in losses:
        sweep = [r for r in rows if r["sweep"] == "minibatch size" and r["loss"] == loss]
        flat[loss] = sweep[-1]["peak"] / sweep[0]["peak"]
    for r in rows:
        first = next(x for x in rows if x["sweep"] == r["sweep"] and x["loss"] == r["loss"])
        r["relative"] = r["peak"] / first["peak"]
    description = bm.describe_model(model)
    model = optimizer = snapshot = batch = None  # free them before the diagnosis measures its own peak
    return dict(
        rows=rows,
        flat=flat,
        flat_ok=all(v <= GOAL_FLAT for v in flat.values()),
        param_bytes=param_bytes,
        model=description,
        prompt=P,
        response=T,
        method=rows[0]["method"],
        mini_sizes=mini_sizes,
        micro_sizes=micro_sizes,
        diagnosis=diagnosis_memory(env),
    )


def _mib(x: int) -> str:
    return f"{x / 2**20:.2f}"


def render(env: bl.Env, result: dict, load_before: str, command: str) -> str:
    headers = [
        "sweep",
        "loss",
        "minibatch (sequences)",
        "microbatch (sequences)",
        "peak MiB",
        "peak / first of sweep",
        "largest activation MiB",
    ]
    rows = [
        [
            r["sweep"],
            r["loss"],
            r["minibatch"],
            r["microbatch"],
            _mib(r["peak"]),
            f"{r['relative']:.3f}",
            _mib(r["largest_activation"]),
        ]
        for r in result["rows"]
    ]
    goal = bl.table(
        ["goal", "loss", "measured (peak at the largest / smallest minibatch)", "verdict"],
        [
            [f"flat in minibatch size (≤ {GOAL_FLAT})", loss, f"{ratio:.3f}", bl.verdict(ratio, GOAL_FLAT)]
            for loss, ratio in result["flat"].items()
        ],
    )
    setup = (
        f"Setup: {result['model']} (weights {_mib(result['param_bytes'])} MiB; the gradients add as much "
        f"to every peak); every sequence {result['prompt']} prompt + {result['response']} response tokens, "
        f"so every microbatch has the same width; one optimizer step, SGD. Peak measured by: "
        f"{result['method']}. Single measurement per setting (memory is deterministic)."
    )
    return bl.section(
        NAME,
        "Peak memory",
        command,
        env,
        load_before,
        [setup, bl.table(headers, rows), goal] + render_diagnosis(result["diagnosis"]),
    )


def render_diagnosis(d: dict) -> list[str]:
    model_mib = d["model_bytes"] / 2**20
    setup = (
        f"`splitproof diagnose` on {d['model']} (float64, {model_mib:.1f} MiB of parameters = 1 model size; "
        f"loading it added {d['loaded'] / d['model_bytes']:.2f} model sizes): KL-Cov, kl_cov_ratio 0.01, "
        "8 sequences × 16 response tokens, SGD; each split is compared with the baseline and with the control "
        "(DDP workers for `dp:2`). Peak of the summed proportional set sizes of the process and its "
        "workers, sampled every 50 ms, above the memory before the model was loaded (so the loaded model "
        "counts as 1). The baseline's gradient and parameters after the step (2 model sizes) "
        + (
            'wait in a temporary file on disk (docs/diagnose.md, "Memory"), outside these figures.'
            if d.get("spilled")
            else "stay in memory (the temporary directory is a memory file system), inside these figures."
        )
    )
    rows = [
        [
            r["splits"],
            f"{r['peak'] / 2**20:.0f}",
            f"{r['ratio']:.2f}",
            f"{r['own_ratio']:.2f}",
            "pass" if r["passed"] else "FAIL",
        ]
        for r in d["rows"]
    ]
    table = bl.table(
        ["splits", "peak MiB", "peak / model size", "of which this process / model size", "diagnosis verdict"], rows
    )
    worst = max(r["ratio"] for r in d["rows"])
    goal = bl.table(
        ["goal", "measured", "verdict"],
        [
            [
                f"diagnosis memory constant in the number of splits (≤ {GOAL_SPLITS})",
                f"{d['growth']:.3f} (peak with three splits / with one)",
                bl.verdict(d["growth"], GOAL_SPLITS),
            ],
            [
                f"diagnosis peak in model sizes, machine-wide (≤ {GOAL_MODEL_SIZES:g})",
                f"{worst:.2f} (the larger peak)",
                bl.verdict(worst, GOAL_MODEL_SIZES),
            ],
        ],
    )
    return [setup, table, goal]


def main(argv: list[str] | None = None) -> dict:
    parser = bl.parser(__doc__.splitlines()[0], repeats=1, quick_repeats=1)
    parser.add_argument(
        "--diagnose-model",
        default=None,
        metavar="DIR",
        help="local Hugging Face model for the diagnosis rows (default: the embedded tiny model)",
    )
    args = parser.parse_args(argv)
    return bl.run_script(NAME, args, argv, run, render)


if __name__ == "__main__":
    main()
