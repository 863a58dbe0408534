"""Row-invariant products: a row's output does not depend on how many rows share its product, so the
no-grad passes (log-probs, values, the hf rollout) give the same bits in every layout — with MKL's AVX2
kernels too, where a plain product's rows past its last full tile of 4 round differently."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import splitproof.engine.logprobs as logprobs_module
import splitproof.engine.row_invariant as row_invariant_module
from splitproof.engine import compute_log_probs, compute_values
from splitproof.engine.logprobs import response_log_probs
from splitproof.engine.row_invariant import (
    MAX_ROWS,
    MIN_ROWS,
    NARROW,
    ROWS,
    TILE,
    aligned_width,
    blocked_linear,
    fixed_tile_linear,
    row_invariant,
    rows_per_forward,
)
from splitproof.hf_models import tiny_causal_lm
from splitproof.rl.rollout import HFRollout, SamplingParams, requests_for
from splitproof.value_model import value_model_from_pretrained

from .test_logprobs import make_batch

pytestmark = pytest.mark.invariance
ROW_COUNTS = (1, 2, 3, 5, 16, 17, 30, 48)
LAYOUTS = [
    dict(micro_batch_size=1),
    dict(micro_batch_size=3),
    dict(micro_batch_size=5),
    dict(max_token_len=60),
    dict(max_token_len=60, packed=True),
    dict(max_token_len=400, packed=True),
]


def _operands(dtype, bias=True, n_out=80, rows=60):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 96, generator=g, dtype=dtype)
    w = torch.randn(n_out, 96, generator=g, dtype=dtype)
    return x, w, (torch.randn(n_out, generator=g, dtype=dtype) if bias else None)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_out", [80, 1])  # 1: a value head
@pytest.mark.parametrize("product", [blocked_linear, fixed_tile_linear])
def test_a_row_is_the_same_in_every_product(dtype, bias, n_out, product):
    x, w, b = _operands(dtype, bias, n_out)
    whole = product(x, w, b)
    for m in ROW_COUNTS:
        for start in (0, 1, 3, 12):
            assert torch.equal(product(x[start : start + m], w, b), whole[start : start + m]), (m, start)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_row_is_the_same_past_the_largest_product(dtype):
    """More than ``MAX_ROWS`` rows run in several products; a row keeps its bits in each of them."""
    x, w, b = _operands(dtype, rows=MAX_ROWS + 80)
    whole = fixed_tile_linear(x, w, b)
    for m in (MAX_ROWS - 1, MAX_ROWS, MAX_ROWS + 1, MAX_ROWS + 13, MAX_ROWS + 66):
        for start in (0, 3, 13):
            assert torch.equal(fixed_tile_linear(x[start : start + m], w, b), whole[start : start + m]), (m, start)


PLAIN_PRODUCT_CONTROL = """
import torch, torch.nn.functional as F
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
x, w = torch.randn(60, 96, generator=g, dtype=torch.float64), torch.randn(80, 96, generator=g, dtype=torch.float64)
whole = F.linear(x[:48], w)
print(sum(not torch.equal(F.linear(x[:m], w), whole[:m]) for m in %r))
"""


def test_a_plain_product_is_not():
    """The control: without MKL's strict mode, a plain F.linear moves some row with the row count (MKL's AMD
    path: rows past the last full tile of 4; its Intel path: products under 56 rows; AVX-512: a product of 1
    row), so the tests above can fail. The strict mode is set when MKL starts: a process of its own."""
    env = {**os.environ, "MKL_CBWR": "AUTO"}
    run = subprocess.run(
        [sys.executable, "-c", PLAIN_PRODUCT_CONTROL % (ROW_COUNTS,)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 0, "no row count moved a row of a plain product"


@pytest.mark.parametrize("product", [blocked_linear, fixed_tile_linear])
@pytest.mark.parametrize("n_out", [80, 1])
def test_the_products_compute_the_linear_map(product, n_out):
    x, w, b = _operands(torch.float64, n_out=n_out, rows=MAX_ROWS + 52)
    for x3 in (x[:60].reshape(4, 15, 96), x[: MAX_ROWS + 52].reshape(4, -1, 96)):  # one product and several
        for bias in (b, None):
            want = F.linear(x3, w, bias)
            got = product(x3, w, bias)
            assert got.shape == want.shape == (*x3.shape[:2], n_out)
            assert float((got - want).abs().max()) <= 1e-13 * float(want.abs().max())
    assert product(x[:0], w, b).shape == (0, n_out)
    assert ROWS % TILE == 0 and MIN_ROWS % TILE == 0 and MAX_ROWS % TILE == 0 and NARROW > 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("frozen", [False, True])
def test_a_strided_input_gives_the_bits_of_a_contiguous_one(dtype, frozen):
    """A strided input could take F.linear's other paths (mm and then the bias added, another rounding; a
    batched product when the weight does not require grad): it is copied into one contiguous product first,
    like every other product here."""
    x, w, b = _operands(dtype, rows=64)
    w.requires_grad_(not frozen)
    strided = x.view(16, 4, 96).transpose(0, 1)  # [4, 16, 96], not contiguous
    assert not strided.is_contiguous()
    with torch.no_grad():
        for bias in (b, None):
            want = fixed_tile_linear(strided.contiguous(), w, bias)
            assert torch.equal(fixed_tile_linear(strided, w, bias), want)


def test_aligned_width_widens_only_for_the_rows_the_filler_would_add():
    for rows in range(1, 41):
        for width in range(1, 41):
            got = aligned_width(rows, width)
            filled = max(MIN_ROWS, -(-rows * width // TILE) * TILE)  # a product's rows with the filler
            assert got >= width
            if got > width:  # every product aligned, no more rows than the filler
                assert rows * got == filled
            else:
                assert filled % rows or filled == rows * width
    assert aligned_width(1, 5) == MIN_ROWS and aligned_width(2, 21) == 22 and aligned_width(3, 21) == 21


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_widened_pass_needs_no_filler_rows_and_keeps_the_bits(dtype, monkeypatch):
    """The no-grad log-prob pass widens a micro-batch of 1, 2 or 4 sequences to ``aligned_width`` (masked
    columns on the right): every product of the layers then runs as it is, the LM head's (the kept positions)
    alone may take filler rows; in float64 the log-probs are those of the micro-batch's own width (7
    sequences are not widened: that would add more rows than the filler)."""
    model = tiny_causal_lm("llama", dtype=dtype, seed=1)
    batch = make_batch(B=7, P=9, T=8, seed=3)
    slow = []
    plain_slow_path = row_invariant_module.fixed_tile_linear
    monkeypatch.setattr(
        row_invariant_module,
        "fixed_tile_linear",
        lambda x, w, b=None: slow.append(x.numel() // x.shape[-1]) or plain_slow_path(x, w, b),
    )
    for rows in ([0], [1, 2], [1, 2, 3, 4], list(range(7))):
        part = batch.select(rows)
        with torch.no_grad(), row_invariant(model):
            slow.clear()
            widened, _ = response_log_probs(model, part, align_within=float("inf"))
            if len(rows) < 7:
                assert len(slow) <= 1, slow  # the head's product
            own, _ = response_log_probs(model, part)
        if dtype == torch.float64:
            assert torch.equal(widened, own), rows
        else:
            assert torch.allclose(widened, own, rtol=0, atol=1e-5), rows  # the attention's rounding


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_large_micro_batch_in_pieces_gives_the_bits_of_one_forward(dtype, monkeypatch):
    """The no-grad passes run a micro-batch in forwards of ``rows_per_forward`` sequences (a multiple of 32):
    every row, float32 included, is the one forward's."""
    model = tiny_causal_lm("llama", dtype=dtype, seed=2)
    batch = make_batch(B=75, P=24, T=12, seed=4)
    assert rows_per_forward(batch.prompt_width + batch.response_width) < len(batch)
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    with torch.no_grad(), row_invariant(model):
        pieces, _ = response_log_probs(model, batch, align_within=float("inf"), with_entropy=True)
        assert len(calls) > 1
        monkeypatch.setattr(logprobs_module, "rows_per_forward", lambda width: 10**9)
        calls.clear()
        whole, _ = response_log_probs(model, batch, align_within=float("inf"), with_entropy=True)
        assert len(calls) == 1
    assert torch.equal(pieces, whole)


def test_the_context_swaps_and_restores_the_linear_layers():
    model = tiny_causal_lm("llama", dtype=torch.float64)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with pytest.raises(RuntimeError, match="no-grad"):
        with row_invariant(model):
            pass
    with torch.no_grad(), row_invariant(model):
        assert all("forward" in vars(m) for m in linears)
        with row_invariant(model):  # re-entrant: the inner block leaves them to the outer one
            pass
        assert all("forward" in vars(m) for m in linears)
    assert not any("forward" in vars(m) for m in linears)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_log_probs_and_entropy_are_identical_in_every_layout(arch):
    model = tiny_causal_lm(arch, dtype=torch.float64, seed=1)
    batch = make_batch(B=24, P=9, T=8, seed=2)
    want, want_h = compute_log_probs(model, batch, micro_batch_size=24, with_entropy=True)
    for layout in LAYOUTS:
        got, got_h = compute_log_probs(model, batch, with_entropy=True, **layout)
        assert torch.equal(got, want) and torch.equal(got_h, want_h), layout


def test_values_are_identical_in_every_layout():
    critic = value_model_from_pretrained(tiny_causal_lm("qwen2", dtype=torch.float64, seed=1), seed=4)
    batch = make_batch(B=24, P=9, T=8, seed=5)
    want = compute_values(critic, batch, micro_batch_size=24)
    for layout in LAYOUTS:
        assert torch.equal(compute_values(critic, batch, **layout), want), layout


def _rollout(model, requests, params, max_num_seqs):
    samples = HFRollout(model, eos_token_ids=[2], pad_token_id=0, max_num_seqs=max_num_seqs).generate(
        requests, params, step=0
    )
    return [(s.response_ids, s.log_probs) for s in samples]


def test_rollout_is_identical_above_the_row_floor():
    """23 sequences in one chunk (rows 20-22 past the last full tile of 4) against chunks of 1 (16 rows with
    the filler). Without the block products this differed on AVX2 (8.9e-16 on a log-prob)."""
    model = tiny_causal_lm("llama", dtype=torch.float64, seed=2)
    g = torch.Generator().manual_seed(3)
    prompts = [
        (u, torch.randint(3, 256, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist())
        for u in range(23)
    ]
    params = SamplingParams(n=1, temperature=1.0, max_response_length=4, seed=1)
    requests = requests_for(prompts, params.n)
    assert _rollout(model, requests, params, 23) == _rollout(model, requests, params, 1)
