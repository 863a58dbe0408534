"""Checkpoints: bitwise round trip, atomic saves under crashes and kills, layout-free across DP, resume rules."""

import copy
import multiprocessing
import os
import pickle
import random
import time

import numpy as np
import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from splitproof import ConfigError
from splitproof.engine import wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.hf_models import tiny_causal_lm
from splitproof.rl.checkpoint import resume
from splitproof.rl.checkpoint import store as ckpt
from splitproof.rl.config.load import dump_config, load_train_config
from splitproof.rl.config.schema import TrainerConfig

TRAINER_STATE = {"sampler": {"epoch": 1, "cursor": 24}, "kl_coef": 0.0125, "history": [0.5, 0.25]}


def make(seed=0, dtype=torch.float64, strategy="none"):
    model = wrap_model(
        tiny_causal_lm(seed=seed, dtype=dtype, num_layers=2, hidden_size=32, intermediate_size=64), strategy
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def train_step(model, optimizer, scheduler, seed):
    ids = torch.randint(0, 256, (4, 10), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()


def full_state(model, optimizer):
    """(model, optimizer) state by parameter name, gathered on rank 0 whatever the wrapping; a copy."""
    state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return copy.deepcopy(state)


def assert_same_state(a, b):
    (model_a, optim_a), (model_b, optim_b) = a, b
    assert model_a.keys() == model_b.keys()
    for name in model_a:
        assert torch.equal(model_a[name], model_b[name]), name
    assert optim_a["state"].keys() == optim_b["state"].keys()
    for name, entries in optim_a["state"].items():
        assert entries.keys() == optim_b["state"][name].keys()
        for key, value in entries.items():
            assert torch.equal(value, optim_b["state"][name][key]), (name, key)
    assert optim_a["param_groups"] == optim_b["param_groups"]


def rng_snapshot():
    return torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()


def save(root, step, model, optimizer, scheduler, **kwargs):
    return ckpt.save_checkpoint(
        root,
        step,
        model=model,
        optimizer=optimizer,
        lr_scheduler=scheduler,
        trainer_state={**TRAINER_STATE, "step": step},
        **kwargs,
    )


def tiny_tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abc")}}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )


def test_round_trip_is_bitwise(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optimizer, scheduler = make()
    for s in range(2):
        train_step(model, optimizer, scheduler, s)
    torch.manual_seed(123), random.seed(5), np.random.seed(7)
    rngs = rng_snapshot()
    path = save(tmp_path, 2, model, optimizer, scheduler, tokenizer=tiny_tokenizer(), config_yaml="a: 1\n")
    assert (tmp_path / ckpt.TRACKER).read_text().strip() == "2" and resume.latest_checkpoint(tmp_path) == path
    torch.rand(3), random.random(), np.random.rand()  # move every RNG on
    again = make(seed=1)
    resumed = ckpt.load_checkpoint(path, model=again[0], optimizer=again[1], lr_scheduler=again[2])
    assert (resumed.step, resumed.trainer_state, resumed.config_yaml) == (2, {**TRAINER_STATE, "step": 2}, "a: 1\n")
    assert_same_state(full_state(model, optimizer), full_state(again[0], again[1]))
    assert again[2].state_dict() == scheduler.state_dict()
    after = rng_snapshot()
    assert torch.equal(after[0], rngs[0]) and after[1] == rngs[1] and np.array_equal(after[2], rngs[2])
    # the next step is the same step
    train_step(model, optimizer, scheduler, 9)
    train_step(*again, 9)
    assert_same_state(full_state(model, optimizer), full_state(again[0], again[1]))
    # the actor directory is a Hugging Face model and tokenizer
    assert type(AutoModelForCausalLM.from_pretrained(path / "actor")).__name__ == "LlamaForCausalLM"
    assert AutoTokenizer.from_pretrained(path / "actor").convert_tokens_to_ids("b") == 3


def test_actor_dir_holds_the_saved_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    model, optimizer, scheduler = make()
    train_step(model, optimizer, scheduler, 0)
    path = save(tmp_path, 1, model, optimizer, scheduler)
    hf = AutoModelForCausalLM.from_pretrained(path / "actor")
    assert hf.dtype == torch.float64
    mine = model.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, mine[name]), name


def test_trainer_state_must_load_weights_only(tmp_path):
    model, optimizer, scheduler = make()
    save(tmp_path, 1, model, optimizer, scheduler)
    with pytest.raises(TypeError, match="weights_only"):
        ckpt.save_checkpoint(tmp_path, 2, model=model, optimizer=optimizer, trainer_state={"x": object()})
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", ckpt.TRACKER]


def test_dcp_metadata_is_not_unpickled_blindly(tmp_path):
    model, optimizer, scheduler = make()
    path = save(tmp_path, 1, model, optimizer, scheduler)

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (path / "actor_state" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system: refused"):
        ckpt.load_checkpoint(path, model=model, optimizer=optimizer)
    assert not (tmp_path / "pwned").exists()


STAGES = ("actor_state", "actor", "trainer_state", "complete", "renamed")


def test_crash_at_any_stage_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, optimizer, scheduler = make()
    save(tmp_path, 1, model, optimizer, scheduler)
    expected = full_state(model, optimizer)
    train_step(model, optimizer, scheduler, 1)
    for stage in STAGES:

        def crash(at, stage=stage):
            if at == stage:
                raise RuntimeError(f"crash at {at}")

        monkeypatch.setattr(ckpt, "_progress_hook", crash)
        with pytest.raises(RuntimeError, match=stage):
            save(tmp_path, 2, model, optimizer, scheduler)
        newest = resume.latest_checkpoint(tmp_path)
        assert newest == ckpt.checkpoint_dir(tmp_path, 1), stage
        fresh = make(seed=3)
        ckpt.load_checkpoint(newest, model=fresh[0], optimizer=fresh[1], lr_scheduler=fresh[2])
        assert_same_state(expected, full_state(fresh[0], fresh[1]))
    monkeypatch.setattr(ckpt, "_progress_hook", lambda at: None)
    save(tmp_path, 3, model, optimizer, scheduler)
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".")]  # leftovers cleaned up
    assert resume.latest_checkpoint(tmp_path) == ckpt.checkpoint_dir(tmp_path, 3)


def _write_then_stall(root, stage, ready):
    """A writer process: saves step 1, then stalls inside the save of step 2 at ``stage``."""
    torch.set_num_threads(1)
    model, optimizer, scheduler = make()
    save(root, 1, model, optimizer, scheduler)
    train_step(model, optimizer, scheduler, 1)

    def stall(at):
        if at == stage:
            ready.set()
            time.sleep(600)

    ckpt._progress_hook = stall
    save(root, 2, model, optimizer, scheduler)


@pytest.mark.parametrize("stage", ["actor", "complete"])
def test_killed_writer_leaves_the_previous_checkpoint(tmp_path, stage):
    root = tmp_path / "run"
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    writer = ctx.Process(target=_write_then_stall, args=(root, stage, ready), daemon=True)
    writer.start()
    try:
        assert ready.wait(timeout=120)
    finally:
        writer.kill()  # SIGKILL: no cleanup runs
        writer.join()
    assert (root / ".tmp-global_step_2").is_dir()  # the half-written checkpoint
    assert resume.latest_checkpoint(root) == ckpt.checkpoint_dir(root, 1)
    model, optimizer, scheduler = make(seed=4)
    assert (
        ckpt.load_checkpoint(
            resume.latest_checkpoint(root), model=model, optimizer=optimizer, lr_scheduler=scheduler
        ).step
        == 1
    )
    reference = make()
    assert_same_state(full_state(model, optimizer), full_state(reference[0], reference[1]))
    save(root, 2, model, optimizer, scheduler)
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", ckpt.TRACKER]


def test_max_to_keep_prunes_older(tmp_path):
    model, optimizer, scheduler = make()
    for step in range(1, 5):
        save(tmp_path, step, model, optimizer, scheduler, max_to_keep=2)
    assert sorted(os.listdir(tmp_path)) == ["global_step_3", "global_step_4", ckpt.TRACKER]


def test_resume_modes(tmp_path):
    root = tmp_path / "run"
    trainer = TrainerConfig(default_local_dir=str(root))
    assert resume.find_resume_checkpoint(trainer) is None
    model, optimizer, scheduler = make()
    save(root, 1, model, optimizer, scheduler)
    save(root, 2, model, optimizer, scheduler)
    assert resume.find_resume_checkpoint(trainer) == root / "global_step_2"
    (root / ckpt.TRACKER).write_text("7\n")  # names nothing complete: the newest complete one is used
    assert resume.find_resume_checkpoint(trainer) == root / "global_step_2"
    assert resume.find_resume_checkpoint(TrainerConfig(default_local_dir=str(root), resume_mode="disable")) is None

    def by_path(path):
        return resume.find_resume_checkpoint(TrainerConfig(resume_mode="resume_path", resume_from_path=str(path)))

    assert by_path(root / "global_step_1") == root / "global_step_1"
    assert by_path(root) == root / "global_step_2"
    (root / "global_step_2" / ckpt.COMPLETE).unlink()
    for bad in (root / "global_step_2", tmp_path / "missing"):
        with pytest.raises(ConfigError) as info:
            by_path(bad)
        assert info.value.field == "trainer.resume_from_path"


def test_resume_config_check():
    base = ["trainer.total_training_steps=10"]
    cfg = load_train_config(None, base)
    resumed = ckpt.Resumed(path="x", step=1, trainer_state={}, config_yaml=dump_config(cfg))
    layout = load_train_config(
        None,
        base
        + [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "actor_rollout_ref.actor.strategy=ddp",
            "actor_rollout_ref.rollout.max_num_seqs=3",
            "actor_rollout_ref.model.use_remove_padding=true",
            "trainer.logger=[console]",
            "trainer.total_training_steps=20",
            "trainer.test_freq=3",
        ],
    )
    resume.check_resume_config(resumed, layout)
    changed = load_train_config(None, base + ["actor_rollout_ref.actor.optim.lr=0.5", "data.seed=4"])
    with pytest.raises(ConfigError) as info:
        resume.check_resume_config(resumed, changed)
    assert info.value.field == "actor_rollout_ref.actor.optim.lr, data.seed"
    resume.check_resume_config(
        resumed,
        load_train_config(
            None, base + ["actor_rollout_ref.actor.optim.lr=0.5", "trainer.resume_allow_config_change=true"]
        ),
    )
    # a cosine schedule stretched over the run: its length changes the result
    cosine = base + ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"]
    resumed.config_yaml = dump_config(load_train_config(None, cosine))
    with pytest.raises(ConfigError, match="trainer.total_training_steps"):
        resume.check_resume_config(resumed, load_train_config(None, cosine[1:] + ["trainer.total_training_steps=20"]))


def test_resume_notices_keys_added_to_or_removed_from_a_mapping():
    """An empty mapping flattens to no leaf; a key added to it (or removed) is a change all the same."""
    base = ["trainer.total_training_steps=10"]
    thinking = base + ["+data.apply_chat_template_kwargs.enable_thinking=true"]
    for saved, now in ((base, thinking), (thinking, base)):
        resumed = ckpt.Resumed(
            path="x", step=1, trainer_state={}, config_yaml=dump_config(load_train_config(None, saved))
        )
        with pytest.raises(ConfigError) as info:
            resume.check_resume_config(resumed, load_train_config(None, now))
        assert info.value.field.startswith("data.apply_chat_template_kwargs")
    two = thinking + ["+data.apply_chat_template_kwargs.x=1"]
    resumed = ckpt.Resumed(path="x", step=1, trainer_state={}, config_yaml=dump_config(load_train_config(None, two)))
    with pytest.raises(ConfigError, match="data.apply_chat_template_kwargs.x"):
        resume.check_resume_config(resumed, load_train_config(None, thinking))
    resume.check_resume_config(resumed, load_train_config(None, two))


# ------------------------------------------------------------------------------------------ data parallel


def _dp_train_and_save(root, strategy):
    import torch.distributed as dist

    rank = dist.get_rank()
    model, optimizer, scheduler = make(strategy=strategy)
    train_step(model, optimizer, scheduler, 10 + rank)
    save(root, 1, model, optimizer, scheduler)
    return full_state(model, optimizer), scheduler.state_dict()


def _dp_load(paths, strategy, save_root=None):
    """Load each checkpoint into a fresh wrapped model; then, if asked, train a step from the last and save it."""
    import torch.distributed as dist

    out = []
    for path in paths:
        model, optimizer, scheduler = make(seed=5, strategy=strategy)
        resumed = ckpt.load_checkpoint(path, model=model, optimizer=optimizer, lr_scheduler=scheduler)
        out.append((full_state(model, optimizer), scheduler.state_dict(), resumed.step))
    if save_root is not None:
        train_step(model, optimizer, scheduler, 30 + dist.get_rank())
        save(save_root, 3, model, optimizer, scheduler)
        out.append(full_state(model, optimizer))
    return out


@pytest.mark.dist
def test_checkpoints_hold_no_dp_layout(tmp_path):
    fsdp_root, one_root, ddp_root = tmp_path / "fsdp2", tmp_path / "one", tmp_path / "ddp"
    # written by 2 FSDP2 ranks ...
    written, schedule = run_data_parallel(_dp_train_and_save, 2, fsdp_root, "fsdp2")[0]
    assert len(list((fsdp_root / "global_step_1" / "actor_state").glob("*.distcp"))) == 2  # one shard per rank
    from transformers import AutoModelForCausalLM  # the HF directory was gathered on rank 0

    hf = AutoModelForCausalLM.from_pretrained(fsdp_root / "global_step_1" / "actor")
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(t, written[0][name]) for name, t in hf.state_dict().items())
    # ... loads on one process
    model, optimizer, scheduler = make(seed=6)
    ckpt.load_checkpoint(fsdp_root / "global_step_1", model=model, optimizer=optimizer, lr_scheduler=scheduler)
    assert_same_state(written, full_state(model, optimizer))
    assert scheduler.state_dict() == schedule
    # one process writes; DDP ranks load both and write their own
    train_step(model, optimizer, scheduler, 20)
    save(one_root, 2, model, optimizer, scheduler)
    one = full_state(model, optimizer)
    ddp_loaded = run_data_parallel(
        _dp_load, 2, [fsdp_root / "global_step_1", one_root / "global_step_2"], "ddp", ddp_root
    )
    assert [out[2] for out in ddp_loaded[1][:2]] == [1, 2]  # every rank loaded both
    assert_same_state(written, ddp_loaded[0][0][0])  # (full states are gathered on rank 0)
    assert_same_state(one, ddp_loaded[0][1][0])
    ddp_written = ddp_loaded[0][2]
    # FSDP2 ranks load what one process and what DDP ranks wrote
    fsdp_loaded = run_data_parallel(_dp_load, 2, [one_root / "global_step_2", ddp_root / "global_step_3"], "fsdp2")[0]
    assert_same_state(one, fsdp_loaded[0][0])
    assert_same_state(ddp_written, fsdp_loaded[1][0])
