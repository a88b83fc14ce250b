"""Unit tests for the PPO / value / aggregation / preference / SFT losses.

Expected values are computed by hand (arithmetic in the comments).
"""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.aggregation import AGGREGATION_MODES, aggregate, token_mean
from alignment.algorithms.policy_loss import (
    clipped_surrogate_loss,
    entropy_bonus,
    ppo_policy_loss,
)
from alignment.algorithms.preference_loss import (
    bradley_terry_loss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    simpo_loss,
)
from alignment.algorithms.sft_loss import sft_loss
from alignment.algorithms.value_loss import value_loss

D = torch.float64
LOG2 = math.log(2.0)  # 0.6931471805599453
SP_M1 = math.log1p(math.exp(-1.0))  # -logsigmoid(1) = log(1 + e^-1) = 0.31326168751822286


def t(x):
    return torch.tensor(x, dtype=D)


# --------------------------------------------------------------------------- ppo_policy_loss


def _ppo_one(ratio, adv, low=0.2, high=0.28, c=None):
    """Single token with old_logprob -1 and logprob -1 + log(ratio)."""
    old = t([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_(True)
    loss, clipped = ppo_policy_loss(lp, old, t([adv]), low, high, c)
    loss.sum().backward()
    return loss.item(), lp.grad.item(), bool(clipped.item())


def test_ppo_symmetric_matches_the_ppo_formula_written_out():
    # clipped_surrogate_loss delegates to ppo_policy_loss, so compare both with PPO's
    # eq. 7 written out here: loss = max(-r*A, -clip(r, 1-eps, 1+eps)*A).
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(5, 7, generator=g, dtype=D) * 0.5
    old = lp + torch.randn(5, 7, generator=g, dtype=D) * 0.4
    for adv in (torch.randn(5, generator=g, dtype=D), torch.randn(5, 7, generator=g, dtype=D)):
        a = adv if adv.dim() == 2 else adv[:, None]
        r = torch.exp(lp - old)
        for eps in (0.1, 0.2, 0.3):
            want = torch.maximum(-r * a, -r.clamp(1 - eps, 1 + eps) * a)
            for loss, _ in (ppo_policy_loss(lp, old, adv, eps, eps, None), clipped_surrogate_loss(lp, old, adv, eps)):
                assert torch.allclose(loss, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("c", [None, 3.0])
@pytest.mark.parametrize("adv", [2.0, -3.0])
def test_ppo_ratio_one_is_vanilla_policy_gradient(adv, c):
    # ratio 1: loss = -A; d(-exp(lp - old) * A)/dlp = -ratio * A = -A (REINFORCE).
    # dual clip (c=3, A=-3): -c*A = 9 > 3 -> inactive.
    loss, grad, clipped = _ppo_one(1.0, adv, c=c)
    assert loss == pytest.approx(-adv)
    assert grad == pytest.approx(-adv)
    assert not clipped


def test_ppo_clip_higher_asymmetric():
    # ratio 1.25, A=1, low .2, high .28: clamp(1.25, .8, 1.28) = 1.25 -> not clipped
    # (symmetric eps .2 would clip at 1.2): loss -1.25, grad -1.25
    loss, grad, clipped = _ppo_one(1.25, 1.0)
    assert (loss, grad, clipped) == (pytest.approx(-1.25), pytest.approx(-1.25), False)
    # ratio 1.5, A=1: max(-1.5, -1.28) = -1.28, clipped, grad 0
    loss, grad, clipped = _ppo_one(1.5, 1.0)
    assert (loss, grad, clipped) == (pytest.approx(-1.28), 0.0, True)
    # ratio .75, A=-1: lower bound 1-.2 = .8: max(.75, .8) = .8, clipped, grad 0
    loss, grad, clipped = _ppo_one(0.75, -1.0)
    assert (loss, grad, clipped) == (pytest.approx(0.8), 0.0, True)


def test_ppo_dual_clip_by_hand():
    # ratio 5, A=-1, low .2, high .28, c=3:
    #   unclipped -5*-1 = 5; clipped -clamp(5,.8,1.28)*-1 = 1.28; max = 5
    #   dual: min(5, -3*-1 = 3) = 3 -> constant branch, grad 0, clipped
    loss, grad, clipped = _ppo_one(5.0, -1.0, c=3.0)
    assert (loss, grad, clipped) == (pytest.approx(3.0), 0.0, True)
    # without dual clip: loss 5, grad -ratio*A = 5
    loss, grad, clipped = _ppo_one(5.0, -1.0, c=None)
    assert (loss, grad, clipped) == (pytest.approx(5.0), pytest.approx(5.0), False)
    # ratio 2, A=-1, c=3: max(2, 1.28) = 2 < 3 -> dual inactive, grad 2
    loss, grad, clipped = _ppo_one(2.0, -1.0, c=3.0)
    assert (loss, grad, clipped) == (pytest.approx(2.0), pytest.approx(2.0), False)
    # A>0 never dual-clipped: ratio 5, A=1 -> max(-5, -1.28) = -1.28 (PPO clip)
    loss, grad, clipped = _ppo_one(5.0, 1.0, c=3.0)
    assert (loss, grad, clipped) == (pytest.approx(-1.28), 0.0, True)


def test_ppo_dual_clip_bounds_negative_advantage_loss():
    g = torch.Generator().manual_seed(2)
    lp = torch.randn(4, 6, generator=g, dtype=D) * 2
    old = torch.zeros(4, 6, dtype=D)
    adv = torch.randn(4, 6, generator=g, dtype=D)
    loss, _ = ppo_policy_loss(lp, old, adv, 0.2, 0.28, 3.0)
    neg = adv < 0
    assert torch.all(loss[neg] <= (-3.0 * adv)[neg] + 1e-12)
    plain, _ = ppo_policy_loss(lp, old, adv, 0.2, 0.28)
    assert torch.equal(loss[~neg], plain[~neg])
    assert torch.all(loss <= plain)


def test_ppo_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        ppo_policy_loss(z, z, torch.zeros(2), 0.0, 0.2)
    with pytest.raises(ValueError, match="clip_ratio_high"):
        ppo_policy_loss(z, z, torch.zeros(2), 0.2, -0.1)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(z, z, torch.zeros(2), 0.2, 0.2, 1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(z, z, torch.zeros(3), 0.2, 0.2)
    with pytest.raises(ValueError, match="logprobs"):
        ppo_policy_loss(z, torch.zeros(2, 4), torch.zeros(2), 0.2, 0.2)


def test_entropy_bonus():
    # -.01 * [1, 2.5] = [-.01, -.025]
    torch.testing.assert_close(entropy_bonus(t([[1.0, 2.5]]), 0.01), t([[-0.01, -0.025]]))
    with pytest.raises(ValueError, match="coef"):
        entropy_bonus(t([[1.0]]), -0.1)
    with pytest.raises(ValueError, match="entropy"):
        entropy_bonus(t([1.0]), 0.1)


# --------------------------------------------------------------------------- value_loss


def test_value_loss_by_hand():
    v = t([[1.5, 1.5, 0.9]]).requires_grad_(True)
    old = t([[1.0, 1.0, 1.0]])
    ret = t([[1.0, 2.0, 0.0]])
    loss = value_loss(v, old, ret, 0.2)
    # tok0: v-R = .5 -> .25; v_clip = 1 + clamp(.5,-.2,.2) = 1.2 -> (1.2-1)^2 = .04
    #       .5*max(.25,.04) = .125; unclipped branch -> grad v-R = .5
    # tok1: (1.5-2)^2 = .25; (1.2-2)^2 = .64 -> .5*.64 = .32; clipped (const) -> grad 0
    # tok2: v-old = -.1 inside -> v_clip = .9; both .81 -> .405; grad v-R = .9
    torch.testing.assert_close(loss, t([[0.125, 0.32, 0.405]]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, t([[0.5, 0.0, 0.9]]))


def test_value_loss_unclipped():
    v = t([[1.5, 1.5, 0.9]]).requires_grad_(True)
    old = t([[1.0, 1.0, 1.0]])
    ret = t([[1.0, 2.0, 0.0]])
    loss = value_loss(v, old, ret, None)
    # .5*(v-R)^2 = [.5*.25, .5*.25, .5*.81] = [.125, .125, .405]; grad v-R
    torch.testing.assert_close(loss, t([[0.125, 0.125, 0.405]]))
    loss.sum().backward()
    torch.testing.assert_close(v.grad, t([[0.5, -0.5, 0.9]]))


def test_value_loss_clipped_ge_unclipped_and_errors():
    g = torch.Generator().manual_seed(3)
    v, old, ret = (torch.randn(3, 4, generator=g, dtype=D) for _ in range(3))
    assert torch.all(value_loss(v, old, ret, 0.1) >= value_loss(v, old, ret, None))
    # huge clip range == no clipping
    torch.testing.assert_close(value_loss(v, old, ret, 1e9), value_loss(v, old, ret, None))
    with pytest.raises(ValueError, match="cliprange_value"):
        value_loss(v, old, ret, 0.0)
    with pytest.raises(ValueError, match="returns"):
        value_loss(v, old, ret[:, :2], 0.2)


# --------------------------------------------------------------------------- aggregate


def test_aggregate_modes_by_hand():
    v = t([[1, 2, 3], [4, 5, 6]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # token-mean, N = 3 valid tokens: (1+2+4)/3 = 7/3
    assert aggregate(v, m, "token-mean", 3).item() == pytest.approx(7 / 3)
    assert aggregate(v, m, "token-mean", 3).item() == pytest.approx(token_mean(v, m, 3).item())
    # seq-mean-token-sum, N = 2 seqs: row sums 3, 4 -> 7/2
    assert aggregate(v, m.bool(), "seq-mean-token-sum", 2).item() == pytest.approx(3.5)
    # seq-mean-token-mean, N = 2: row means 1.5, 4 -> 5.5/2 = 2.75
    assert aggregate(v, m, "seq-mean-token-mean", torch.tensor(2.0)).item() == pytest.approx(2.75)
    # seq-mean-token-sum-norm, N = 2 seqs * max_len 3 = 6: 7/6
    assert aggregate(v, m, "seq-mean-token-sum-norm", 6).item() == pytest.approx(7 / 6)


def test_aggregate_empty_row_no_nan():
    # row 1 has no valid tokens: contributes 0 to seq-mean-token-mean
    # row means [1.5, 0] -> / N=1 -> 1.5
    v = t([[1, 2, 3], [4, 5, 6]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    assert aggregate(v, m, "seq-mean-token-mean", 1).item() == pytest.approx(1.5)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_microbatch_invariance(mode):
    g = torch.Generator().manual_seed(4)
    B, T = 6, 5
    v0 = torch.randn(B, T, generator=g, dtype=D)
    m = (torch.rand(B, T, generator=g) > 0.4).long()
    m[:, 0] = 1  # every row has a valid token
    norm = {
        "token-mean": float(m.sum()),
        "seq-mean-token-sum": float(B),
        "seq-mean-token-mean": float(B),
        "seq-mean-token-sum-norm": float(B * T),
    }[mode]
    v_full = v0.clone().requires_grad_(True)
    full = aggregate(v_full, m, mode, norm)
    full.backward()
    v_mb = v0.clone().requires_grad_(True)
    total = 0.0
    for sl in (slice(0, 1), slice(1, 4), slice(4, B)):
        part = aggregate(v_mb[sl], m[sl], mode, norm)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(v_mb.grad, v_full.grad, rtol=0, atol=1e-15)


def test_aggregate_errors():
    v = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"token-mean.*seq-mean-token-sum.*seq-mean-token-mean"):
        aggregate(v, v, "seq-mean", 1)
    with pytest.raises(ValueError, match="global_normalizer"):
        aggregate(v, v, "token-mean", 0)
    with pytest.raises(ValueError, match="global_normalizer"):
        aggregate(v, v, "token-mean", float("nan"))
    with pytest.raises(ValueError, match="mask"):
        aggregate(v, torch.zeros(2, 4), "token-mean", 1)


# --------------------------------------------------------------------------- DPO


def test_dpo_sigmoid_by_hand():
    pc = t([-1.0]).requires_grad_(True)
    pr, rc, rr = t([-3.0]), t([-2.0]), t([-2.0])
    # h = (-1 - -2) - (-3 - -2) = 1 - (-1) = 2; beta*h = .5*2 = 1
    # loss = -logsigmoid(1) = log(1 + e^-1) = 0.31326168751822286
    loss, cr, rj = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert loss.item() == pytest.approx(SP_M1)
    # rewards .5*(-1+2) = .5, .5*(-3+2) = -.5
    assert cr.item() == pytest.approx(0.5) and rj.item() == pytest.approx(-0.5)
    assert not cr.requires_grad
    # dloss/dpc = -beta * sigmoid(-beta*h) = -.5 * sigmoid(-1) = -.5*0.2689414213699951
    loss.sum().backward()
    assert pc.grad.item() == pytest.approx(-0.5 * 0.2689414213699951)
    # cDPO, eps=.1: .9*log(1+e^-1) + .1*log(1+e^1); log(1+e) = 1 + log(1+e^-1)
    #   = .9*a + .1*(1+a) = a + .1 = 0.41326168751822286
    loss, _, _ = dpo_loss(pc, pr, rc, rr, beta=0.5, label_smoothing=0.1)
    assert loss.item() == pytest.approx(SP_M1 + 0.1)


def test_dpo_ipo_and_hinge_by_hand():
    pc, pr, rc, rr = t([-1.0, -1.0]), t([-3.0, -3.0]), t([-2.0, -2.0]), t([-2.0, -2.0])
    # h = 2 for both rows.
    # ipo beta .5: (2 - 1/(2*.5))^2 = (2-1)^2 = 1;  beta .25: (2 - 2)^2 = 0
    assert dpo_loss(pc, pr, rc, rr, 0.5, loss_type="ipo")[0].tolist() == pytest.approx([1, 1])
    assert dpo_loss(pc, pr, rc, rr, 0.25, loss_type="ipo")[0].tolist() == pytest.approx([0, 0])
    # hinge beta .5: relu(1 - 1) = 0;  beta .25: relu(1 - .5) = .5
    assert dpo_loss(pc, pr, rc, rr, 0.5, loss_type="hinge")[0].tolist() == pytest.approx([0, 0])
    assert dpo_loss(pc, pr, rc, rr, 0.25, loss_type="hinge")[0].tolist() == pytest.approx(
        [0.5, 0.5]
    )


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_dpo_policy_equals_reference_is_log2(ls):
    # h = 0 -> -(1-ls)*log(1/2) - ls*log(1/2) = log 2
    g = torch.Generator().manual_seed(5)
    c, r = torch.randn(8, generator=g, dtype=D) * 10, torch.randn(8, generator=g, dtype=D) * 10
    loss, cr, rj = dpo_loss(c, r, c.clone(), r.clone(), beta=0.1, label_smoothing=ls)
    torch.testing.assert_close(loss, torch.full((8,), LOG2, dtype=D))
    assert torch.all(cr == 0) and torch.all(rj == 0)


def test_dpo_errors():
    x = t([0.0, 0.0])
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match=r"loss_type.*sigmoid.*ipo.*hinge"):
        dpo_loss(x, x, x, x, beta=0.1, loss_type="robust_nope")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.1, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="ref_rejected"):
        dpo_loss(x, x, x, t([0.0]), beta=0.1)


# --------------------------------------------------------------------------- KTO


def test_kto_by_hand():
    # logratio = -1 - -2 = 1; z0 = .5; beta = 2
    # desirable:   1 - sigmoid(2*(1-.5)) = 1 - sigmoid(1) = sigmoid(-1) = 0.2689414213699951
    # undesirable: w_u*(1 - sigmoid(2*(.5-1))) = 2*sigmoid(1) = 2*0.7310585786300049
    #            = 1.4621171572600098
    pol, ref = t([-1.0, -1.0]), t([-2.0, -2.0])
    des = torch.tensor([True, False])
    loss, rew = kto_loss(pol, ref, des, 0.5, beta=2.0, undesirable_weight=2.0)
    torch.testing.assert_close(loss, t([0.2689414213699951, 1.4621171572600098]))
    # rewards = beta * logratio = 2
    torch.testing.assert_close(rew, t([2.0, 2.0]))
    # tensor reference point, weights: desirable_weight .5 -> .5*0.26894 = 0.13447071068499755
    loss, _ = kto_loss(pol, ref, des, torch.tensor(0.5, dtype=D), 2.0, desirable_weight=0.5)
    assert loss[0].item() == pytest.approx(0.13447071068499755)
    assert loss[1].item() == pytest.approx(0.7310585786300049)


def test_kto_errors():
    x = t([0.0])
    b = torch.tensor([True])
    with pytest.raises(ValueError, match="beta"):
        kto_loss(x, x, b, 0.0, beta=0.0)
    with pytest.raises(ValueError, match="kl_ref_point"):
        kto_loss(x, x, b, -0.1, beta=0.1)
    with pytest.raises(ValueError, match="undesirable_weight"):
        kto_loss(x, x, b, 0.0, beta=0.1, undesirable_weight=-1.0)
    with pytest.raises(ValueError, match="is_desirable"):
        kto_loss(x, x, torch.tensor([1]), 0.0, beta=0.1)


# --------------------------------------------------------------------------- SimPO


def test_simpo_by_hand():
    # beta 2, gamma 1: 2*(-.5 - -1.5) - 1 = 2 - 1 = 1 -> -logsigmoid(1) = 0.31326...
    # gamma 2: 2 - 2 = 0 -> log 2
    c, r = t([-0.5]), t([-1.5])
    loss, cr, rj = simpo_loss(c, r, beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(SP_M1)
    assert (cr.item(), rj.item()) == (pytest.approx(-1.0), pytest.approx(-3.0))
    assert simpo_loss(c, r, 2.0, 2.0)[0].item() == pytest.approx(LOG2)
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(c, r, 2.0, -1.0)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(c, r, 0.0, 1.0)


# --------------------------------------------------------------------------- ORPO


def test_orpo_by_hand():
    # chosen p = .5 -> odds 1 -> log odds 0; rejected p = .2 -> odds .2/.8 = .25
    #   -> log odds -log 4; ratio = log 4; logsigmoid(log 4) = log(4/5) = -0.2231435513142097
    # loss = .7 - .1*(-0.22314...) = 0.72231435513142097
    c = t([math.log(0.5)])
    r = t([math.log(0.2)])
    loss, lor = orpo_loss(c, r, t([0.7]), lam=0.1)
    assert lor.item() == pytest.approx(math.log(4.0))
    assert loss.item() == pytest.approx(0.7 + 0.1 * 0.2231435513142097)
    # lam = 0 -> pure SFT
    assert orpo_loss(c, r, t([0.7]), lam=0.0)[0].item() == pytest.approx(0.7)


def test_orpo_log1mexp_numerics():
    # avg = -1e-12: 1 - e^x = 1e-12 (to ~5e-25) -> log odds = -1e-12 - log(1e-12)
    #   = 27.631021115928547 - 1e-12; rejected p = .5 has log odds 0.
    # naive log1p(-exp(-1e-12)) is off by ~1e-4 in float64 (cancellation).
    c = t([-1e-12, -50.0])
    r = t([math.log(0.5), math.log(0.5)])
    _, lor = orpo_loss(c, r, t([0.0, 0.0]), lam=1.0)
    assert lor[0].item() == pytest.approx(27.631021115928547 - 1e-12, rel=1e-13, abs=0)
    # avg = -50: log(1 - e^-50) ~ -e^-50 ~ -1.9e-22 -> log odds ~ -50
    assert lor[1].item() == pytest.approx(-50.0, rel=1e-15)
    naive = -1e-12 - math.log1p(-math.exp(-1e-12))
    assert abs(naive - 27.631021115928547) > 1e-6  # shows why log1mexp is needed
    # avg exactly 0 (float32) and tiny: finite loss and finite gradients
    x = torch.tensor([0.0, -1e-30, -100.0], requires_grad=True)
    y = torch.full((3,), math.log(0.5))
    loss, lor = orpo_loss(x, y, torch.zeros(3), lam=1.0)
    assert torch.isfinite(loss).all() and torch.isfinite(lor).all()
    loss.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_orpo_errors():
    with pytest.raises(ValueError, match="chosen_avg_logps"):
        orpo_loss(t([0.1]), t([-1.0]), t([0.0]), 0.1)
    with pytest.raises(ValueError, match="lam"):
        orpo_loss(t([-1.0]), t([-1.0]), t([0.0]), -0.1)
    with pytest.raises(ValueError, match="nll_chosen"):
        orpo_loss(t([-1.0]), t([-1.0]), t([0.0, 0.0]), 0.1)


# --------------------------------------------------------------------------- Bradley-Terry


def test_bradley_terry_by_hand():
    rc, rr = t([2.0, 0.0, 1.0]), t([1.0, 0.0, 3.0])
    # diffs 1, 0, -2 -> log(1+e^-1) = 0.31326..., log 2, log(1+e^2) = 2.1269280110429727
    loss, acc = bradley_terry_loss(rc, rr)
    torch.testing.assert_close(loss, t([SP_M1, LOG2, 2.1269280110429727]))
    # only the first pair has r_c > r_r strictly (tie counts wrong): 1/3
    assert acc.item() == pytest.approx(1 / 3)
    # margin [.5,0,0]: first diff .5 -> log(1+e^-.5) = 0.4740769841801067
    # centering .01*(r_c+r_r)^2 = .01*[9, 0, 16] = [.09, 0, .16]
    loss, acc = bradley_terry_loss(rc, rr, margin=t([0.5, 0.0, 0.0]), center_coef=0.01)
    torch.testing.assert_close(
        loss, t([0.4740769841801067 + 0.09, LOG2, 2.1269280110429727 + 0.16])
    )
    assert acc.item() == pytest.approx(1 / 3)


def test_bradley_terry_errors():
    with pytest.raises(ValueError, match="center_coef"):
        bradley_terry_loss(t([1.0]), t([0.0]), center_coef=-1.0)
    with pytest.raises(ValueError, match="margin"):
        bradley_terry_loss(t([1.0]), t([0.0]), margin=t([0.0, 1.0]))


# --------------------------------------------------------------------------- SFT


def test_sft_loss_by_hand():
    lp = t([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]]).requires_grad_(True)
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])  # prompt tokens masked out
    # -(-2 - 3 - 6)/6 = 11/6 (global count 6 passed in, local valid count is 3)
    loss = sft_loss(lp, mask, 6)
    assert loss.item() == pytest.approx(11 / 6)
    loss.backward()
    # d/dlp = -mask / 6
    torch.testing.assert_close(lp.grad, -mask.to(D) / 6)
    with pytest.raises(ValueError, match="global_token_count"):
        sft_loss(lp, mask, 0)


def test_global_normalizer_per_mode():
    from alignment.algorithms.aggregation import global_normalizer

    # 37 valid tokens in 8 sequences, generation budget 16 tokens
    assert global_normalizer("token-mean", 37, 8, 16) == 37.0
    assert global_normalizer("seq-mean-token-sum", 37, 8, 16) == 8.0
    assert global_normalizer("seq-mean-token-mean", 37, 8, 16) == 8.0
    assert global_normalizer("seq-mean-token-sum-norm", 37, 8, 16) == 128.0  # 8 x 16 (Dr.GRPO)
    assert global_normalizer("token-mean", 0, 8, 16) == 1.0  # never divides by zero
    with pytest.raises(ValueError, match="loss_agg_mode='mean': valid modes are token-mean"):
        global_normalizer("mean", 1, 1, 1)


def test_kto_objective_is_the_mean_over_examples_by_hand():
    """DPOObjective(kto) on 2 pairs: the loss is TRL's mean over the 4 examples (chosen
    desirable, rejected undesirable) at the reference point ``prepare`` set (here by hand)."""
    from alignment.trainers.dpo import DPOObjective

    # rows [chosen_0, rejected_0, chosen_1, rejected_1]; one response token each (logprob at t=1)
    lp = torch.tensor([[0.0, -1.0], [0.0, -3.0], [0.0, -2.0], [0.0, -2.5]])
    ref = torch.tensor([-2.0, -2.0, -2.0, -2.0])
    mb = {"loss_mask": torch.tensor([[0.0, 1.0]] * 4), "ref_logps": ref}
    # log-ratios 1, -1, 0, -0.5; z0 = 0.5, beta = 0.5
    # desirable 1 - sigmoid(0.5 * (r - z0)), undesirable 1 - sigmoid(0.5 * (z0 - r))
    s = torch.sigmoid
    per = [1 - s(torch.tensor(0.25)), 1 - s(torch.tensor(0.75)), 1 - s(torch.tensor(-0.25)), 1 - s(torch.tensor(0.5))]
    obj = DPOObjective(vocab_size=8, beta=0.5, loss_type="kto")
    obj.kl_ref_point = 0.5
    loss, m = obj.loss(mb, {"logprobs": lp}, normalizer=(2.0, 2.0))
    assert loss.item() == pytest.approx(sum(float(x) for x in per) / 4)
    assert m["loss_sum"].item() == pytest.approx(sum(float(x) for x in per) / 2)  # per pair: the mean of two
    assert DPOObjective.metrics({k: float(v) for k, v in m.items()})["kl"] == 0.5


def test_kto_mismatched_rows_shift_by_one_pair():
    """KTO's KL rows: each prompt with the response of the same side of the previous pair (cyclic),
    cut to the longest input row; fewer than 2 examples are refused."""
    from alignment.trainers.kto import mismatched_rows

    rows = [([1, 2, 10], 2), ([1, 2, 11, 12], 2), ([3, 20, 21, 22], 1), ([3, 30], 1), ([4, 5, 6, 40], 3),
            ([4, 5, 6, 50], 3)]
    assert mismatched_rows(rows) == [([1, 2, 40], 2), ([1, 2, 50], 2),         # pair 0 <- pair 2's responses
                                     ([3, 10], 1), ([3, 11, 12], 1),           # pair 1 <- pair 0's
                                     ([4, 5, 6, 20], 3), ([4, 5, 6, 30], 3)]   # pair 2 <- pair 1's, cut to 4 tokens
    assert mismatched_rows(rows, max_length=3)[4] == ([4, 5, 6, 20], 3)  # at least one response token stays
    assert mismatched_rows(rows, rows_per_example=1)[1] == ([1, 2, 10], 2)  # unpaired: TRL's shift by one
    with pytest.raises(ValueError, match="needs at least 2 examples per data-parallel rank"):
        mismatched_rows(rows[:2])


def test_kto_reference_point_from_mismatched_rows_by_hand(monkeypatch):
    """``prepare`` scores the mismatched rows with the policy and the reference (here stand-ins:
    the policy gives a row the sum of its response ids / 100, the reference 0.05 per response
    token), averages the mean difference with the other data-parallel rank's (a stand-in group
    of 2 whose other rank reports ``other``) and clamps at 0."""
    from types import SimpleNamespace

    from megatron.core import parallel_state as ps

    from alignment.trainers import kto
    from alignment.trainers.dpo import DPOObjective
    from alignment.training.batching import make_sequence_batch

    def fake_logps(model, batch, mb, vocab):
        ids, mask = batch["input_ids"].float(), batch["loss_mask"]
        response = torch.roll(ids, -1, 1) * mask  # loss_mask[t] marks token t + 1
        return response.sum(1) / 100 if model == "policy" else 0.05 * mask.sum(1) * scale

    monkeypatch.setattr(kto, "sequence_logps", fake_logps)
    monkeypatch.setattr(ps, "get_data_parallel_group", lambda: SimpleNamespace(size=lambda: 2))
    monkeypatch.setattr(kto, "all_reduce_sum", lambda values, group: [values[0] + other])
    rows = [([1, 2, 10], 2), ([1, 2, 11, 12], 2), ([3, 20, 21], 1), ([3, 30], 1)]
    batch = make_sequence_batch(rows, pad_id=0)
    models = SimpleNamespace(policy="policy", reference="reference", tokenizer=SimpleNamespace(pad_token_id=0))
    obj = DPOObjective(vocab_size=64, beta=0.1, loss_type="kto")
    # KL rows: [1 2 | 20 21], [1 2 | 30], [3 | 10], [3 | 11 12] -> policy 0.41, 0.30, 0.10, 0.23
    scale, other = 1.0, 0.1  # reference 0.10, 0.05, 0.05, 0.10: this rank's mean 0.185
    obj.prepare(models, [batch], None)
    assert obj.kl_ref_point == pytest.approx(((0.31 + 0.25 + 0.05 + 0.13) / 4 + 0.1) / 2)
    scale, other = 10.0, 0.2  # this rank -0.49, the other 0.2: the DP mean is negative, z0 clamps at 0
    obj.prepare(models, [batch], None)
    assert obj.kl_ref_point == 0.0


def test_orpo_objective_nll_is_token_level_over_the_global_batch_by_hand():
    """ORPO: NLL = chosen tokens' negative log-likelihood summed over the global batch / their
    count (TRL's token-level cross entropy), plus lambda x the odds-ratio term averaged over pairs;
    two data-parallel halves with the global normalisers add up to the whole batch's loss."""
    import math

    from alignment.trainers.dpo import DPOObjective

    # pair 0: chosen 1 token (-0.5), rejected 1 token (-2.0); pair 1: chosen 3 tokens (-0.2, -0.4, -0.6),
    # rejected 2 tokens (-1.0, -1.4)
    lp = torch.tensor([[-0.5, 0, 0], [-2.0, 0, 0], [-0.2, -0.4, -0.6], [-1.0, -1.4, 0]])
    mask = torch.tensor([[1.0, 0, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    obj = DPOObjective(vocab_size=8, beta=0.1, loss_type="orpo", orpo_lambda=0.1)

    def log_odds(avg):
        return avg - math.log(1 - math.exp(avg))

    nll = (0.5 + 0.2 + 0.4 + 0.6) / 4  # token-level: 4 chosen tokens (per sequence it would be (0.5 + 0.4) / 2)
    ratio = [log_odds(-0.5) - log_odds(-2.0), log_odds(-0.4) - log_odds(-1.2)]
    odds_term = sum(-0.1 * math.log(1 / (1 + math.exp(-x))) for x in ratio) / 2
    batch = {"input_ids": torch.zeros(4, 3), "loss_mask": mask}
    assert obj.normalizer(batch) == (2.0, 4.0)
    loss, m = obj.loss({"loss_mask": mask}, {"logprobs": lp}, normalizer=(2.0, 4.0))
    assert loss.item() == pytest.approx(nll + odds_term)
    metrics = DPOObjective.metrics({k: float(v) for k, v in m.items()})
    assert metrics["loss"] == pytest.approx(nll + odds_term) and metrics["nll"] == pytest.approx(nll)
    halves = [obj.loss({"loss_mask": mask[i:i + 2]}, {"logprobs": lp[i:i + 2]}, normalizer=(2.0, 4.0))[0]
              for i in (0, 2)]
    assert sum(h.item() for h in halves) == pytest.approx(loss.item())
