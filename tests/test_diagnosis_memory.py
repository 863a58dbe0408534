"""The diagnosis keeps a constant number of model-sized buffers, and reports a dead DP worker in one line."""

from __future__ import annotations

import gc
import os
import signal
import weakref

import pytest
import torch
import torch.distributed as dist

import splitproof.diagnose.diagnosis as diagnosis_module
from splitproof.cli import main
from splitproof.diagnose import scenarios as sc
from splitproof.diagnose.context import ModelSpec
from splitproof.diagnose.diagnosis import Diagnosis

pytestmark = pytest.mark.dist


def test_one_baseline_at_a_time_and_no_model_sized_results(monkeypatch):
    """Between runs the process holds the template and one baseline; what a run leaves is figures."""
    live: list[weakref.ref] = []
    real_baseline, real_compared = diagnosis_module.run_baseline, diagnosis_module.run_compared

    def counting_baseline(*args, **kwargs):
        baseline = real_baseline(*args, **kwargs)
        live.append(weakref.ref(baseline))
        return baseline

    def checked_compared(*args, **kwargs):
        gc.collect()
        assert sum(ref() is not None for ref in live) <= 1, "more than one baseline alive"
        return real_compared(*args, **kwargs)

    monkeypatch.setattr(diagnosis_module, "run_baseline", counting_baseline)
    monkeypatch.setattr(diagnosis_module, "run_compared", checked_compared)
    scenario = sc.custom(seed=0, loss_mode="kl_cov", kl_cov_ratio=0.05, sequences=8,
                         splits=("sizes:3,5", "packed:48", "dp:2+sizes:1,3"))
    diagnosis = Diagnosis([scenario], ModelSpec(dtype="float64")).run()
    assert len(live) == 2  # the loss and its control
    record = diagnosis.results(scenario)
    assert record["passed"], [(s["split"], s["verdict"]) for s in record["splits"]]
    for outcome in diagnosis.outcomes.values():
        assert not any(isinstance(v, torch.Tensor) for v in outcome.values())
    assert not any(isinstance(v, torch.Tensor) for result in diagnosis.baselines.values() for v in vars(result).values())


def _dying_worker(*args):
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    dist.barrier()
    return []


def test_a_dead_worker_ends_the_diagnosis_with_one_line(monkeypatch, capsys):
    monkeypatch.setattr(diagnosis_module, "_dp_worker", _dying_worker)
    code = main(["diagnose", "--sequences", "4", "--split", "even:2", "--split", "dp:2", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == "splitproof: error: data-parallel rank 1 was killed by signal SIGKILL (likely out of memory)"
