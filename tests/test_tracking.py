"""trainer.logger backends: console line, metrics.jsonl (resume-exact), TensorBoard and wandb read back, curve."""

import importlib.util
import io
import json
import math
import struct

import pytest
import torch

from splitproof import ConfigError
from splitproof.rl.config.load import load_train_config
from splitproof.rl.tracking import curve
from splitproof.rl.tracking.loggers import Tracker, read_metrics

VAL = "val-core/addition/reward/mean@1"


def step_metrics(step: int) -> dict:
    return {
        "critic/score/mean": 0.125 * step,
        "response_length/mean": 4.0 + step / 3,
        "actor/pg_loss": -0.1 * step,
        "timing_s/step": 1.5,
        "actor/grad_norm": torch.tensor(0.5 + step),
    }


def run(tmp_path, steps, *, loggers=("file",), resume_step=None, val_every=2, offset=0.0, **kwargs):
    tracker = Tracker(list(loggers), local_dir=tmp_path, total_steps=6, resume_step=resume_step, **kwargs)
    for step in steps:
        metrics = {} if step == 0 else step_metrics(step)
        if step % val_every == 0:
            metrics[VAL] = 0.3 + 0.05 * step + offset
        tracker.log(metrics, step)
    return tracker


def test_console_line_per_step_when_not_a_terminal(tmp_path):
    out = io.StringIO()
    run(tmp_path, range(3), loggers=("console",), stream=out).finish()
    lines = out.getvalue().splitlines()
    assert lines == [
        "step 0/6 | held-out addition reward/mean@1 0.300 (step 0)",
        "step 1/6 | reward 0.125 | held-out addition reward/mean@1 0.300 (step 0) | resp len 4.3 | 1.50 s/step "
        "| ETA 8s",
        "step 2/6 | reward 0.250 | held-out addition reward/mean@1 0.400 (step 2) | resp len 4.7 | 1.50 s/step "
        "| ETA 6s",
    ]


@pytest.mark.parametrize("loggers", [("console", "file"), ("console",)])
def test_resumed_console_keeps_the_last_held_out_score(tmp_path, loggers):
    run(tmp_path, range(3), loggers=("file",)).finish()
    out = io.StringIO()
    run(tmp_path, [3], loggers=loggers, resume_step=2, stream=out).finish()
    assert (
        out.getvalue()
        .splitlines()[0]
        .startswith("step 3/6 | reward 0.375 | held-out addition reward/mean@1 0.400 (step 2) |")
    )


def test_console_live_line_on_a_terminal(tmp_path):
    out = io.StringIO()
    tracker = run(tmp_path, range(4), loggers=("console",), stream=out, live=True)
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\x1b[K")  # step 3 still on the live line
    writes = text.split("\r")[1:]
    assert [w.endswith("\n") for w in writes] == [True, False, True, False]  # evaluation steps stay on screen
    tracker.finish()
    assert out.getvalue().endswith("\n")


def test_metrics_file_one_object_per_step(tmp_path):
    run(tmp_path, range(3)).finish()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[0] == {"step": 0, VAL: 0.3}
    assert records[2]["actor/grad_norm"] == 2.5 and records[2][VAL] == pytest.approx(0.4)
    assert records[1] == {"step": 1, **{k: float(v) for k, v in step_metrics(1).items()}}


def test_resumed_file_equals_an_uninterrupted_run(tmp_path):
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run(whole, range(7)).finish()
    # interrupted: steps 0..3, then (after the checkpoint at 3) steps 4..5 with other values, then a torn line
    run(resumed, range(4)).finish()
    run(resumed, range(4, 6), resume_step=3, offset=1.0).finish()
    with open(resumed / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "critic/sc')
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    run(resumed, range(4, 7), resume_step=3).finish()  # resumed from the checkpoint at step 3
    assert (resumed / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    run(resumed, range(2)).finish()  # a fresh run starts a fresh file
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")] == [0, 1]


def test_metric_values_must_be_numbers(tmp_path):
    tracker = Tracker(["file"], local_dir=tmp_path, total_steps=2)
    with pytest.raises(TypeError, match="'actor/note'"):
        tracker.log({"actor/note": "hello"}, 1)


def test_only_rank_zero_writes(tmp_path):
    out = io.StringIO()
    tracker = run(tmp_path / "r1", range(3), loggers=("console", "file"), rank=1, stream=out)
    assert tracker.finish() is None
    assert out.getvalue() == "" and not (tmp_path / "r1").exists()


def test_tensorboard_events_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run(tmp_path, range(4), loggers=("tensorboard",)).finish()
    run(tmp_path, range(3, 5), loggers=("tensorboard",), resume_step=2, offset=1.0).finish()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    reward = [(e.step, e.value) for e in events.Scalars("critic/score/mean")]
    assert reward == [(s, pytest.approx(0.125 * s)) for s in range(1, 5)]
    held_out = [(e.step, e.value) for e in events.Scalars(VAL)]
    assert held_out == [(0, pytest.approx(0.3)), (2, pytest.approx(0.4)), (4, pytest.approx(1.5))]


def _wandb_history(run_dir) -> list[dict]:
    """The history records of an offline run's .wandb file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data, block, pos, pending, history = path.read_bytes(), 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                history.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return history


def test_wandb_offline_run_reads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path, range(3), loggers=("wandb",), config={"data": {"train_batch_size": 8}}).finish()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    history = _wandb_history(run_dir)
    assert [h["_step"] for h in history] == [0, 1, 2]
    assert history[2]["critic/score/mean"] == 0.25 and history[2][VAL] == pytest.approx(0.4)


def test_missing_optional_backend_is_a_named_error(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as info:
        Tracker(["console", "wandb"], local_dir=tmp_path, total_steps=1)
    assert info.value.field == "trainer.logger" and "splitproof[wandb]" in str(info.value)
    assert not tmp_path.joinpath("metrics.jsonl").exists()


def test_a_short_runs_curve_has_integer_steps_and_a_sensible_score_axis():
    from splitproof.rl.tracking.held_out import validation_metrics

    records = [{"step": 0, **validation_metrics(["", ""], [0, 1], [0.3361, 0.3361], {})}]
    records += [{"step": s, "critic/score/mean": 0.3361 + 0.0004 * s} for s in range(1, 5)]
    assert set(records[0]) == {"step", "val-core/unknown/reward/mean@1"}  # verl's name for a missing data source
    axes = curve.curve_figure(records).axes[0]
    low, high = axes.get_ylim()
    assert high - low >= 0.1 - 1e-12
    ticks = [t for t in axes.get_xticks() if 0 <= t <= 4]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        "training reward (critic/score/mean)",
        "held-out unknown (reward/mean@1)",
    ]


def test_curve_png_from_the_whole_run(tmp_path):
    run(tmp_path, range(6)).finish()
    tracker = run(tmp_path, range(6, 11), resume_step=5)
    path = tracker.finish()
    assert path == tmp_path / "curve.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [r["step"] for r in tracker.history] == list(range(11))  # the curve covers the resumed run too
    assert curve.write_curve([{"step": 1, "actor/pg_loss": 0.1}], tmp_path / "none.png") is None


def test_tracker_from_config(tmp_path):
    cfg = load_train_config(
        None, [f"trainer.default_local_dir={tmp_path}", "trainer.logger=[file]", "trainer.experiment_name=exp"]
    )
    tracker = Tracker.from_config(cfg, total_steps=3)
    tracker.log({"critic/score/mean": math.pi}, 1)
    tracker.finish()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": math.pi}]
