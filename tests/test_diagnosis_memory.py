"""The diagnosis keeps a constant number of model-sized buffers (the baseline waits on disk, DDP's gradients stay in
its buckets), and reports a dead DP worker in one line."""

from __future__ import annotations

import copy
import gc
import os
import signal
import weakref

import pytest
import torch
import torch.distributed as dist

import splitproof.diagnose.baseline_store as store_module
import splitproof.diagnose.diagnosis as diagnosis_module
import splitproof.diagnose.split_run as run_module
from splitproof.cli import main
from splitproof.collective import default_collective
from splitproof.diagnose import scenarios as sc
from splitproof.diagnose.baseline_store import FlatStore, spills_to_disk
from splitproof.diagnose.context import ModelSpec
from splitproof.diagnose.diagnosis import Diagnosis
from splitproof.diagnose.synthetic import synthetic_rollout
from splitproof.diagnose.watched import Watched
from splitproof.engine import PolicyObjective, UpdateConfig, wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.engine.optimizer_step import optimizer_step
from splitproof.engine.plan import MinibatchPlan
from splitproof.hf_models import tiny_causal_lm, vocab_size_of

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
    scenario = sc.custom(
        seed=0, loss_mode="kl_cov", kl_cov_ratio=0.05, sequences=8, splits=("sizes:3,5", "packed:48", "dp:2+sizes:1,3")
    )
    diagnosis = Diagnosis([scenario], ModelSpec(dtype="float64")).run()
    assert len(live) == 2  # the loss and its control
    record = diagnosis.results(scenario)
    assert record["passed"], [(s["split"], s["verdict"]) for s in record["splits"]]
    for outcome in diagnosis.outcomes.values():
        assert not any(isinstance(v, torch.Tensor) for v in outcome.values())
    assert not any(
        isinstance(v, torch.Tensor) for result in diagnosis.baselines.values() for v in vars(result).values()
    )


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("on_disk", [True, False])
def test_flat_store_reads_back_what_was_written(dtype, on_disk):
    values = torch.randn(1000, dtype=torch.float64).to(dtype)
    store = FlatStore(("grad", "after"), 1000, dtype, on_disk=on_disk)
    store.write("after", 0, values[:600])
    store.write("after", 600, values[600:])
    store.write("grad", 10, -values[:5])
    assert torch.equal(store.read("after", 0, 1000), values)
    assert torch.equal(store.read("after", 590, 20), values[590:610])
    assert torch.equal(store.read("grad", 10, 5), -values[:5])
    store.close()


def test_baseline_waits_on_disk_and_gives_the_same_figures(monkeypatch):
    """The baseline's vectors in a file (what the diagnosis does) or in memory: every figure identical."""
    assert spills_to_disk(), "the temporary directory of this machine is a memory file system"
    scenario = sc.custom(seed=0, sequences=6, splits=("sizes:2,4", "dp:2+sizes:1,2"))
    on_disk = Diagnosis([scenario], ModelSpec(dtype="float64")).run().results(scenario)
    monkeypatch.setattr(store_module, "spills_to_disk", lambda directory=None: False)
    in_memory = Diagnosis([scenario], ModelSpec(dtype="float64")).run().results(scenario)
    assert on_disk["passed"] and on_disk["splits"] == in_memory["splits"]
    assert on_disk["splits"][1]["grad_rel_diff"] > 0  # a real comparison, not two empty ones


def _gradient_buffers_worker():
    """A DDP run of two microbatches per rank: do the gradients stay in DDP's buckets throughout?"""
    model = copy.deepcopy(tiny_causal_lm("llama", seed=0))
    run_module._start_with_zero_gradients(model)
    ddp = wrap_model(model, "ddp")
    buckets = [p.grad.data_ptr() for p in model.parameters()]
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    run_module._zero_gradients_in_place(optimizer)
    batch = synthetic_rollout(model, 4, 4, 6, seed=1).validate(vocab_size_of(model))
    plan = MinibatchPlan(
        rows=[0, 1, 2, 3],
        shard=[2 * dist.get_rank(), 2 * dist.get_rank() + 1],
        microbatches=[[2 * dist.get_rank()], [2 * dist.get_rank() + 1]],
        stand_in=0,
    )
    seen = {}

    def on_gradients(m):
        seen["same"] = [p.grad.data_ptr() for p in m.module.parameters()] == buckets
        seen["nonzero"] = all(bool(p.grad.abs().sum() > 0) for p in m.module.parameters())

    config, collective = UpdateConfig(ppo_mini_batch_size=4), default_collective()
    objective = Watched(PolicyObjective(config, batch, plan, collective, 0), batch, on_gradients=on_gradients)
    optimizer_step(ddp, optimizer, batch, plan, objective, grad_clip=config.grad_clip, collective=collective)
    return seen


def test_ddp_gradients_stay_in_their_buckets_across_microbatches():
    for seen in run_data_parallel(_gradient_buffers_worker, 2):
        assert seen == {"same": True, "nonzero": True}
