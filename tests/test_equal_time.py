"""``scripts/equal_time.py``: held-out scores against training wall time, read from metrics.jsonl alone."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "equal_time.py"
METRIC = "val-core/addition/reward/mean@1"


@pytest.fixture(scope="module")
def equal_time():
    spec = importlib.util.spec_from_file_location("equal_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, step_s: float, scores: dict[int, float], steps: int = 4) -> None:
    """A run's metrics.jsonl: evaluations at ``scores``' steps (0 before training), ``step_s`` per step."""
    folder.mkdir(parents=True)
    records = [{"step": 0, METRIC: scores[0], "timing_s/testing": 9.0}]
    records += [
        {"step": s, "timing_s/step": step_s, "timing_s/testing": 9.0, **({METRIC: scores[s]} if s in scores else {})}
        for s in range(1, steps + 1)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_scores_at_equal_training_time(equal_time, tmp_path):
    """A group four times as fast per step: at its end (4 s) the slow one stands at its step 2."""
    _run(tmp_path / "slow" / "seed0", 2.0, {0: 0.2, 2: 0.4, 4: 0.6})
    _run(tmp_path / "slow" / "seed1", 2.0, {0: 0.2, 2: 0.2, 4: 0.4})
    _run(tmp_path / "fast" / "seed0", 0.5, {0: 0.2, 4: 0.3, 8: 0.5}, steps=8)
    _, runs = equal_time.load_group(tmp_path / "slow")
    assert runs["seed0"] == [(0, 0.0, 0.2), (2, 4.0, 0.4), (4, 8.0, 0.6)]  # testing time is left out
    assert equal_time.score_at(runs["seed0"], 6.0) == pytest.approx(0.5)
    assert equal_time.score_at(runs["seed0"], 8.5) is None
    text = equal_time.main(
        [f"k = 0={tmp_path / 'slow'}", f"k = 1={tmp_path / 'fast'}", "--plot", str(tmp_path / "c.png")]
    )
    assert "| 4.0 | 0.300 | 0.500 |" in text  # at equal time: slow's step 2 (mean of 0.4, 0.2), fast's step 8
    assert "| 2.0 | 0.250 | 0.300 |" in text  # halfway: slow interpolated (0.3, 0.2), fast's step 4
    assert "| 4 | 0.500 | 0.300 |" in text  # at equal steps
    assert (tmp_path / "c.png").stat().st_size > 0


def test_a_run_without_step_times_is_named(equal_time, tmp_path):
    folder = tmp_path / "g" / "seed0"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 0, METRIC: 0.1}) + "\n" + json.dumps({"step": 1}) + "\n")
    with pytest.raises(SystemExit, match=r"metrics.jsonl:2: step 1 has no timing_s/step"):
        equal_time.load_group(tmp_path / "g")
