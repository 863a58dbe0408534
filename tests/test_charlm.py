"""The built-in model: the shipped directory loads as a Hugging Face model + tokenizer, matches its record,
and ``scripts/make_charlm.py`` is deterministic."""

import importlib.util
import json
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

from splitproof.builtin import char_tokenizer, charlm_directory
from splitproof.rl.data.tasks import task_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "Hello, world! 37+45=82\n"


@pytest.fixture(scope="module")
def make_charlm():
    spec = importlib.util.spec_from_file_location("make_charlm", os.path.join(ROOT, "scripts", "make_charlm.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_charlm"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shipped():
    path = charlm_directory()
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def test_shipped_directory_loads_with_the_char_tokenizer_vocabulary_and_eos(shipped):
    model, tokenizer = shipped
    reference = char_tokenizer()
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tokenizer) == len(reference) == 99
    assert tokenizer.encode(TEXT) == reference.encode(TEXT)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, None)
    assert (model.config.eos_token_id, model.config.pad_token_id) == (1, 0)
    generation = GenerationConfig.from_pretrained(charlm_directory())
    assert generation.eos_token_id == 1 and generation.pad_token_id == 0
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert 80_000 <= sum(p.numel() for p in model.parameters()) <= 130_000
    total_bytes = sum(os.path.getsize(os.path.join(charlm_directory(), f)) for f in os.listdir(charlm_directory()))
    assert total_bytes < 1_000_000


def test_shipped_model_scores_what_its_record_says_on_the_held_out_split(shipped, make_charlm):
    model, tokenizer = shipped
    with open(os.path.join(charlm_directory(), "warmup.json")) as fh:
        record = json.load(fh)
    rows = task_rows(record["test_task"])
    assert record["train_task"].startswith("builtin://addition/train")
    # exact: the smallest top-2 logit gap along these greedy decodes is 6e-4, far above float32 kernel noise
    assert make_charlm.exact_match_rate(model, tokenizer, rows) == record["test_accuracy"]
    assert 0.05 <= record["test_accuracy"] <= 0.60  # GRPO needs reward spread from the first step


def test_warm_up_examples_are_the_rl_prompt_then_answer_and_eos(make_charlm):
    tokenizer = char_tokenizer()
    rows = task_rows("builtin://addition/train?size=3")
    pairs = make_charlm.examples(tokenizer, rows)
    for row, (prompt, answer) in zip(rows, pairs):
        assert prompt == tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(answer) == row["reward_model"]["ground_truth"] + "<eos>"
    input_ids, labels = make_charlm.sft_batch(pairs, tokenizer.pad_token_id)
    for i, (prompt, answer) in enumerate(pairs):
        assert input_ids[i, : len(prompt) + len(answer)].tolist() == prompt + answer
        assert labels[i][labels[i] != -100].tolist() == answer


def _short_warm_up(make_charlm, seed: int, steps: int = 4) -> dict:
    tokenizer = char_tokenizer()
    model = make_charlm.build_model(tokenizer, make_charlm.Architecture(), seed)
    rows = task_rows("builtin://addition/train?size=300")
    make_charlm.warm_up(model, tokenizer, rows, make_charlm.WarmUp(seed=seed, batch_size=16), steps=steps)
    return model.state_dict()


def test_warm_up_is_deterministic_and_depends_on_the_seed(make_charlm):
    make_charlm.set_reproducible()
    first, again, other = (_short_warm_up(make_charlm, seed) for seed in (0, 0, 1))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    initial = make_charlm.build_model(char_tokenizer(), make_charlm.Architecture(), 0).state_dict()
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], initial["model.layers.0.mlp.up_proj.weight"])


def test_script_writes_a_loadable_directory_with_its_record(make_charlm, tmp_path):
    from transformers.utils import logging as hf_logging

    out = tmp_path / "charlm"
    bars, deterministic = hf_logging.is_progress_bar_enabled(), torch.are_deterministic_algorithms_enabled()
    try:
        assert make_charlm.main(["--out", str(out), "--steps", "2", "--quiet"]) == 0
    finally:  # the script sets process-wide switches for itself; the rest of the suite keeps its own
        torch.use_deterministic_algorithms(deterministic)
        if bars:
            hf_logging.enable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer) == 99
    record = json.loads((out / "warmup.json").read_text())
    assert record["steps"] == 2 and record["versions"]["torch"] == torch.__version__
    assert f"torch {torch.__version__}" in (out / "README.md").read_text()
    assert record["test_accuracy"] == make_charlm.exact_match_rate(model, tokenizer, task_rows(record["test_task"]))


def test_hf_generate_stops_at_eos_and_agrees_with_the_script_greedy_decode(shipped, make_charlm):
    model, tokenizer = shipped
    rows = [row for row in task_rows("builtin://addition/test?size=60") if len(row["prompt"]) == 6][:20]
    prompts = [tokenizer.encode(row["prompt"]) for row in rows]
    ours = make_charlm.greedy_responses(model, prompts, tokenizer.eos_token_id, make_charlm.MAX_ANSWER_TOKENS)
    generated = model.generate(torch.tensor(prompts), do_sample=False, max_new_tokens=make_charlm.MAX_ANSWER_TOKENS)
    for response, full in zip(ours, generated[:, 6:].tolist()):
        assert full[: len(response)] == response
        assert response[-1] != tokenizer.eos_token_id or set(full[len(response) :]) <= {tokenizer.pad_token_id}
    assert sum(r[-1] == tokenizer.eos_token_id for r in ours) >= 15  # the warm-up taught it to stop
