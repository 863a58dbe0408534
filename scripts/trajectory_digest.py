"""A whole `splitproof train` trajectory as digests: every non-timing metric of every step, every sampled
token (the generations each step wrote) and every tensor of the final checkpoint.

Used to check that a change of structure changes no result: record before, record after, compare.

    python scripts/trajectory_digest.py OUT.json [key=value ...]    # the embedded default in float64
    python scripts/trajectory_digest.py --compare BEFORE.json AFTER.json

The run is the embedded default with ``actor_rollout_ref.actor.fsdp_config.model_dtype=fp64`` unless the
overrides say otherwise; it runs in a temporary folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TIMING_PREFIXES = ("timing_s/", "timing_per_token_ms/", "perf/")


def record(out: Path, overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        options = [a for i, a in enumerate(overrides) if a.startswith("--") or (i and overrides[i - 1] == "--config")]
        keys = [a for a in overrides if a not in options]
        command = [
            sys.executable,
            "-m",
            "splitproof",
            "train",
            *options,
            "actor_rollout_ref.actor.fsdp_config.model_dtype=fp64",
            f"trainer.default_local_dir={run_dir}",
            f"trainer.rollout_data_dir={run_dir / 'generations'}",
            "trainer.logger=[file]",
            "trainer.max_actor_ckpt_to_keep=1",
            *keys,
        ]
        subprocess.run(command, check=True)
        metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        steps = {
            str(r["step"]): {k: v for k, v in sorted(r.items()) if not k.startswith(TIMING_PREFIXES)} for r in metrics
        }
        generations = {p.name: _rows_digest(p) for p in sorted((run_dir / "generations").glob("*.jsonl"))}
        latest = (run_dir / "latest_checkpointed_iteration.txt").read_text().strip()
        tensors = _tensor_digests(run_dir / f"global_step_{latest}" / "actor")
    out.write_text(
        json.dumps(
            {
                "overrides": overrides,
                "metrics": steps,
                "generations": generations,
                "final_step": latest,
                "tensors": tensors,
            },
            indent=1,
            sort_keys=True,
        )
    )
    print(f"{out}: {len(steps)} records, {len(generations)} generation files, {len(tensors)} tensors")


def _tensor_digests(folder: Path) -> dict[str, str]:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in sorted(load_file(file).items()):
            out[name] = _sha(tensor.contiguous().view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes())
    return out


def _rows_digest(path: Path) -> str:
    """The sampled text of each row and what it scored (input, output, ground truth, score, step); extra values a
    reward function adds beside them (e.g. ``pred``) are left out."""
    keys = ("input", "output", "gts", "score", "step")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return _sha(json.dumps([[row.get(k) for k in keys] for row in rows]).encode())


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def compare(before: Path, after: Path) -> int:
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    differences = []
    for part in ("metrics", "generations", "tensors", "final_step"):
        if a[part] == b[part]:
            continue
        if isinstance(a[part], dict):
            for key in sorted(set(a[part]) | set(b[part])):
                if a[part].get(key) != b[part].get(key):
                    differences.append(f"{part}[{key}]: {a[part].get(key)} != {b[part].get(key)}")
        else:
            differences.append(f"{part}: {a[part]} != {b[part]}")
    for line in differences[:40]:
        print(line)
    print("identical" if not differences else f"{len(differences)} differences")
    return 1 if differences else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("overrides", nargs="*")
    args, extra = parser.parse_known_args()  # --config FILE passes through to `splitproof train`
    args.overrides += extra
    if args.compare:
        return compare(*args.compare)
    if args.out is None:
        parser.error("give OUT.json or --compare BEFORE AFTER")
    record(args.out, args.overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
