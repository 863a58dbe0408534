"""``scripts/time_to_score.py``: the wall time from launch to each held-out evaluation of a real run."""

import importlib.util
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_every_evaluation_is_seen_in_order(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("time_to_score", SCRIPTS / "time_to_score.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overrides = [
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "trainer.save_freq=-1",
        "trainer.logger=[file]",
    ]
    seen = module.watch(1, overrides, tmp_path / "run")
    assert [step for step, _, _ in seen] == [0, 1, 2]
    times = [t for _, t, _ in seen]
    assert 0 < times[0] < times[1] < times[2]
    assert all(0.0 <= score <= 1.0 for _, _, score in seen)
