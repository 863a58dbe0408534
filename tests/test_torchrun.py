"""The same script under `torchrun --nproc_per_node 2` (DDP and FSDP2) and on one process: same update."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "update_step.py"


def run(out: Path, *launcher: str, extra=()) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        *launcher,
        str(SCRIPT),
        "--loss-mode",
        "geo_mean",
        "--agg-mode",
        "seq-mean-token-mean",
        "--out",
        str(out),
        *extra,
    ]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, timeout=240, capture_output=True)
    return torch.load(out, weights_only=False)


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_matches_one_process(tmp_path, strategy):
    single = run(tmp_path / "one.pt", sys.executable)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    multi = run(tmp_path / "two.pt", *torchrun, extra=["--strategy", strategy])
    assert len(single["metrics"]) == len(multi["metrics"]) == 4  # 2 minibatches x 2 epochs, shuffled
    for name, value in single["state"].items():
        diff = float((multi["state"][name] - value).abs().max())
        assert diff <= 1e-12 * max(1.0, float(value.abs().max())), name
    for a, b in zip(single["metrics"], multi["metrics"]):
        for key in a:
            assert abs(a[key] - b[key]) <= 1e-10 * max(1.0, abs(a[key])), key
