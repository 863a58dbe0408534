"""Padding-free microbatches (use_remove_padding): same log-probs, same update, less padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitproof.batch import RolloutBatch
from splitproof.engine import UpdateConfig
from splitproof.engine.launch import run_data_parallel
from splitproof.engine.logprobs import compute_log_probs, response_log_probs
from splitproof.engine.microbatch import budget_microbatches
from splitproof.engine.packing import pack_into_rows, packed_cost, row_width

from .engine_helpers import flat, full_state, loss_config, make_model, make_rollout, rel_diff, run_update


@settings(max_examples=80)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=40))
def test_pack_into_rows_places_every_sequence_once_within_the_width(lengths):
    """The row width bounds attention cost (≤ 3 × longest); the cost the planner sees is the layout's."""
    width = row_width(lengths)
    assert max(lengths) <= width <= 3 * max(lengths)
    rows = pack_into_rows(lengths, width)
    assert sorted(k for row in rows for k in row) == list(range(len(lengths)))
    assert all(sum(lengths[k] for k in row) <= width for row in rows)
    assert packed_cost(lengths) == len(rows) * width
    for other in {max(lengths), 2 * max(lengths)}:  # the chosen width computes no more than these
        if other < sum(lengths):
            assert len(rows) * width <= len(pack_into_rows(lengths, other)) * other


@settings(max_examples=60)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=40), st.integers(60, 400))
def test_packed_budget_bounds_what_is_computed(lengths, budget):
    rows = list(range(len(lengths)))
    micro = budget_microbatches(rows, lengths, budget, packed=True)
    assert sorted(r for mb in micro for r in mb) == rows
    for mb in micro:
        assert packed_cost([lengths[r] for r in mb]) <= budget


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_log_probs_equal_padded_ones_in_float64(arch):
    model = make_model(arch, seed=2)
    batch = make_rollout(model, 10, 10, 16, seed=3, holes=False)
    with torch.no_grad():
        padded, h_padded = response_log_probs(model, batch, temperature=0.8, with_entropy=True)
        packed, h_packed = response_log_probs(model, batch, temperature=0.8, with_entropy=True, packed=True)
    assert float((padded - packed).abs().max()) <= 1e-12
    assert float((h_padded - h_packed).abs().max()) <= 1e-12
    grads = []
    for flag in (False, True):
        model.zero_grad()
        lp, _ = response_log_probs(model, batch, packed=flag)
        (lp * batch.advantages).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[0] - grads[1]).abs().max()) <= 1e-10 * float(grads[0].abs().max())


@pytest.fixture(scope="module")
def setup():
    model = make_model("llama", seed=6)
    batch = make_rollout(model, 8, 8, 12, seed=7)
    return model, batch, flat(full_state(model))


@pytest.mark.parametrize(
    "loss_mode,agg_mode",
    [
        ("vanilla", "token-mean"),
        ("geo_mean", "seq-mean-token-sum"),
        ("kl_cov", "seq-mean-token-mean"),
        ("clip_cov", "token-sum"),
    ],
)
def test_packed_update_equals_padded_update(setup, loss_mode, agg_mode):
    model, batch, theta0 = setup
    base = dict(loss=loss_config(loss_mode, agg_mode), ppo_mini_batch_size=8, grad_clip=1e9)
    reference, _ = run_update(model, batch, UpdateConfig(**base))
    for extra in (dict(ppo_micro_batch_size_per_gpu=3), dict(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40)):
        params, _ = run_update(model, batch, UpdateConfig(**base, use_remove_padding=True, **extra))
        assert rel_diff(params, reference, theta0) <= 1e-10


def _dp_worker(model, batch, wrapper):
    from splitproof.engine import wrap_model

    model = wrap_model(model, wrapper)
    config = UpdateConfig(
        loss=loss_config("kl_cov", "token-mean"),
        ppo_mini_batch_size=8,
        grad_clip=1e9,
        use_remove_padding=True,
        use_dynamic_bsz=True,
        ppo_max_token_len_per_gpu=40,
    )
    params, _ = run_update(model, batch, config, copy_model=False)
    return params


@pytest.mark.dist
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_packed_update_under_data_parallel(setup, wrapper):
    model, batch, theta0 = setup
    reference, _ = run_update(
        model, batch, UpdateConfig(loss=loss_config("kl_cov", "token-mean"), ppo_mini_batch_size=8, grad_clip=1e9)
    )
    ranks = run_data_parallel(_dp_worker, 2, model, batch, wrapper, timeout=120)
    assert rel_diff(ranks[0], reference, theta0) <= 1e-10


# ------------------------------------------------------------------------------------------------ layouts
# Rows the batch contract accepts besides left-padded prompts and right-padded responses. A sequence packs
# as its span (first to last real token, holes included), so packed rows give the padded rows' log-probs.
LAYOUTS = [  # (prompt attention, response attention)
    ("001111", "1111100"),  # the usual layout
    ("111000", "1111110"),  # right-padded prompt
    ("110111", "1110000"),  # a hole inside the prompt
    ("011110", "1101100"),  # padding on both sides of the prompt, holes inside the response
    ("111111", "1000000"),  # no padding in the prompt, a one-token response
    ("000111", "0000000"),  # no response at all
    ("100001", "0111111"),  # a wide prompt hole, and the response starts after a padding column
]


def layout_batch(model, layouts=LAYOUTS, seed=0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    prompt_att = torch.tensor([[c == "1" for c in p] for p, _ in layouts])
    resp_att = torch.tensor([[c == "1" for c in r] for _, r in layouts])
    B, P, T = len(layouts), prompt_att.shape[1], resp_att.shape[1]
    batch = RolloutBatch(
        prompts=torch.where(prompt_att, torch.randint(0, 256, (B, P), generator=g), 9999),  # junk pad ids
        responses=torch.where(resp_att, torch.randint(0, 256, (B, T), generator=g), -5),
        attention_mask=torch.cat([prompt_att, resp_att], dim=1).long(),
        response_mask=resp_att.long(),
        old_log_probs=torch.zeros(B, T, dtype=torch.float64),
        advantages=torch.linspace(-1, 1, B, dtype=torch.float64),
    )
    with torch.no_grad():
        logp, _ = response_log_probs(model, batch)
    batch.old_log_probs = torch.where(resp_att, logp + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64), 0.0)
    batch.ref_log_probs = batch.old_log_probs + 0.05
    return batch


def hf_padded(model, batch):
    """Each row alone through Hugging Face's own padded forward (2-D mask), full width: the reference."""
    ids = torch.where(batch.attention_mask.bool(), batch.input_ids, 0)
    P, T = batch.prompt_width, batch.response_width
    out = torch.zeros(len(batch), T, dtype=torch.float64)
    for i in range(len(batch)):
        mask = batch.attention_mask[i : i + 1].long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids[i : i + 1], attention_mask=mask, position_ids=pos).logits
        logp = torch.log_softmax(logits[0, P - 1 : P + T - 1], dim=-1).gather(-1, ids[i, P:, None]).squeeze(-1)
        out[i] = torch.where(batch.attention_mask[i, P:].bool(), logp, 0.0)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_rows_handle_every_accepted_layout(arch):
    model = make_model(arch, seed=2)
    batch = layout_batch(model).validate()
    with torch.no_grad():
        reference = hf_padded(model, batch)
        padded, h_padded = response_log_probs(model, batch, with_entropy=True)
        packed, h_packed = response_log_probs(model, batch, with_entropy=True, packed=True)
    assert float((padded - reference).abs().max()) <= 1e-12
    assert float((packed - padded).abs().max()) <= 1e-12
    assert float((h_packed - h_padded).abs().max()) <= 1e-12


def test_packed_update_equals_padded_update_on_every_layout():
    model = make_model("llama", seed=6)
    batch = layout_batch(model, LAYOUTS * 2, seed=1)  # 14 sequences
    batch.seq_ids = torch.arange(100, 114)
    theta0 = flat(full_state(model))
    base = dict(loss=loss_config("geo_mean", "seq-mean-token-sum"), ppo_mini_batch_size=14, grad_clip=1e9)
    reference, _ = run_update(model, batch, UpdateConfig(**base))
    params, _ = run_update(
        model, batch, UpdateConfig(**base, use_remove_padding=True, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=40)
    )
    assert rel_diff(params, reference, theta0) <= 1e-10


class ShapeRecorder(torch.nn.Module):
    """Records the [rows, width] of every forward it passes to the model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.shapes = []

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        self.shapes.append(tuple(input_ids.shape))
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits


@pytest.mark.parametrize("packed", [False, True])
def test_token_budget_bounds_what_is_computed_on_every_layout(packed):
    """Budgets count a sequence's span, holes included: what the forward really computes."""
    model = make_model("llama", seed=2)
    recorder = ShapeRecorder(model)
    # right-padded prompts: 3 real prompt tokens, but the first is 6 columns before the response
    for layouts, budget in ((LAYOUTS * 2, 26), ([("111000", "1111110"), ("110000", "1111100")] * 2, 20)):
        recorder.shapes.clear()
        compute_log_probs(recorder, layout_batch(model, layouts), max_token_len=budget, packed=packed)
        assert len(recorder.shapes) >= 3
        assert all(rows * width <= budget for rows, width in recorder.shapes), recorder.shapes


@st.composite
def random_layouts(draw):
    rows = draw(st.integers(1, 6))
    P, T = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    out = []
    for _ in range(rows):
        prompt = draw(st.lists(st.booleans(), min_size=P, max_size=P))
        response = draw(st.lists(st.booleans(), min_size=T, max_size=T))
        if not any(prompt):  # the contract: a sequence with response tokens has a prompt token
            prompt[draw(st.integers(0, P - 1))] = True
        out.append(("".join("1" if c else "0" for c in prompt), "".join("1" if c else "0" for c in response)))
    return out


@settings(max_examples=25)
@given(random_layouts())
def test_packed_log_probs_equal_padded_ones_on_random_layouts(layouts):
    model = _property_model()
    batch = layout_batch(model, layouts)
    with torch.no_grad():
        padded, _ = response_log_probs(model, batch)
        packed, _ = response_log_probs(model, batch, packed=True)
    assert float((packed - padded).abs().max()) <= 1e-12


_MODELS = {}


def _property_model():
    if "llama" not in _MODELS:
        _MODELS["llama"] = make_model("llama", seed=9)
    return _MODELS["llama"]
