"""scripts/device_check.py on the CPU, as a machine with only torch, transformers, pyarrow and safetensors
would run it: OmegaConf and matplotlib are not installed there (OmegaConf then comes from the wheel that
travels with the script, splitproof from the checkout), and the table holds every row."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_check.py"

HIDDEN = ("omegaconf", "matplotlib", "hypothesis", "tensorboard", "wandb", "vllm", "math_verify", "trl", "mpl_")


def image_path(folder: Path) -> str:
    """A folder of links to this interpreter's installed packages less ``HIDDEN`` (and less the editable
    install of splitproof: the script brings its own checkout), for ``python -S``."""
    import site

    folder.mkdir(exist_ok=True)
    for packages in site.getsitepackages():
        for entry in Path(packages).iterdir():
            name = entry.name.lower()
            if (
                name.startswith(HIDDEN)
                or name.endswith(".pth")
                or "splitproof" in name
                or (folder / entry.name).exists()
            ):
                continue
            (folder / entry.name).symlink_to(entry)
    return str(folder)


def run_script(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": image_path(tmp_path / "image")}
    command = [sys.executable, "-S", str(SCRIPT), *args]  # -S: no site-packages but the image's
    return subprocess.run(command, env=env, capture_output=True, text=True, cwd=tmp_path)


def test_device_check_runs_on_the_cpu_with_what_travels_with_it(tmp_path):
    out = tmp_path / "rows.json"
    done = run_script(tmp_path, "--device", "cpu", "--quick", "--json", str(out))
    assert done.returncode == 0, done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| check | setting | result |" and len(table) == len(done.stdout.splitlines())
    rows = json.loads(out.read_text())
    checks = {r["check"] for r in rows}
    for dtype in ("float64", "float32", "bfloat16", "bfloat16 over float32"):
        assert f"log-probs {dtype}" in checks
    assert {"rollout tokens float32", "update float32", "fixed-row products", "splitproof train"} <= checks
    by = {(r["check"], r["setting"]): r["result"] for r in rows}
    # the CPU's promise, measured by the script: float64 log-probs and the sampled tokens never move
    assert all(v == "bitwise" for (c, _), v in by.items() if c == "log-probs float64")
    assert all(v == "identical tokens" for (c, _), v in by.items() if c == "rollout tokens float32")
    assert all(float(v.rsplit(" ", 1)[1]) < 1e-4 for (c, _), v in by.items() if c == "update float32")
    assert by[("splitproof train", "cpu, 2 steps")].startswith("rc 0, held-out score ")
    assert by[("step time (median)", "the embedded default's step")].startswith("cpu ")


def test_device_check_refuses_a_device_this_machine_lacks(tmp_path):
    done = run_script(tmp_path, "--device", "cuda:999")
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("device_check: error: --device: 'cuda:999'"), done.stderr
