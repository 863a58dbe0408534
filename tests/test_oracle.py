"""Hand-checkable tests of the float64 oracle objective alone (splitproof.oracle)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from splitproof.loss_config import AGG_MODES, LOSS_MODES, LossConfig
from splitproof.oracle import oracle_objective, oracle_selection, priority_hash

D = torch.float64


def cfg(**kw) -> LossConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LossConfig(**kw)


def leaf(values, dtype=D) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).requires_grad_()


def one_token(ratio: float, adv: float, **kw):
    """A single valid token with ρ = ratio; returns (loss, metrics, d loss / d log_prob)."""
    lp = leaf([[math.log(ratio)]])
    loss, metrics = oracle_objective(
        lp, torch.zeros(1, 1, dtype=D), torch.tensor([adv], dtype=D), torch.ones(1, 1, dtype=torch.bool), cfg(**kw)
    )
    loss.backward()
    return loss.item(), metrics, float(lp.grad[0, 0])


# ---------------------------------------------------------------------------------------------- vanilla


def test_vanilla_unclipped_token():
    loss, m, grad = one_token(1.1, 1.0)
    assert loss == pytest.approx(-1.1)
    assert grad == pytest.approx(-1.1)  # d(−Aρ)/dlogπ = −Aρ
    assert m["pg_clipfrac"] == 0.0 and m["pg_clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(-math.log(1.1))


def test_vanilla_clipped_token_has_no_gradient():
    loss, m, grad = one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.2)  # −A·(1 + ε_high)
    assert grad == 0.0
    assert m["pg_clipfrac"] == 1.0 and m["pg_clipfrac_lower"] == 0.0


def test_vanilla_asymmetric_clip():
    loss, m, _ = one_token(0.5, -1.0, clip_ratio_low=0.3, clip_ratio_high=0.1)
    assert loss == pytest.approx(0.7)  # max(0.5, 1 − 0.3)
    assert m["pg_clipfrac"] == 1.0


def test_vanilla_dual_clip():
    loss, m, grad = one_token(5.0, -1.0)  # L1 = 5 > L2 = 1.2; dual clip caps at −A·C = 3
    assert loss == pytest.approx(3.0)
    assert grad == 0.0
    assert m["pg_clipfrac_lower"] == 1.0 and m["pg_clipfrac"] == 0.0
    loss, m, grad = one_token(2.0, -1.0)  # below the cap: plain −Aρ
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
    assert m["pg_clipfrac_lower"] == 0.0


def test_vanilla_log_ratio_clamped_at_20():
    lp = leaf([[100.0]])
    loss, m = oracle_objective(
        lp, torch.zeros(1, 1, dtype=D), torch.tensor([-1.0], dtype=D), torch.ones(1, 1), cfg(clip_ratio_c=1e12)
    )
    assert loss.item() == pytest.approx(math.exp(20.0))
    assert m["ppo_kl"] == pytest.approx(-20.0)


# ---------------------------------------------------------------------------------------------- aggregation


def _gpg_identity_batch():
    """gpg with A = −1 makes ℓ = log_prob: seq 0 = [2], seq 1 = [1, 2, 6], seq 2 empty (T = 4)."""
    lp = torch.tensor([[2.0, 0, 0, 0], [1.0, 2.0, 6.0, 0], [0, 0, 0, 0]], dtype=D)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    return lp, mask


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", 11 / 4),
        ("token-sum", 11.0),
        ("seq-mean-token-sum", 11 / 2),  # G = 2: the empty row does not count
        ("seq-mean-token-mean", (2 / 1 + 9 / 3) / 2),
        ("seq-mean-token-sum-norm", 11 / (2 * 4)),  # S defaults to T = 4
    ],
)
def test_aggregation_normalisers(mode, expected):
    lp, mask = _gpg_identity_batch()
    loss, m = oracle_objective(lp, lp.clone(), -torch.ones(3, dtype=D), mask, cfg(loss_mode="gpg", loss_agg_mode=mode))
    assert loss.item() == pytest.approx(expected)
    assert m["pg_loss"] == pytest.approx(expected)


def test_loss_scale_factor_overrides_width():
    lp, mask = _gpg_identity_batch()
    loss, _ = oracle_objective(
        lp,
        lp.clone(),
        -torch.ones(3, dtype=D),
        mask,
        cfg(loss_mode="gpg", loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=10.0),
    )
    assert loss.item() == pytest.approx(11 / 20)


def test_rollout_weights_multiply_token_loss():
    lp, mask = _gpg_identity_batch()
    w = torch.full((3, 4), 2.0, dtype=D)
    w[1, 2] = 0.5
    loss, _ = oracle_objective(
        lp,
        lp.clone(),
        -torch.ones(3, dtype=D),
        mask,
        cfg(loss_mode="gpg", loss_agg_mode="token-sum"),
        rollout_is_weights=w,
    )
    assert loss.item() == pytest.approx(2 * 2 + 2 * 1 + 2 * 2 + 0.5 * 6)


def test_scalar_advantages_broadcast():
    torch.manual_seed(0)
    lp, old, mask = -torch.rand(3, 5, dtype=D), -torch.rand(3, 5, dtype=D), torch.rand(3, 5) > 0.3
    adv = torch.randn(3, dtype=D)
    a, _ = oracle_objective(lp, old, adv, mask, cfg())
    b, _ = oracle_objective(lp, old, adv[:, None].expand(3, 5).clone(), mask, cfg())
    assert a.item() == b.item()


# ---------------------------------------------------------------------------------------------- padding


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_non_finite_padding_never_propagates(mode):
    torch.manual_seed(1)
    B, T = 4, 6
    mask = torch.rand(B, T) > 0.3
    mask[0, 0] = True
    mask[3] = False
    old = -torch.rand(B, T, dtype=D) - 0.1
    lp_vals = old + 0.2 * torch.randn(B, T, dtype=D)
    lp_vals[~mask] = float("nan")
    old[~mask] = float("inf")
    lp = lp_vals.clone().requires_grad_()
    ent = torch.rand(B, T, dtype=D)
    ent[~mask] = float("nan")
    ent.requires_grad_()
    ref = torch.where(mask, -torch.rand(B, T, dtype=D), torch.full((B, T), float("nan"), dtype=D))
    w = torch.where(mask, torch.rand(B, T, dtype=D) + 0.5, torch.full((B, T), float("nan"), dtype=D))
    adv = torch.where(mask, torch.randn(B, T, dtype=D), torch.full((B, T), float("nan"), dtype=D))
    c = cfg(
        loss_mode=mode,
        dro_beta=0.1,
        use_kl_loss=True,
        entropy_coeff=0.01,
        kl_cov_ratio=0.2,
        clip_cov_ratio=0.2,
        clip_cov_lb=-100.0,
        clip_cov_ub=100.0,
    )
    loss, metrics = oracle_objective(lp, old, adv, mask, c, ref_log_prob=ref, rollout_is_weights=w, entropy=ent)
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(math.isfinite(v) for v in metrics.values())
    assert torch.isfinite(lp.grad).all() and torch.isfinite(ent.grad).all()
    assert (lp.grad[~mask] == 0).all() and (ent.grad[~mask] == 0).all()


def test_empty_minibatch_raises():
    with pytest.raises(ValueError, match="response_mask"):
        oracle_objective(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 3), cfg())


# ---------------------------------------------------------------------------------------------- GMPO


def _gmpo_batch():
    # seq 0: A = +1, δ = [0.1, 0.5]; seq 1: A = −1, δ = [−0.5, 0.1, 0.0]; seq 2 empty.
    lp = leaf([[0.1, 0.5, 0.0], [-0.5, 0.1, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    return lp, torch.zeros(3, 3, dtype=D), torch.tensor([1.0, -1.0, 0.0], dtype=D), mask


def test_gmpo_two_sequences_by_hand():
    lp, old, adv, mask = _gmpo_batch()
    loss, m = oracle_objective(lp, old, adv, mask, cfg(loss_mode="geo_mean"))
    # A>0 caps δ at +0.2: δ̃ = [0.1, 0.2]; A<0 floors δ at −0.2: δ̃ = [−0.2, 0.1, 0.0].
    l0 = -1.0 * math.exp((0.1 + 0.2) / 2)
    l1 = +1.0 * math.exp((-0.2 + 0.1 + 0.0) / 3)
    assert loss.item() == pytest.approx((l0 + l1) / 2)  # G = 2, the empty row does not count
    loss.backward()
    expected = torch.tensor([[l0 / 2 / 2, 0.0, 0.0], [0.0, l1 / 3 / 2, l1 / 3 / 2], [0.0, 0.0, 0.0]], dtype=D)
    assert torch.allclose(lp.grad, expected)
    assert m["pg_clipfrac"] == pytest.approx(1 / 5)  # seq 0, token 1
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 5)  # seq 1, token 0
    assert m["ppo_kl"] == pytest.approx(-(0.1 + 0.5 - 0.5 + 0.1) / 5)


def test_gmpo_ignores_token_agg_mode_and_uses_geometric_weight():
    lp, old, adv, mask = _gmpo_batch()
    base, _ = oracle_objective(lp, old, adv, mask, cfg(loss_mode="geo_mean"))
    for mode in AGG_MODES:
        other, _ = oracle_objective(lp, old, adv, mask, cfg(loss_mode="geo_mean", loss_agg_mode=mode), index=[0, 0, 1])
        assert other.item() == pytest.approx(base.item())
    w = torch.tensor([[2.0, 8.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=D)
    weighted, _ = oracle_objective(lp, old, adv, mask, cfg(loss_mode="geo_mean"), rollout_is_weights=w)
    l0 = -math.exp(0.15) * 4.0  # geometric mean of [2, 8] is 4
    l1 = math.exp(-0.1 / 3)
    assert weighted.item() == pytest.approx((l0 + l1) / 2, rel=1e-8)


# ---------------------------------------------------------------------------------------------- other losses


def test_gspo_sequence_ratio_value_and_gradient():
    lp = leaf([[0.3, -0.1, 0.0], [0.05, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0], dtype=D)
    loss, m = oracle_objective(
        lp, torch.zeros(2, 3, dtype=D), adv, mask, cfg(loss_mode="gspo", loss_agg_mode="token-sum")
    )
    s0, s1 = math.exp(0.1), math.exp(0.05)  # both inside [0.8, 1.2]
    assert loss.item() == pytest.approx((-1.0 * s0 + 2.0 * s1) / 2)  # forced seq-mean-token-mean
    loss.backward()
    expected = torch.tensor([[-s0 / 2 / 2, -s0 / 2 / 2, 0.0], [2.0 * s1 / 2, 0.0, 0.0]], dtype=D)
    assert torch.allclose(lp.grad, expected)
    assert m["pg_clipfrac"] == 0.0


def test_sapo_gate_at_ratio_one():
    loss, m, grad = one_token(1.0, 2.0, loss_mode="sapo")
    assert loss == pytest.approx(-2.0 * 2.0 / 1.0)  # f(1) = 2/τ_pos
    assert grad == pytest.approx(-2.0)  # f'(1) = 1
    loss, _, _ = one_token(1.0, -1.0, loss_mode="sapo")
    assert loss == pytest.approx(2.0 / 1.05)


def test_cispo_and_dro_and_gpg_gradients():
    loss, m, grad = one_token(1.5, 1.0, loss_mode="cispo")  # sg(clip(1.5)) = 1.2
    assert loss == pytest.approx(-1.2 * math.log(1.5)) and grad == pytest.approx(-1.2)
    assert m["pg_clipfrac"] == 1.0
    loss, _, grad = one_token(math.exp(0.5), 1.0, loss_mode="dro", dro_beta=0.4)
    assert loss == pytest.approx(-(0.5 - 0.5 * 0.4 * 0.25)) and grad == pytest.approx(-1.0 + 0.4 * 0.5)
    loss, _, grad = one_token(math.exp(-0.7), 3.0, loss_mode="gpg")
    assert loss == pytest.approx(2.1) and grad == pytest.approx(-3.0)


def test_dppo_tv_trust_region():
    # p_old = 0.5. A>0: p = 0.6 is inside (0.1 ≤ 0.2), p = 0.8 is outside (0.3 > 0.2).
    old = torch.full((1, 2), math.log(0.5), dtype=D)
    lp = leaf([[math.log(0.6), math.log(0.8)]])
    loss, m = oracle_objective(
        lp, old, torch.tensor([1.0], dtype=D), torch.ones(1, 2), cfg(loss_mode="dppo_tv", loss_agg_mode="token-sum")
    )
    assert loss.item() == pytest.approx(-1.2 * math.log(0.6))  # r̄ = 1.2 on the valid token, 0 elsewhere
    loss.backward()
    assert lp.grad[0, 0] == pytest.approx(-1.2) and lp.grad[0, 1] == 0.0
    assert m["pg_clipfrac"] == pytest.approx(0.5)


def test_kl_estimators_and_straight_through():
    lp = leaf([[-1.0]])
    ref = torch.tensor([[-1.5]], dtype=D)
    x = -0.5  # ref − log_prob
    expected = {"k1": 0.5, "abs": 0.5, "k2": 0.125, "k3": math.exp(x) - x - 1}
    for kind, value in expected.items():
        c = cfg(loss_mode="gpg", use_kl_loss=True, kl_loss_type=kind, kl_loss_coef=1.0)
        _, m = oracle_objective(lp, lp.detach(), torch.zeros(1, dtype=D), torch.ones(1, 1), c, ref_log_prob=ref)
        assert m["kl_loss"] == pytest.approx(value)
        plus = cfg(loss_mode="gpg", use_kl_loss=True, kl_loss_type=kind + "+", kl_loss_coef=1.0)
        lp.grad = None
        loss, m = oracle_objective(lp, lp.detach(), torch.zeros(1, dtype=D), torch.ones(1, 1), plus, ref_log_prob=ref)
        loss.backward()
        assert m["kl_loss"] == pytest.approx(value)
        assert float(lp.grad) == pytest.approx(0.5)  # gradient of ½(logπ − ref)² is logπ − ref


def test_kl_loss_requires_ref():
    with pytest.raises(ValueError, match="ref_log_prob"):
        oracle_objective(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), cfg(use_kl_loss=True))


def test_total_combines_entropy_and_kl_and_metric_keys():
    lp, mask = _gpg_identity_batch()
    ent = torch.tensor([[1.0, 9, 9, 9], [2.0, 3.0, 4.0, 9], [9, 9, 9, 9]], dtype=D)
    ref = lp - 1.0  # k1 = 1 on every token
    c = cfg(
        loss_mode="gpg",
        loss_agg_mode="seq-mean-token-mean",
        entropy_coeff=0.1,
        use_kl_loss=True,
        kl_loss_type="k1",
        kl_loss_coef=0.5,
    )
    loss, m = oracle_objective(lp, lp.clone(), -torch.ones(3, dtype=D), mask, c, ref_log_prob=ref, entropy=ent)
    pg = (2.0 + 3.0) / 2
    ent_loss = (1.0 + 3.0) / 2
    assert loss.item() == pytest.approx(pg - 0.1 * ent_loss + 0.5 * 1.0)
    assert m["entropy"] == pytest.approx(10.0 / 4)  # token mean, not the agg mode
    assert m["entropy_loss"] == pytest.approx(ent_loss) and m["kl_loss"] == pytest.approx(1.0)
    assert set(m) == {
        "loss",
        "pg_loss",
        "pg_clipfrac",
        "pg_clipfrac_lower",
        "ppo_kl",
        "entropy",
        "entropy_loss",
        "kl_loss",
    }
    _, m = oracle_objective(lp, lp.clone(), -torch.ones(3, dtype=D), mask, cfg(loss_mode="kl_cov"))
    assert set(m) == {"loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "cov_selected"}


# ---------------------------------------------------------------------------------------------- hash


def test_priority_hash_pinned_and_deterministic():
    assert priority_hash(0, 0, 0, 0) == 0  # mix(0) = 0
    assert priority_hash(42, 0, 0, 0) == 881108595
    assert priority_hash(42, 3, 7, 11) == 3621355454
    assert priority_hash(42, 3, 7, 11) == priority_hash(42, 3, 7, 11)
    assert priority_hash(-1, 0, 0, 0) == priority_hash(2**32 - 1, 0, 0, 0)  # arguments taken mod 2^32


def test_priority_hash_spread():
    values = [priority_hash(42, 5, i, t) for i in range(32) for t in range(32)]
    assert all(0 <= v < 2**32 for v in values)
    assert len(set(values)) == len(values)
    assert abs(sum(values) / len(values) / 2**32 - 0.5) < 0.05
    high_bit = sum(v >> 31 for v in values) / len(values)
    assert 0.4 < high_bit < 0.6
    other_step = [priority_hash(42, 6, i, t) for i in range(32) for t in range(32)]
    assert sum(a < b for a, b in zip(values, other_step)) / len(values) == pytest.approx(0.5, abs=0.06)


# ---------------------------------------------------------------------------------------------- Cov selection


def _tied_cov_batch():
    # Two tokens (A=1, logπ=−1), two (A=−1, logπ=−3): Ā = 0, L̄ = −2, c = 1 on every token.
    lp = torch.tensor([[-1.0], [-1.0], [-3.0], [-3.0]], dtype=D)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=D)
    return lp, adv, torch.ones(4, 1, dtype=torch.bool), torch.tensor([7, 3, 5, 9])


def test_kl_cov_ties_broken_by_canonical_key():
    lp, adv, mask, ids = _tied_cov_batch()
    sel = oracle_selection(lp, lp, adv, mask, cfg(loss_mode="kl_cov", kl_cov_ratio=0.25), seq_ids=ids)
    assert sel[:, 0].tolist() == [False, True, False, False]  # smallest key: sequence id 3
    sel = oracle_selection(lp, lp, adv, mask, cfg(loss_mode="kl_cov", kl_cov_ratio=0.5), seq_ids=ids)
    assert sel[:, 0].tolist() == [False, True, True, False]  # ids 3 and 5
    sel = oracle_selection(lp, lp, adv, mask, cfg(loss_mode="kl_cov", kl_cov_ratio=0.01))
    assert sel[:, 0].tolist() == [True, False, False, False]  # k = max(1, ⌊0.04⌋) = 1; default keys = rows


def test_kl_cov_picks_top_covariance_and_penalises_it():
    # One sequence, tokens (A, logπ): c = (A − Ā)(logπ − L̄) is largest for the last token.
    lp = leaf([[-1.0, -2.0, -0.5, -4.0]])
    old = torch.tensor([[-1.2, -2.0, -0.5, -3.0]], dtype=D)
    adv = torch.tensor([[0.0, 0.0, 0.0, -2.0]], dtype=D)
    c = cfg(loss_mode="kl_cov", kl_cov_ratio=0.25, loss_agg_mode="token-sum")
    assert oracle_selection(lp, old, adv, torch.ones(1, 4), c).tolist() == [[False, False, False, True]]
    loss, m = oracle_objective(lp, old, adv, torch.ones(1, 4), c)
    assert loss.item() == pytest.approx(2.0 * math.exp(-1.0) + 0.1 * 1.0)
    assert m["cov_selected"] == 1.0
    assert m["ppo_kl"] == pytest.approx(-(0.2 - 1.0) / 4)  # k1 mean, not mean |δ|


def test_kl_cov_selection_ignores_padding_and_empty_rows():
    lp, adv, mask, ids = _tied_cov_batch()
    lp2 = torch.cat([lp, torch.full((4, 1), float("nan"), dtype=D)], dim=1)
    mask2 = torch.cat([mask, torch.zeros(4, 1, dtype=torch.bool)], dim=1)
    sel = oracle_selection(lp2, lp2, adv, mask2, cfg(loss_mode="kl_cov", kl_cov_ratio=0.25), seq_ids=ids)
    assert sel.tolist() == [[False, False], [True, False], [False, False], [False, False]]


def test_clip_cov_candidates_and_hash_order():
    # c = 1 on every token (see _tied_cov_batch); a tiny ratio keeps the quota at 1.
    lp, adv, mask, ids = _tied_cov_batch()
    c = cfg(loss_mode="clip_cov", clip_cov_lb=0.5, clip_cov_ub=2.0, seed=123)
    sel = oracle_selection(lp, lp, adv, mask, c, seq_ids=ids, step=4)
    winner = min(range(4), key=lambda r: (priority_hash(123, 4, int(ids[r]), 0), int(ids[r])))
    assert sel[:, 0].tolist() == [r == winner for r in range(4)]
    # strict bounds: c = 1 is not inside (1, 5) -> no candidate, nothing selected
    sel = oracle_selection(lp, lp, adv, mask, cfg(loss_mode="clip_cov", clip_cov_lb=1.0), seq_ids=ids)
    assert not sel.any()
    # a token already clipped by PPO is not a candidate: push the winner's ratio outside the clip range
    old = lp.clone()
    old[winner, 0] -= 1.0 if adv[winner] > 0 else -1.0
    sel = oracle_selection(lp, old, adv, mask, c, seq_ids=ids, step=4)
    assert sel.sum() == 1 and not sel[winner, 0]


def test_clip_cov_selected_token_loses_loss_and_gradient():
    lp0, adv, mask, ids = _tied_cov_batch()
    lp = lp0.clone().requires_grad_()
    old = lp0 - 0.05  # ρ = e^0.05, inside the clip range
    c = cfg(loss_mode="clip_cov", clip_cov_lb=0.5, clip_cov_ub=2.0, seed=123, loss_agg_mode="token-sum")
    sel = oracle_selection(lp, old, adv, mask, c, seq_ids=ids, step=4)
    loss, m = oracle_objective(lp, old, adv, mask, c, seq_ids=ids, step=4)
    loss.backward()
    rho = math.exp(0.05)
    kept = [r for r in range(4) if not sel[r, 0]]
    assert loss.item() == pytest.approx(sum(-float(adv[r]) * rho for r in kept))
    assert lp.grad[sel].tolist() == [0.0]
    assert m["cov_selected"] == 1.0 and m["pg_clipfrac"] == 0.0


def test_selection_only_for_cov_modes():
    with pytest.raises(ValueError, match="loss_mode"):
        oracle_selection(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), cfg())
