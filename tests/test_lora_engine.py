"""The engine on a LoRA model: the adapter's update is the same whatever the split (micro-batches, token
budgets, packing) and the data-parallel layout (DDP and FSDP2, D = 2 and 3): float64, 1e-10 relative to
the update over three AdamW steps; the base weights are bitwise unchanged; only the adapter is optimized."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from splitproof.engine import wrap_model
from splitproof.engine.launch import run_data_parallel
from splitproof.lora import adapter_state, base_digest, lora_layers

from .engine_helpers import REL, flat, num_microbatches, rel_diff
from .lora_helpers import copy_of, lora_model, lora_update, rollout, split_configs


@pytest.fixture(scope="module")
def setup():
    model = lora_model()
    batch = rollout(model)
    configs = split_configs(len(batch))
    reference = lora_update(copy_of(model), batch, configs["whole"])
    return model, batch, configs, reference


def test_the_splits_really_split(setup):
    _, batch, configs, _ = setup
    assert num_microbatches(batch, configs["whole"]) == [1, 1, 1]  # three optimizer steps
    for name in ("micro1", "micro3", "budget", "packed"):
        assert max(num_microbatches(batch, configs[name])) >= 2, name


def test_only_the_adapter_is_optimized_and_the_base_never_moves(setup):
    model, batch, configs, (theta, digest, opt) = setup
    adapter = {id(p) for layer in lora_layers(model).values() for p in layer.parameters() if p.requires_grad}
    optimized = {id(p) for group in opt.param_groups for p in group["params"]}
    assert len(optimized) == len(adapter) > 0
    assert digest == base_digest(model)  # bitwise: the digest hashes every byte of the base weights
    theta0 = flat(adapter_state(model))
    b_start = [k for k in adapter_state(model) if "lora_B" in k]
    assert all(float(adapter_state(model)[k].abs().max()) == 0 for k in b_start)  # B starts at 0
    assert float((theta - theta0).abs().max()) > 1e-3  # the adapter learned


@pytest.mark.parametrize("name", ["micro1", "micro3", "budget", "packed"])
def test_lora_update_is_split_invariant(setup, name):
    model, batch, configs, (theta, digest, _) = setup
    theta_split, digest_split, _ = lora_update(copy_of(model), batch, configs[name])
    assert digest_split == digest
    assert rel_diff(theta, theta_split, flat(adapter_state(model))) <= REL


def _dp_worker(wrapper, model, batch, configs):
    out = {}
    for name in ("micro1", "packed"):
        wrapped = wrap_model(copy_of(model), wrapper)
        out[name] = lora_update(wrapped, batch, configs[name])[:2]
    dist.barrier()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("wrapper,world", [("ddp", 2), ("fsdp2", 2), ("ddp", 3), ("fsdp2", 3)])
def test_lora_update_under_data_parallel_matches_one_process(setup, wrapper, world):
    model, batch, configs, (theta, digest, _) = setup
    ranks = run_data_parallel(_dp_worker, world, wrapper, model, batch, configs, timeout=240)
    theta0 = flat(adapter_state(model))
    for rank, out in enumerate(ranks):
        for name, (theta_dp, digest_dp) in out.items():
            assert digest_dp == digest, f"{name} rank {rank}: base weights moved"
            diff = rel_diff(theta, theta_dp, theta0)
            assert diff <= REL, f"{name} rank {rank}: adapter differs by {diff:.3e} relative"
    assert torch.equal(ranks[0]["micro1"][0], ranks[-1]["micro1"][0])


def test_the_engine_sees_the_hugging_face_model_inside_the_peft_wrapper(setup):
    from splitproof.engine.distributed import _decoder_layers
    from splitproof.engine.logprobs import takes_logits_to_keep

    model = setup[0]
    assert len(_decoder_layers(model)) == 2  # FSDP2 shards each decoder layer, not only the root
    assert takes_logits_to_keep(model)  # logits only at the response positions
