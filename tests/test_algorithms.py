"""Unit tests for the GRPO math layer; expected values are computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    get_advantage_estimator,
    grpo_advantages,
)
from alignment.algorithms.aggregation import token_mean
from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.algorithms.kl import kl_penalty
from alignment.algorithms.policy_loss import clipped_surrogate_loss

D = torch.float64
LOG2 = math.log(2.0)  # 0.6931471805599453


def t(x):
    return torch.tensor(x, dtype=D)


# --------------------------------------------------------------------------- advantages


def test_grpo_two_groups():
    # group 1: [1,0,0,0] -> mean .25, deviations [.75,-.25,-.25,-.25]
    #   unbiased std = sqrt((.75^2 + 3*.25^2)/3) = sqrt((.5625+.1875)/3) = sqrt(.25) = .5
    #   -> [1.5, -.5, -.5, -.5]
    # group 2: [0,1,1,0] -> mean .5, deviations [-.5,.5,.5,-.5]
    #   unbiased std = sqrt(4*.25/3) = sqrt(1/3) = 0.5773502691896258
    #   -> .5 / 0.57735... = sqrt(3)/2 = 0.8660254037844386
    r = t([1, 0, 0, 0, 0, 1, 1, 0])
    adv = grpo_advantages(r, group_size=4, eps=0.0)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, t([1.5, -0.5, -0.5, -0.5, -h, h, h, -h]))
    # default eps=1e-6 only perturbs slightly: 0.75/(0.5+1e-6) = 1.499997
    adv_eps = grpo_advantages(r, group_size=4)
    assert adv_eps[0].item() == pytest.approx(0.75 / 0.500001, rel=1e-12)


def test_dr_grpo_no_std():
    # group_size 2: [1,0] mean .5 -> [.5,-.5]; [2,4] mean 3 -> [-1, 1];
    # [7,7] mean 7 -> [0, 0]. No division by the std (Dr. GRPO).
    adv = grpo_advantages(t([1, 0, 2, 4, 7, 7]), group_size=2, normalize_by_std=False)
    torch.testing.assert_close(adv, t([0.5, -0.5, -1.0, 1.0, 0.0, 0.0]))
    # [1,0,0,0] mean .25 -> [.75,-.25,-.25,-.25] (GRPO would give [1.5,-.5,-.5,-.5])
    adv = grpo_advantages(t([1, 0, 0, 0]), group_size=4, normalize_by_std=False)
    torch.testing.assert_close(adv, t([0.75, -0.25, -0.25, -0.25]))


def test_all_equal_group_is_zero():
    # [3,3,3]: deviations 0, std 0 -> 0/(0+eps) = 0; second group [0,6,0]: mean 2,
    # deviations [-2,4,-2], std = sqrt((4+16+4)/2) = sqrt(12) = 3.4641016
    adv = grpo_advantages(t([3, 3, 3, 0, 6, 0]), group_size=3, eps=1e-6)
    assert torch.all(adv[:3] == 0)
    s12 = math.sqrt(12)
    torch.testing.assert_close(
        adv[3:], t([-2 / (s12 + 1e-6), 4 / (s12 + 1e-6), -2 / (s12 + 1e-6)])
    )


def test_group_size_one_is_zero():
    # std of a single sample is undefined -> treated as 0 -> advantage 0 (no NaN)
    adv = grpo_advantages(t([5.0, -2.0, 0.3]), group_size=1)
    assert torch.equal(adv, t([0.0, 0.0, 0.0]))
    adv = grpo_advantages(t([5.0, -2.0]), group_size=1, normalize_by_std=False)
    assert torch.equal(adv, t([0.0, 0.0]))


def test_grpo_errors():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(t([1, 2, 3]), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(t([1, 2]), group_size=0)
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(t([[1, 2], [3, 4]]), group_size=2)


def test_advantage_registry():
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    assert get_advantage_estimator("grpo") is grpo_advantages
    with pytest.raises(ValueError, match="grpo"):
        get_advantage_estimator("gae_nope")


# --------------------------------------------------------------------------- KL


def test_kl_estimators_concrete():
    # logp = log .5, ref = log .25 -> log_ratio = log 2 = 0.693147
    #   k1 = 0.693147
    #   k2 = .5 * 0.693147^2 = .5 * 0.480453 = 0.240227
    #   k3 = exp(-log 2) - 1 + log 2 = .5 - 1 + .693147 = 0.193147
    # reversed (log_ratio = -log 2): k1 = -0.693147, k2 = 0.240227,
    #   k3 = exp(log 2) - 1 - log 2 = 2 - 1 - .693147 = 0.306853
    lp = t([[math.log(0.5), math.log(0.25)]])
    ref = t([[math.log(0.25), math.log(0.5)]])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), t([[LOG2, -LOG2]]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), t([[0.5 * LOG2**2] * 2]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), t([[LOG2 - 0.5, 1 - LOG2]]))
    assert kl_penalty(lp, ref)[0, 0].item() == pytest.approx(0.193147, abs=1e-6)
    assert kl_penalty(lp, ref)[0, 1].item() == pytest.approx(0.306853, abs=1e-6)


def test_k3_nonnegative_random():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(64, 32, generator=g, dtype=D) * 3
    ref = torch.randn(64, 32, generator=g, dtype=D) * 3
    assert torch.all(kl_penalty(lp, ref, "k3") >= 0)
    assert torch.all(kl_penalty(lp, ref, "k2") >= 0)


def test_kl_zero_when_equal():
    lp = torch.randn(3, 4, dtype=D)
    for est in ("k1", "k2", "k3"):
        assert torch.all(kl_penalty(lp, lp.clone(), est) == 0)


def test_kl_errors():
    with pytest.raises(ValueError, match=r"estimator.*k1.*k2.*k3"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(t([[0.0, 0.0]]), t([[0.0]]))


# --------------------------------------------------------------------------- clipped surrogate


def _one_token(ratio: float, adv: float, clip: float = 0.2):
    """Single token with old_logprob -1 and logprob -1 + log(ratio)."""
    old = t([[-1.0]])
    lp = (old + math.log(ratio)).requires_grad_(True)
    loss, clipped = clipped_surrogate_loss(lp, old, t([adv]), clip)
    loss.sum().backward()
    return loss.item(), lp.grad.item(), bool(clipped.item())


def test_ratio_one_equals_vanilla_policy_gradient():
    # ratio = 1, A = 2: loss = -1*2 = -2; d(-exp(lp-old)*A)/dlp = -ratio*A = -2,
    # which is the REINFORCE gradient d(-A * logp)/dlogp = -A.
    loss, grad, clipped = _one_token(1.0, 2.0)
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx(-2.0)
    assert not clipped


def test_ratio_above_clip_positive_adv():
    # ratio 1.5, A=1, eps .2: unclipped -1.5, clipped -1.2*1 = -1.2 -> max = -1.2,
    # clipped branch active (constant) -> gradient 0
    loss, grad, clipped = _one_token(1.5, 1.0)
    assert loss == pytest.approx(-1.2)
    assert grad == 0.0
    assert clipped


def test_ratio_below_clip_positive_adv_not_clipped():
    # ratio .5, A=1: unclipped -.5, clipped -.8 -> max = -.5 (unclipped);
    # gradient = -ratio*A = -.5
    loss, grad, clipped = _one_token(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert not clipped


def test_ratio_below_clip_negative_adv_clipped():
    # ratio .5, A=-1: unclipped .5, clipped .8 -> max = .8 (clipped), grad 0
    loss, grad, clipped = _one_token(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert clipped


def test_ratio_above_clip_negative_adv_not_clipped():
    # ratio 1.5, A=-1: unclipped 1.5, clipped 1.2 -> max = 1.5 (pessimistic bound,
    # unclipped), gradient = -ratio*A = 1.5
    loss, grad, clipped = _one_token(1.5, -1.0)
    assert loss == pytest.approx(1.5)
    assert grad == pytest.approx(1.5)
    assert not clipped


def test_clipped_broadcast_and_token_advantages():
    # [B] advantages broadcast over T == explicit [B,T]
    lp = torch.randn(2, 3, dtype=D)
    old = torch.randn(2, 3, dtype=D)
    a = t([1.0, -2.0])
    l1, c1 = clipped_surrogate_loss(lp, old, a, 0.2)
    l2, c2 = clipped_surrogate_loss(lp, old, a[:, None].expand(2, 3), 0.2)
    assert torch.equal(l1, l2) and torch.equal(c1, c2)
    assert c1.dtype == torch.bool and l1.shape == (2, 3)


def test_gradient_only_through_logprobs():
    lp = torch.zeros(1, 2, dtype=D, requires_grad=True)
    old = torch.zeros(1, 2, dtype=D, requires_grad=True)
    adv = t([1.0]).requires_grad_(True)
    loss, _ = clipped_surrogate_loss(lp, old, adv, 0.2)
    loss.sum().backward()
    assert lp.grad is not None
    assert old.grad is None and adv.grad is None


def test_clipped_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="clip_ratio"):
        clipped_surrogate_loss(z, z, torch.zeros(2), 0.0)
    with pytest.raises(ValueError):
        clipped_surrogate_loss(z, torch.zeros(2, 4), torch.zeros(2), 0.2)
    with pytest.raises(ValueError):
        clipped_surrogate_loss(z, z, torch.zeros(3), 0.2)


# --------------------------------------------------------------------------- aggregation


def test_token_mean_uses_global_count():
    # masked sum = 1 + 2 + 4 = 7; local mask sum is 3 but global count is 10 -> .7
    v = t([[1, 2, 3], [4, 5, 6]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert token_mean(v, m, 10).item() == pytest.approx(0.7)
    assert token_mean(v, m.bool(), torch.tensor(10.0)).item() == pytest.approx(0.7)
    with pytest.raises(ValueError, match="global_token_count"):
        token_mean(v, m, 0)
    with pytest.raises(ValueError, match="global_token_count"):
        token_mean(v, m, torch.tensor(-1.0))


# --------------------------------------------------------------------------- grpo_loss


def _hand_example():
    # old_logprobs = -1 everywhere; logprobs = old + log(ratio)
    ratio = t([[1.0, 1.5, 0.5], [1.0, 0.5, 0.5]])
    old = torch.full((2, 3), -1.0, dtype=D)
    lp = (old + ratio.log()).requires_grad_(True)
    # log(pi/pi_ref) per token; last token of row 1 is padding (big, must be masked)
    log_ratio_ref = t([[0.0, LOG2, 0.0], [0.0, -LOG2, 3.0]])
    ref = lp.detach() - log_ratio_ref
    adv = t([1.0, -0.5])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return lp, old, ref, adv, mask


def test_grpo_loss_by_hand():
    lp, old, ref, adv, mask = _hand_example()
    cfg = GRPOLossConfig(clip_ratio=0.2, kl_coef=0.1, kl_estimator="k3")
    loss, m = grpo_loss(lp, old, ref, adv, mask, 5, cfg)
    # surrogate (eps .2):
    #   row0 A=1:   r=1 -> -1;  r=1.5 -> max(-1.5,-1.2) = -1.2 (clipped);
    #               r=.5 -> max(-.5,-.8) = -.5
    #   row1 A=-.5: r=1 -> .5;  r=.5 -> max(.25, .4) = .4 (clipped);
    #               r=.5 masked (would be clipped too, must not count)
    #   policy_loss_sum = -1 - 1.2 - .5 + .5 + .4 = -1.8
    # k3: row0 [0, .5-1+log2 = .193147, 0]; row1 [0, 2-1-log2 = .306853, masked]
    #   kl_sum = .193147 + .306853 = .5
    # loss = (-1.8 + .1 * .5) / 5 = -1.75 / 5 = -.35
    assert loss.item() == pytest.approx(-0.35)
    assert m["policy_loss_sum"].item() == pytest.approx(-1.8)
    assert m["kl_sum"].item() == pytest.approx(0.5)
    assert m["clipped_tokens"].item() == 2
    # ratio_sum = 1 + 1.5 + .5 + 1 + .5 = 4.5
    assert m["ratio_sum"].item() == pytest.approx(4.5)
    assert m["tokens"].item() == 5
    assert all(not v.requires_grad for v in m.values())

    loss.backward()
    # d/dlp per token = mask/5 * (dsurrogate + .1 * dk3), with
    #   dsurrogate = -ratio*A if unclipped else 0;  dk3/dlp = 1 - exp(-log_ratio_ref)
    #   row0: t0 -1 + 0 = -1;  t1 0 + .1*(1-.5) = .05;  t2 -.5 + 0 = -.5
    #   row1: t0 .5 + 0 = .5;  t1 0 + .1*(1-2) = -.1;   t2 masked 0
    #   / 5 -> [[-.2, .01, -.1], [.1, -.02, 0]]
    torch.testing.assert_close(lp.grad, t([[-0.2, 0.01, -0.1], [0.1, -0.02, 0.0]]))


def test_grpo_loss_kl_skipped():
    lp, old, ref, adv, mask = _hand_example()
    # kl_coef 0 or ref None -> loss = -1.8 / 5 = -.36, kl_sum 0
    for r, coef in ((ref, 0.0), (None, 0.1)):
        loss, m = grpo_loss(lp, old, r, adv, mask, 5, GRPOLossConfig(kl_coef=coef))
        assert loss.item() == pytest.approx(-0.36)
        assert m["kl_sum"].item() == 0.0


def test_grpo_loss_microbatch_invariance():
    g = torch.Generator().manual_seed(1)
    B, T = 6, 7
    lp0 = torch.randn(B, T, generator=g, dtype=D) * 0.3 - 1.0
    old = lp0 + torch.randn(B, T, generator=g, dtype=D) * 0.2
    ref = lp0 + torch.randn(B, T, generator=g, dtype=D) * 0.2
    adv = grpo_advantages(torch.randint(0, 2, (B,), generator=g).to(D), group_size=3)
    mask = (torch.rand(B, T, generator=g) > 0.3).long()
    n = float(mask.sum())
    cfg = GRPOLossConfig()

    lp_full = lp0.clone().requires_grad_(True)
    loss_full, m_full = grpo_loss(lp_full, old, ref, adv, mask, n, cfg)
    loss_full.backward()

    lp_mb = lp0.clone().requires_grad_(True)
    total = 0.0
    metrics = {}
    for sl in (slice(0, 2), slice(2, B)):
        loss, m = grpo_loss(lp_mb[sl], old[sl], ref[sl], adv[sl], mask[sl], n, cfg)
        loss.backward()
        total = total + loss.detach()
        for k, v in m.items():
            metrics[k] = metrics.get(k, 0.0) + v

    torch.testing.assert_close(total, loss_full.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(lp_mb.grad, lp_full.grad, rtol=0, atol=1e-14)
    for k in m_full:
        torch.testing.assert_close(metrics[k], m_full[k], rtol=0, atol=1e-12)


def test_overlong_penalty_dapo_eq13_by_hand():
    from alignment.algorithms.reward_shaping import overlong_penalty

    # L_max = 10, L_cache = 4: no penalty up to 6 tokens, then -1/4 per token, -1 beyond 10
    lengths = torch.tensor([0, 6, 7, 8, 10, 11])
    assert overlong_penalty(lengths, 10, 4).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0, -1.0]
    assert overlong_penalty(lengths, 10, 4, penalty_factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5, -0.5]
    with pytest.raises(ValueError, match="overlong_buffer_len=11"):
        overlong_penalty(lengths, 10, 11)


def test_informative_groups_drop_all_equal_rewards():
    from alignment.algorithms.reward_shaping import informative_groups

    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 0.0, 0.0, 0.0])
    assert informative_groups(rewards, 3).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="whole number of groups"):
        informative_groups(rewards, 4)
