"""Dynamic sampling (``algorithm.filter_groups``): the kept set is a function of the stream, the seeds and the
step alone. The stream's rules on their own (pure), then float64 runs of 4 steps with filtering active:
weights, every metric (the generation-round counts aside), the sampled tokens and the prompts each step
consumed are the same whatever ``data.gen_batch_size``, ``rollout.max_num_seqs``, the DP size (forked ranks
and torchrun) and a SIGKILL with resume; verl's DAPO example runs unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from splitproof.engine.launch import run_data_parallel
from splitproof.rl.data.dynamic_sampling import (
    ROUND_METRICS,
    FilterError,
    PromptStream,
    Round,
    occurrences,
    select_groups,
)
from splitproof.rl.tracking.metrics import is_machine_dependent

from .rl_helpers import HERE, final_weights, relative_update_difference, save_tiny_char_model, trajectory_config

STEPS = 4
BATCH = 2  # prompts per step
FILTER = [
    f"custom_reward_function.path={HERE / 'filter_reward.py'}",
    "algorithm.filter_groups.enable=true",
    "algorithm.filter_groups.metric=acc",
    f"data.train_batch_size={BATCH}",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",
]


# ------------------------------------------------------------------------------------------ the stream (pure)


def _eligible(step: int, uid: int, k: int) -> bool:
    """A stand-in for a group's reward spread: a fixed function of (step, uid, repeat)."""
    return (uid * 7 + step * 3 + k * 5) % 4 == 0


def _select(stream: PromptStream, step: int, gen: int, batch: int, max_rounds: int = 0):
    def generate_round(uids, repeats):
        return Round(
            groups=[(uid, k) for uid, k in zip(uids, repeats)],
            metric_values=[[0.0, 1.0] if _eligible(step, uid, k) else [1.0, 1.0] for uid, k in zip(uids, repeats)],
        )

    return select_groups(stream, batch, gen, max_rounds, generate_round, "acc")


def test_stream_walks_epochs_and_restores_its_position():
    stream = PromptStream(5, seed=3)
    first = stream.peek(0, 12)
    assert sorted(first[:5]) == sorted(first[5:10]) == list(range(5)) and first[:5] != first[5:10]
    stream.advance(7)
    assert (stream.epoch, stream.cursor) == (1, 2) and stream.peek(0, 5) == first[7:12]
    again = PromptStream(5, seed=3)
    again.load_state_dict(stream.state_dict())
    assert again.peek(0, 5) == first[7:12]
    assert occurrences([4, 1, 4, 4, 1]) == [0, 0, 1, 2, 1]
    with pytest.raises(ValueError, match="filter_groups"):
        again.load_state_dict({"epoch": 0, "cursor": 0})


@pytest.mark.parametrize("rows", [7, 40])
def test_kept_set_and_stream_do_not_depend_on_the_generation_batch_size(rows):
    """Every step keeps the same groups, consumes the same prompts and leaves the stream at the same place
    for gen_batch_size = B, 1.5 B, 3 B and a prime; with 7 rows the steps cross epochs and repeat prompts."""
    batch, trails = 4, {}
    for gen in (4, 6, 12, 7):
        stream, trail = PromptStream(rows, seed=1), []
        for step in range(1, 9):
            selection = _select(stream, step, gen, batch)
            trail.append((selection.groups, selection.consumed, stream.state_dict()))
        trails[gen] = trail
        assert all(len(groups) == batch for groups, _, _ in trail)
    assert trails[4] == trails[6] == trails[12] == trails[7]
    assert any(consumed > batch for _, consumed, _ in trails[4])  # filtering happened
    if rows == 7:
        assert any(k > 0 for groups, _, _ in trails[4] for _, k in groups)  # a prompt repeated within a step


def test_max_num_gen_batches_stops_with_the_kept_count():
    stream = PromptStream(40, seed=1)
    with pytest.raises(FilterError, match=r"max_num_gen_batches=1 .* kept \d+ of the 30 groups"):
        _select(stream, 1, 30, 30, max_rounds=1)


# ------------------------------------------------------------------------------------------ float64 runs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_char_model(tmp_path_factory.mktemp("model"), dtype=torch.float64)


def run_filtered(model_dir: str, extra=()) -> dict:
    """A 4-step float64 run with dynamic sampling; records, rollouts, consumed prompts, weights."""
    from splitproof.rl.loop import fit
    from splitproof.rl.run import build_parts

    run = build_parts(trajectory_config(model_dir, STEPS, [*FILTER, *extra]))
    initial = final_weights(run.actor.model)
    samples, consumed = [], []

    def keep(step, out):
        samples.append([(s.uid, s.sample_index, s.response_ids) for s in out.scored.samples])
        consumed.append(out.scored.consumed)

    records = fit(run, on_step=keep)
    return {
        "records": records,
        "samples": samples,
        "consumed": consumed,
        "initial": initial,
        "weights": final_weights(run.actor.model),
    }


def assert_same_filtered_run(got: dict, want: dict) -> None:
    assert got["consumed"] == want["consumed"]
    assert got["samples"] == want["samples"]
    assert relative_update_difference(got["weights"], want["weights"], want["initial"]) <= 1e-10
    for a, b in zip(got["records"], want["records"], strict=True):
        keys = {k for k in b if not is_machine_dependent(k) and k not in ROUND_METRICS}
        assert keys == {k for k in a if not is_machine_dependent(k) and k not in ROUND_METRICS}
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), (k, a[k], b[k])


@pytest.fixture(scope="module")
def baseline(model_dir):
    return run_filtered(model_dir)


def test_filtering_is_active(baseline):
    """The comparison is not vacuous: groups are dropped in at least two steps, the weights move."""
    evicted = [r["training/filter_groups/evicted_samples"] for r in baseline["records"]]
    assert sum(e > 0 for e in evicted) >= 2, evicted
    for record, consumed in zip(baseline["records"], baseline["consumed"]):
        assert record["training/filter_groups/consumed_prompts"] == len(consumed)
        assert record["train/num_gen_batches"] == len(consumed) // BATCH + (len(consumed) % BATCH > 0)
    kept = [sorted({uid for uid, _, _ in step}) for step in baseline["samples"]]
    assert all(len(k) == BATCH and set(k) <= set(c) for k, c in zip(kept, baseline["consumed"]))
    assert relative_update_difference(baseline["initial"], baseline["weights"], baseline["initial"]) == 1.0


def test_three_times_the_generation_batch_and_uneven_max_num_seqs_change_nothing(model_dir, baseline):
    got = run_filtered(model_dir, [f"data.gen_batch_size={3 * BATCH}", "actor_rollout_ref.rollout.max_num_seqs=5"])
    assert_same_filtered_run(got, baseline)
    assert [r["train/num_gen_batches"] for r in got["records"]] != [
        r["train/num_gen_batches"] for r in baseline["records"]
    ]


def test_a_prompt_repeated_within_a_step_draws_its_own_samples(model_dir):
    """Three prompts: steps run past the end of an epoch and meet a prompt again. Its repeat is generated
    (from its own sampling stream, so its tokens differ) and kept like any group, whatever gen_batch_size."""
    tiny = ["data.train_max_samples=3"]
    one = run_filtered(model_dir, [*tiny, "trainer.total_training_steps=3"])
    three = run_filtered(model_dir, [*tiny, "trainer.total_training_steps=3", f"data.gen_batch_size={3 * BATCH}"])
    assert_same_filtered_run(three, one)
    repeated = [c for c in one["consumed"] if len(set(c)) < len(c)]
    assert repeated, one["consumed"]


@pytest.mark.slow
def test_one_and_a_half_times_the_generation_batch_one_sequence_at_a_time(model_dir, baseline):
    got = run_filtered(model_dir, [f"data.gen_batch_size={3 * BATCH // 2}", "actor_rollout_ref.rollout.max_num_seqs=1"])
    assert_same_filtered_run(got, baseline)


def _dp_worker(model_dir, extra):
    return run_filtered(model_dir, extra)


@pytest.mark.slow
def test_data_parallel_changes_nothing(model_dir, baseline):
    """Two forked ranks (three: under torchrun, below)."""
    extra = [
        "actor_rollout_ref.actor.strategy=ddp",
        "actor_rollout_ref.rollout.max_num_seqs=3",
        f"data.gen_batch_size={3 * BATCH}",
    ]
    for got in run_data_parallel(_dp_worker, 2, model_dir, extra):
        assert_same_filtered_run(got, baseline)


@pytest.mark.slow
def test_killed_in_a_refill_round_and_resumed_equals_an_uninterrupted_run(model_dir, tmp_path):
    """SIGKILL after the second generation round of a step (nothing of it updated or saved), then
    ``resume_mode=auto``: the run ends with the uninterrupted run's weights, bitwise, and its metrics."""
    from splitproof.cli import main
    from splitproof.rl.checkpoint.resume import latest_checkpoint
    from splitproof.rl.tracking.loggers import read_metrics

    from .rl_helpers import train_overrides
    from .test_train_resume import _kill_at, _run_to_the_end, _same_files, _same_metrics

    def args(out):
        return train_overrides(
            model_dir,
            out,
            STEPS,
            dtype="fp64",
            extra=[
                *FILTER,
                "custom_reward_function.name=compute_score",
                "trainer.save_freq=1",
                "trainer.resume_mode=auto",
            ],
        )

    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert main(["train", *args(whole)]) == 0
    records = read_metrics(whole / "metrics.jsonl")
    refilled = [r["step"] for r in records if r["step"] >= 2 and r.get("train/num_gen_batches", 0) >= 2]
    assert refilled, "no step after the first took a refill round"
    step = refilled[0]
    _kill_at(args(killed), f"step{step}:round2", tmp_path / "paused")
    assert latest_checkpoint(killed) == killed / f"global_step_{step - 1}"
    resumed = _run_to_the_end(args(killed))
    assert f"global_step_{step - 1}" in resumed.stderr
    _same_files(killed / f"global_step_{STEPS}", whole / f"global_step_{STEPS}", ["actor"])
    _same_metrics(read_metrics(killed / "metrics.jsonl"), records)


@pytest.mark.slow
def test_verls_dapo_example_runs_unchanged(tmp_path):
    """verl's DAPO example overrides (tests/verl_dapo_example.txt) on a small float32 model: accepted (its
    infrastructure keys with a notice), trained for 2 steps with dynamic sampling and the overlong buffer."""
    from splitproof.cli import main
    from splitproof.rl.tracking.loggers import read_metrics

    model = save_tiny_char_model(tmp_path / "model")
    example = [
        line.strip()
        for line in (HERE / "verl_dapo_example.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    paths = [
        f"actor_rollout_ref.model.path={model}",
        "data.train_files=builtin://addition/train",
        "data.val_files=builtin://addition/test?size=8",
        f"trainer.default_local_dir={tmp_path / 'out'}",
        "trainer.total_training_steps=2",
        "trainer.logger=[file]",
        f"custom_reward_function.path={HERE / 'filter_reward.py'}",
    ]  # a random model never scores on addition
    assert main(["train", *example, *paths]) == 0
    records = read_metrics(tmp_path / "out" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(r["train/num_gen_batches"] >= 1 for r in records[1:])
    assert "val-core/addition/acc/mean@1" in records[0] and "reward/acc/mean" in records[1]


def test_a_step_that_cannot_fill_stops_with_the_kept_count(model_dir, tmp_path, capsys):
    """The built-in rule on a random model: no group is eligible, so max_num_gen_batches is reached."""
    from splitproof.cli import main

    from .rl_helpers import train_overrides

    args = train_overrides(
        model_dir,
        tmp_path / "out",
        2,
        dtype="fp64",
        extra=[
            "custom_reward_function.path=null",
            "custom_reward_function.name=null",
            "algorithm.filter_groups.enable=true",
            "algorithm.filter_groups.max_num_gen_batches=2",
            "data.gen_batch_size=6",
            "trainer.val_before_train=false",
        ],
    )
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err
    assert "max_num_gen_batches=2 generation rounds of data.gen_batch_size=6 prompts kept 0 of the 4 groups" in err


@pytest.mark.dist
def test_torchrun_on_three_ranks_equals_one_process(model_dir, tmp_path):
    """`torchrun --nproc_per_node 3 -m splitproof train` with dynamic sampling (DDP, uneven generation
    shares): the one-process run's metrics and final weights."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    from splitproof.cli import main
    from splitproof.rl.tracking.loggers import read_metrics

    from .rl_helpers import train_overrides

    def args(out):
        return train_overrides(
            model_dir,
            out,
            STEPS,
            dtype="fp64",
            extra=[
                *FILTER,
                "custom_reward_function.name=compute_score",
                f"trainer.save_freq={STEPS}",
                "actor_rollout_ref.actor.strategy=ddp",
                f"data.gen_batch_size={3 * BATCH}",
            ],
        )

    one, three = tmp_path / "one", tmp_path / "three"
    assert main(["train", *args(one)]) == 0
    env = dict(os.environ, PYTHONPATH=str(HERE.parent))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "3",
            "-m",
            "splitproof",
            "train",
            *args(three),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for a, b in zip(read_metrics(three / "metrics.jsonl"), read_metrics(one / "metrics.jsonl"), strict=True):
        keys = {k for k in b if not is_machine_dependent(k)}
        assert keys == {k for k in a if not is_machine_dependent(k)}
        for k in keys:
            assert math.isclose(a[k], b[k], rel_tol=1e-9, abs_tol=1e-12), (b["step"], k, a[k], b[k])
    weights = [
        {k: v.double() for k, v in load_file(out / f"global_step_{STEPS}" / "actor" / "model.safetensors").items()}
        for out in (three, one)
    ]
    initial = {k: v.double() for k, v in save_and_load_initial(model_dir).items()}
    assert relative_update_difference(weights[0], weights[1], initial) <= 1e-10


def save_and_load_initial(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).state_dict()


def test_pipelined_rollouts_are_refused_with_dynamic_sampling():
    from splitproof.loss_config import ConfigError
    from splitproof.rl.config.load import load_train_config

    with pytest.raises(ConfigError, match="filter_groups") as info:
        load_train_config(None, ["async_training.staleness_steps=1", "algorithm.filter_groups.enable=true"])
    assert info.value.field == "async_training.staleness_steps"
