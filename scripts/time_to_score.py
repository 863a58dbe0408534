"""Wall time from launch to each held-out evaluation of `splitproof train`: when does a run first reach a gain?

    python scripts/time_to_score.py --seeds 4 --gain 0.5 [key=value ...]

Each seed is one ``python -m splitproof train`` process (seed k > 0 sets ``data.seed=k+1`` and
``actor_rollout_ref.rollout.seed=42+k``, as ``scripts/embedded_curve.py`` does), run with the given overrides
in a temporary folder. The clock starts before the process is launched (start-up, model building and the
step-0 evaluation included) and stops at each evaluation when its line reaches ``metrics.jsonl`` (polled every
50 ms). Printed per seed: every evaluation's step, wall seconds and score, and the first one whose gain over
step 0 is at least ``--gain``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from embedded_curve import seed_overrides

KEY = "val-core/addition/reward/mean@1"


def watch(seed: int, extra: list[str], folder: Path) -> list[tuple[int, float, float]]:
    """(step, wall seconds since launch, score) of every evaluation of one run."""
    metrics = folder / "metrics.jsonl"
    start = time.perf_counter()
    command = [sys.executable, "-m", "splitproof", "train", f"trainer.default_local_dir={folder}"]
    process = subprocess.Popen([*command, *seed_overrides(seed), *extra], stdout=subprocess.DEVNULL)
    seen, read = [], 0
    while True:
        done = process.poll() is not None
        text = metrics.read_text() if metrics.exists() else ""
        lines = text[read:].split("\n")
        for line in lines[:-1]:  # whole lines only; the last may still be written
            record = json.loads(line)
            if KEY in record:
                seen.append((record["step"], time.perf_counter() - start, record[KEY]))
        read = len(text) - len(lines[-1])
        if done:
            if process.returncode:
                raise SystemExit(f"seed {seed}: splitproof train exited with {process.returncode}")
            return seen
        time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--gain", type=float, default=0.5, help="the gain over step 0 to time (0.5: +50 points)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            seen = watch(seed, args.overrides, Path(tmp) / "run")
        base = seen[0][2]
        first = next((e for e in seen if e[2] - base >= args.gain - 1e-9), None)
        print(f"seed {seed}: " + ", ".join(f"step {s} {t:.1f} s {v:.3f}" for s, t, v in seen))
        reached = f"step {first[0]} at {first[1]:.1f} s of wall time" if first else "never"
        print(f"seed {seed}: first +{args.gain * 100:g} points: {reached}", flush=True)


if __name__ == "__main__":
    main()
