"""Shared helpers for the engine tests: tiny models, rollouts, one update, parameter comparisons."""

from __future__ import annotations

import copy
import warnings
from dataclasses import fields, replace

import torch

from splitproof.batch import RolloutBatch
from splitproof.diagnose.synthetic import synthetic_rollout
from splitproof.engine import UpdateConfig, update_policy
from splitproof.engine.plan import plan_update
from splitproof.hf_models import tiny_causal_lm
from splitproof.loss_config import LossConfig

REL = 1e-10  # float64 acceptance: relative to the update size
METRIC_ABS = 1e-15  # a signed sum (ppo_kl) may cancel to ~0; absolute differences below this are noise

# Gradient clipping would rescale every gradient to the same norm and hide a wrong normaliser, so the
# exactness tests disable it (grad_norm is still reported and compared).
NO_CLIP = 1e9
BUDGET = 40  # tokens (prompt + response) per microbatch: make_rollout's sequences are 6..20 tokens long


def make_model(arch: str = "llama", dtype=torch.float64, seed: int = 0, *, exact_norms: bool = False):
    model = tiny_causal_lm(arch, dtype=dtype, seed=seed)
    return with_exact_norms(model) if exact_norms else model


def _exact_rms_norm(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


_EXACT_CLASSES: dict[type, type] = {}


def with_exact_norms(model):
    """Make the model's RMSNorms compute in the input dtype (in place).

    Hugging Face's Llama/Qwen2 RMSNorm casts to float32 and back even in a float64 model: its forward
    values are float32-rounded (the engine's update backpropagates through it in float64 already,
    ``engine/norm_gradients.py``). With these norms the model is float64 throughout, forward included.
    """
    for module in model.modules():
        cls = type(module)
        if cls.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon"):
            if cls not in _EXACT_CLASSES:
                _EXACT_CLASSES[cls] = type(f"Exact{cls.__name__}", (cls,), {"forward": _exact_rms_norm})
            module.__class__ = _EXACT_CLASSES[cls]
    return model


def make_rollout(
    model,
    num_sequences: int = 8,
    prompt_length: int = 8,
    response_length: int = 12,
    *,
    seed: int = 1,
    holes: bool = True,
    **kwargs,
) -> RolloutBatch:
    """A synthetic rollout with IS weights; with ``holes`` a multi-turn gap and one empty sequence
    (n_i = 0: it must count nowhere) — what real batches contain."""
    batch = synthetic_rollout(
        model, num_sequences, prompt_length, response_length, seed=seed, with_is_weights=True, **kwargs
    )
    if holes and num_sequences >= 4:
        mask = batch.response_mask.clone()
        lengths = mask.sum(dim=1)
        row = int(torch.argmax(lengths))
        mask[row, 1:3] = 0  # a multi-turn hole inside a real response
        empty = (row + 1) % num_sequences
        mask[empty] = 0  # a sequence with no valid token
        batch.response_mask = mask
    return batch


def grouped_rollout(model, seed: int = 1) -> RolloutBatch:
    """12 sequences with group ids (``index``): groups of 4, 2 (plus an empty member), 2, 1 and 1 non-empty
    sequences, their rows scattered, and a group holding nothing but an empty sequence (it counts nowhere)."""
    batch = make_rollout(model, 12, seed=seed)  # one empty sequence, one with a multi-turn hole
    mask = batch.response_mask.clone()
    empty = int((mask.sum(1) == 0).nonzero()[0, 0])
    second_empty = (empty + 5) % 12
    mask[second_empty] = 0
    batch.response_mask = mask
    labels = iter([5, 3, 8, 5, 1, 3, 5, 8, 6, 5])
    index = [99 if r == empty else 3 if r == second_empty else next(labels) for r in range(12)]
    batch.index = torch.tensor(index)
    return batch


def cast_batch(batch: RolloutBatch, dtype) -> RolloutBatch:
    changes = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if value is not None and value.is_floating_point() and f.name not in ("response_mask", "attention_mask"):
            changes[f.name] = value.to(dtype)
    return replace(batch, **changes)


def loss_config(loss_mode: str, agg_mode: str, **overrides) -> LossConfig:
    """Every term on: KL loss, entropy bonus (IS weights come with the rollout)."""
    values = dict(loss_mode=loss_mode, loss_agg_mode=agg_mode, use_kl_loss=True, entropy_coeff=0.01)
    if loss_mode == "dro":
        values["dro_beta"] = 0.1
    if loss_mode in ("kl_cov", "clip_cov"):
        # enough selected tokens in an ~80-token minibatch that a wrong selection shows
        values.update(kl_cov_ratio=0.05, clip_cov_ratio=0.05, clip_cov_lb=0.0, clip_cov_ub=100.0)
    values.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LossConfig(**values)


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every floating tensor of a state dict, by sorted key, as one vector (a copy)."""
    return torch.cat([state[k].detach().reshape(-1).clone() for k in sorted(state) if state[k].is_floating_point()])


def full_state(model) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a plain, DDP or FSDP2 model; collective under FSDP2."""
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in inner.state_dict().items()}


def run_wrapped_cases(update, wrapper: str, model, cases: dict) -> dict:
    """``update(model, optimizer, batch, config)`` on a fresh ``wrap_model(copy, wrapper)`` per case
    ``name -> (batch, config, optimizer kind)``; returns ``name -> (flat final state, step results)``."""
    from splitproof.engine import wrap_model

    out = {}
    for name, (batch, cfg, optimizer) in cases.items():
        wrapped = wrap_model(copy.deepcopy(model), wrapper)
        opt = make_optimizer(wrapped, optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            results = update(wrapped, opt, batch, cfg)
        out[name] = (flat(full_state(wrapped)), results)
        del wrapped, opt
    return out


def make_optimizer(model, kind: str = "sgd", lr: float = 0.02):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr)
    raise ValueError(kind)


def run_update(
    model,
    batch: RolloutBatch,
    config: UpdateConfig,
    *,
    optimizer: str = "sgd",
    lr: float = 0.02,
    copy_model: bool = True,
    make_objective=None,
):
    """One update on a copy of ``model``: (flattened parameters after, list[StepResult])."""
    model = copy.deepcopy(model) if copy_model else model
    opt = make_optimizer(model, optimizer, lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = update_policy(model, opt, batch, config, make_objective=make_objective)
    return flat(full_state(model)), results


def rel_diff(a: torch.Tensor, b: torch.Tensor, theta0: torch.Tensor, reference: torch.Tensor | None = None) -> float:
    """‖a − b‖∞ relative to the update size ‖reference − θ0‖∞ (reference defaults to a)."""
    reference = a if reference is None else reference
    scale = float((reference.double() - theta0.double()).abs().max())
    assert scale > 0, "the update did not move the parameters"
    return float((a.double() - b.double()).abs().max()) / scale


def metric_diffs(m1: dict[str, float], m2: dict[str, float]) -> dict[str, float]:
    """Per metric: |a − b| / max(|a|, |b|), with differences below METRIC_ABS counted as 0."""
    assert set(m1) == set(m2), f"metric names differ: {sorted(set(m1) ^ set(m2))}"
    out = {}
    for name in m1:
        a, b = m1[name], m2[name]
        d = abs(a - b)
        out[name] = 0.0 if d <= METRIC_ABS else d / max(abs(a), abs(b))
    return out


def assert_metrics_close(m1, m2, rel: float = REL, label: str = ""):
    diffs = metric_diffs(m1, m2)
    bad = {k: (m1[k], m2[k], d) for k, d in diffs.items() if d > rel}
    assert not bad, f"{label}: metrics differ beyond {rel}: {bad}"


def num_microbatches(batch: RolloutBatch, config: UpdateConfig, world: int = 1, rank: int = 0) -> list[int]:
    return [len(p.microbatches) for p in plan_update(batch.validate(), config, world, rank)]


def permutation(n: int, seed: int = 123) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    if perm == list(range(n)):
        perm = perm[::-1]
    return perm


def split_runs(batch: RolloutBatch, loss: LossConfig, **common):
    """(name, batch, config) of every split compared with one microbatch of the whole minibatch."""
    base = dict(loss=loss, ppo_mini_batch_size=len(batch), grad_clip=NO_CLIP, **common)
    permuted = batch.select(permutation(len(batch)))  # seq_ids travel with their rows
    return [
        ("micro1", batch, UpdateConfig(**base, ppo_micro_batch_size_per_gpu=1)),
        ("uneven3", batch, UpdateConfig(**base, ppo_micro_batch_size_per_gpu=3)),
        ("budget", batch, UpdateConfig(**base, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=BUDGET)),
        ("shuffled", permuted, UpdateConfig(**base)),
        ("shuffled+uneven3", permuted, UpdateConfig(**base, ppo_micro_batch_size_per_gpu=3)),
    ]
