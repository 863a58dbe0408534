"""What holds on a device, measured there in one run that prints one table.

    python scripts/device_check.py                      # cuda when this machine has it, else cpu
    python scripts/device_check.py --device cpu --quick # the CPU, small shapes (what the test runs)
    python scripts/device_check.py --device cuda:0 --json device_check.json

Rows: float64, float32 and bf16 no-grad log-probs, and bf16 computed over float32 parameters (autocast, verl's
mixed precision), across micro-batch sizes, a token budget and packing (bitwise, or how many tokens differ and
by how much); rollout tokens across ``max_num_seqs`` (identical, or how many
samples differ); one policy update across micro-batch splits (relative difference of the parameter change);
the cost of the fixed-row products; a short ``splitproof train`` on the device (exit status, held-out score)
and its step time against the same run on this machine's CPU.

Exit status: 0 when every measurement ran (and the train runs exited 0), 1 when one failed (its row says
how; the table is printed all the same), 2 for a device this machine does not have.

The model of the log-prob, rollout and update rows is a random Llama of SmolLM2-135M's shape (built from a
config: no download); ``--quick`` (and the default on a CPU) uses a tiny one. The train rows run the
embedded default (the built-in model on the built-in addition task). The device gets the trainer's
determinism settings (``splitproof.devices.deterministic``).

What it needs beyond torch, transformers, pyarrow and safetensors travels with the code: splitproof itself
(this checkout, put on ``sys.path`` and on the train runs' ``PYTHONPATH``) and OmegaConf (splitproof's
config), as the pure-Python wheel ``scripts/device_check_deps/omegaconf-2.4.0-py3-none-any.whl`` (254 kB),
imported from the wheel file (a zip) when OmegaConf is not installed. PyYAML, which OmegaConf needs, comes
with transformers. matplotlib is not needed (without it a run writes no curve.png, with a notice).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEPS = Path(__file__).resolve().parent / "device_check_deps"


def vendored_path() -> list[str]:
    """The entries to put on ``sys.path`` for what this machine lacks (the OmegaConf wheel, when needed)."""
    try:
        import omegaconf  # noqa: F401
    except ImportError:
        return [str(p) for p in sorted(DEPS.glob("*.whl"))]
    return []


EXTRA_PATH = [str(REPO), *vendored_path()]
sys.path[:0] = [p for p in EXTRA_PATH if p not in sys.path]

from device_check_rows import (  # noqa: E402  (needs the path above)
    SHAPES,
    fixed_rows_cost,
    log_prob_rows,
    rollout_rows,
    train_rows,
    update_rows,
)


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available, else cpu)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few train steps (the default on a CPU)")
    p.add_argument("--train-steps", type=int, default=None, help="steps of the short train runs (default 10; 2 quick)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


def table(rows: list[dict]) -> str:
    """The rows as one Markdown table: check | setting | result."""
    lines = ["| check | setting | result |", "|---|---|---|"]
    lines += [f"| {r['check']} | {r['setting']} | {r['result']} |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from splitproof.devices import deterministic, resolve_device
    from splitproof.loss_config import ConfigError

    try:
        device = resolve_device(args.device or default_device(), key="--device")
    except ConfigError as e:
        print(f"device_check: error: {e}", file=sys.stderr)
        return 2
    quick = args.quick or device.type == "cpu"
    steps = args.train_steps or (2 if quick else 10)
    notice = deterministic(device)
    if notice:
        print(f"device_check: {notice}", file=sys.stderr)
    shape = SHAPES["tiny" if quick else "smol"]
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = [{"check": "machine", "setting": str(device), "result": f"{name}, torch {torch.__version__}"}]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*EXTRA_PATH, os.environ.get("PYTHONPATH", "")])}
    groups = [
        (f"log-probs {d}", log_prob_rows, (device, d, shape)) for d in (torch.float64, torch.float32, torch.bfloat16)
    ]
    groups.append(("log-probs bf16 over fp32", log_prob_rows, (device, torch.float32, shape, torch.bfloat16)))
    groups += [
        ("rollout", rollout_rows, (device, torch.float32, shape)),
        ("update", update_rows, (device, torch.float32, shape)),
        ("fixed-row products", fixed_rows_cost, (device, torch.float32, shape)),
        ("splitproof train", train_rows, (device, steps, env)),
    ]
    failed = False
    for check, measure, inputs in groups:  # a group that fails is a row: the others still run
        try:
            rows += measure(*inputs)
        except Exception as e:  # reported in the table
            failed = True
            first = (str(e).strip().splitlines() or [""])[0]
            rows.append({"check": check, "setting": "error", "result": f"{type(e).__name__}: {first}"})
    failed = failed or any(r["check"] == "splitproof train" and not r["result"].startswith("rc 0") for r in rows)
    rows.append({"check": "total", "setting": "this script", "result": f"{time.perf_counter() - start:.0f} s"})
    print(table(rows))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
