"""Tests for GAE / RLOO / REINFORCE++ advantages, k3_clamped, KL controllers and
kl_in_reward. Expected values are computed by hand (arithmetic in comments)."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    gae,
    get_advantage_estimator,
    grpo_advantages,
    reinforce_plus_plus_advantages,
    rloo_advantages,
)
from alignment.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_in_reward,
    kl_penalty,
)

D = torch.float64
LOG2 = math.log(2.0)


def t(x):
    return torch.tensor(x, dtype=D)


# --------------------------------------------------------------------------- GAE


def test_gae_hand_1x3():
    # gamma=.9, lambda=.8 -> gamma*lambda = .72; r=[0,0,1], V=[.5,.6,.7], terminal
    # t=2: delta = 1 + .9*0 - .7 = .3;            A2 = .3
    # t=1: delta = 0 + .9*.7 - .6 = .03;          A1 = .03 + .72*.3 = .246
    # t=0: delta = 0 + .9*.6 - .5 = .04;          A0 = .04 + .72*.246 = .04 + .17712 = .21712
    # returns = A + V = [.71712, .846, 1.0]
    adv, ret = gae(t([[0, 0, 1]]), t([[0.5, 0.6, 0.7]]), t([[1, 1, 1]]), 0.9, 0.8)
    torch.testing.assert_close(adv, t([[0.21712, 0.246, 0.3]]))
    torch.testing.assert_close(ret, t([[0.71712, 0.846, 1.0]]))


def test_gae_skips_masked_positions():
    # Same trajectory as above with masked positions interleaved (garbage r/V there):
    # the masked tokens are skipped, so valid outputs equal the 1x3 case; 0 elsewhere.
    r = t([[0, 9, 0, 1, 9]])
    v = t([[0.5, 99, 0.6, 0.7, 99]])
    m = torch.tensor([[1, 0, 1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(r, v, m, 0.9, 0.8)
    torch.testing.assert_close(adv, t([[0.21712, 0.0, 0.246, 0.3, 0.0]]))
    torch.testing.assert_close(ret, t([[0.71712, 0.0, 0.846, 1.0, 0.0]]))
    # float mask gives the same
    adv_f, _ = gae(r, v, m.to(D), 0.9, 0.8)
    assert torch.equal(adv, adv_f)


def test_gae_last_values_bootstrap():
    # gamma .9, lambda .8, r=[0,1], V=[.5,.6], last_values=2
    # t=1: delta = 1 + .9*2 - .6 = 2.2;   A1 = 2.2
    # t=0: delta = 0 + .9*.6 - .5 = .04;  A0 = .04 + .72*2.2 = 1.624
    # row 2 (mask [1,0]): only t=0 valid: delta = 3 + .9*(-1) - 1 = 1.1 (bootstrap -1)
    adv, ret = gae(
        t([[0, 1], [3, 5]]),
        t([[0.5, 0.6], [1.0, 7.0]]),
        t([[1, 1], [1, 0]]),
        0.9,
        0.8,
        last_values=t([2.0, -1.0]),
    )
    torch.testing.assert_close(adv, t([[1.624, 2.2], [1.1, 0.0]]))
    torch.testing.assert_close(ret, t([[2.124, 2.8], [2.1, 0.0]]))


def _random_case(seed: int, b: int = 4, n: int = 7):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, n, generator=g, dtype=D)
    v = torch.randn(b, n, generator=g, dtype=D)
    m = torch.rand(b, n, generator=g) > 0.3
    m[:, 0] = True
    last = torch.randn(b, generator=g, dtype=D)
    return r, v, m, last


def _valid_lists(r, v, m, row):
    idx = [j for j in range(r.shape[1]) if m[row, j]]
    return idx, [r[row, j].item() for j in idx], [v[row, j].item() for j in idx]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_lambda_one_is_discounted_return_minus_value(seed):
    # lambda=1: A_t = sum_k gamma^k r_{t+k} + gamma^n * last - V_t over valid tokens
    gamma = 0.95
    r, v, m, last = _random_case(seed)
    adv, ret = gae(r, v, m, gamma, 1.0, last_values=last)
    for row in range(r.shape[0]):
        idx, rs, vs = _valid_lists(r, v, m, row)
        for k, j in enumerate(idx):
            tail = rs[k:]
            g_t = sum(gamma**i * x for i, x in enumerate(tail))
            g_t += gamma ** len(tail) * last[row].item()
            assert adv[row, j].item() == pytest.approx(g_t - vs[k], abs=1e-10)
            assert ret[row, j].item() == pytest.approx(g_t, abs=1e-10)
    assert torch.all(adv[~m] == 0) and torch.all(ret[~m] == 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_lambda_zero_is_td_error(seed):
    # lambda=0: A_t = r_t + gamma * V_next_valid - V_t (V after last valid = last_values)
    gamma = 0.9
    r, v, m, last = _random_case(seed)
    adv, _ = gae(r, v, m, gamma, 0.0, last_values=last)
    for row in range(r.shape[0]):
        idx, rs, vs = _valid_lists(r, v, m, row)
        nxt = vs[1:] + [last[row].item()]
        for k, j in enumerate(idx):
            assert adv[row, j].item() == pytest.approx(rs[k] + gamma * nxt[k] - vs[k], abs=1e-12)


def test_gae_default_terminal_equals_zero_bootstrap():
    r, v, m, _ = _random_case(5)
    a1, r1 = gae(r, v, m, 0.99, 0.95)
    a2, r2 = gae(r, v, m, 0.99, 0.95, last_values=torch.zeros(4, dtype=D))
    assert torch.equal(a1, a2) and torch.equal(r1, r2)


def test_gae_errors():
    x = torch.zeros(2, 3, dtype=D)
    with pytest.raises(ValueError, match="rewards"):
        gae(torch.zeros(3, dtype=D), torch.zeros(3, dtype=D), torch.ones(3), 0.9, 0.9)
    with pytest.raises(ValueError, match="values"):
        gae(x, torch.zeros(2, 4, dtype=D), torch.ones(2, 3), 0.9, 0.9)
    with pytest.raises(ValueError, match="mask"):
        gae(x, x, torch.ones(2, 4), 0.9, 0.9)
    with pytest.raises(ValueError, match="gamma"):
        gae(x, x, torch.ones(2, 3), 1.5, 0.9)
    with pytest.raises(ValueError, match="gae_lambda"):
        gae(x, x, torch.ones(2, 3), 0.9, -0.1)
    with pytest.raises(ValueError, match="last_values"):
        gae(x, x, torch.ones(2, 3), 0.9, 0.9, last_values=torch.zeros(3, dtype=D))


# --------------------------------------------------------------------------- RLOO


def test_rloo_hand():
    # group [1,0,0,0]: A0 = 1 - (0+0+0)/3 = 1; A1..3 = 0 - (1+0+0)/3 = -1/3
    # group [2,4]:     A = [2-4, 4-2] = [-2, 2]
    adv = rloo_advantages(t([1, 0, 0, 0]), group_size=4)
    torch.testing.assert_close(adv, t([1.0, -1 / 3, -1 / 3, -1 / 3]))
    adv = rloo_advantages(t([2, 4, 7, 7]), group_size=2)
    torch.testing.assert_close(adv, t([-2.0, 2.0, 0.0, 0.0]))


def test_rloo_equals_scaled_dr_grpo():
    # A_rloo = G/(G-1) * (r - mean) = G/(G-1) * Dr.GRPO; zero-sum per group
    g = torch.Generator().manual_seed(0)
    r = torch.randn(24, generator=g, dtype=D)
    for G in (2, 3, 4, 6):
        adv = rloo_advantages(r, G)
        torch.testing.assert_close(adv, G / (G - 1) * grpo_advantages(r, G, normalize_by_std=False))
        torch.testing.assert_close(adv.reshape(-1, G).sum(1), torch.zeros(24 // G, dtype=D))


def test_rloo_errors():
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(t([1, 2, 3]), group_size=1)
    with pytest.raises(ValueError, match="group_size"):
        rloo_advantages(t([1, 2, 3]), group_size=2)
    with pytest.raises(ValueError, match="1-D"):
        rloo_advantages(t([[1, 2]]), group_size=2)


# --------------------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand():
    # r=[1,2,3,4]: mean 2.5, centred [-1.5,-.5,.5,1.5]
    #   unbiased var = (2.25+.25+.25+2.25)/3 = 5/3, std = 1.2909944487
    #   -> [-1.1618950, -0.3872983, 0.3872983, 1.1618950]
    s = math.sqrt(5 / 3)
    adv = reinforce_plus_plus_advantages(t([1, 2, 3, 4]), eps=0.0)
    torch.testing.assert_close(adv, t([-1.5 / s, -0.5 / s, 0.5 / s, 1.5 / s]))
    assert adv[0].item() == pytest.approx(-1.161895, abs=1e-6)


def test_reinforce_pp_baseline_hand():
    # groups of 2: [1,2] -> [-.5,.5]; [3,5] -> [-1, 1]; c = [-.5,.5,-1,1], mean 0
    #   unbiased var = (.25+.25+1+1)/3 = 2.5/3, std = 0.9128709
    #   -> [-0.5477226, 0.5477226, -1.0954451, 1.0954451]
    # (GRPO would give both groups the same magnitude; global whitening keeps
    #  the 1:2 ratio between groups.)
    s = math.sqrt(2.5 / 3)
    adv = reinforce_plus_plus_advantages(t([1, 2, 3, 5]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, t([-0.5 / s, 0.5 / s, -1 / s, 1 / s]))
    assert adv[2].item() == pytest.approx(-1.0954451, abs=1e-6)
    # [1,2,3,4] with groups of 2: c = [-.5,.5,-.5,.5], std = sqrt(1/3) -> +-sqrt(3)/2
    h = math.sqrt(3) / 2
    adv = reinforce_plus_plus_advantages(t([1, 2, 3, 4]), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, t([-h, h, -h, h]))


def test_reinforce_pp_properties():
    g = torch.Generator().manual_seed(1)
    r = torch.randn(32, generator=g, dtype=D) * 3 + 1
    for gs in (None, 4):
        adv = reinforce_plus_plus_advantages(r, group_size=gs, eps=0.0)
        assert adv.mean().item() == pytest.approx(0.0, abs=1e-12)
        assert adv.std().item() == pytest.approx(1.0, abs=1e-12)
        # invariant to positive affine reward transforms
        adv2 = reinforce_plus_plus_advantages(2.5 * r - 7, group_size=gs, eps=0.0)
        torch.testing.assert_close(adv, adv2)
    # batch of one / all equal -> 0, no NaN
    assert torch.equal(reinforce_plus_plus_advantages(t([3.0])), t([0.0]))
    assert torch.equal(reinforce_plus_plus_advantages(t([2.0, 2.0, 2.0])), t([0.0] * 3))


def test_reinforce_pp_token_level_and_global_batch():
    # token level: r = [1, 2, 3, 4] over 1, 1, 1, 3 tokens -> n = 6 tokens, mean (1+2+3+12)/6 = 3,
    #   unbiased var = (4 + 1 + 0 + 3 * 1) / 5 = 1.6 -> A = (r - 3) / sqrt(1.6)
    counts = torch.tensor([1, 1, 1, 3])
    adv = reinforce_plus_plus_advantages(t([1, 2, 3, 4]), eps=0.0, token_counts=counts)
    torch.testing.assert_close(adv, (t([1, 2, 3, 4]) - 3) / math.sqrt(1.6))
    # = verl's: the scalar broadcast over each response's tokens, whitened over the valid tokens
    tokens = reinforce_plus_plus_advantages(t([1, 2, 3, 4]).repeat_interleave(counts), eps=0.0)
    torch.testing.assert_close(adv.repeat_interleave(counts), tokens)
    # global batch: two data-parallel shards whose statistics are summed = the whole batch at once
    g = torch.Generator().manual_seed(2)
    r, n = torch.randn(16, generator=g, dtype=D), torch.randint(1, 9, (16,), generator=g)
    for level in (None, n):
        for gs in (None, 4):
            whole = reinforce_plus_plus_advantages(r, group_size=gs, eps=0.0, token_counts=level)
            halves = []
            for mine, other in ((slice(0, 8), slice(8, 16)), (slice(8, 16), slice(0, 8))):
                sums = {}

                def other_sums(values, other=other):  # what the other rank contributes
                    reinforce_plus_plus_advantages(r[other], group_size=gs, token_counts=None if level is None else
                                                   level[other], all_reduce=lambda v: sums.setdefault("o", v) or v)
                    return [a + b for a, b in zip(values, sums["o"])]

                halves.append(reinforce_plus_plus_advantages(r[mine], group_size=gs, eps=0.0, all_reduce=other_sums,
                                                             token_counts=None if level is None else level[mine]))
            torch.testing.assert_close(torch.cat(halves), whole)
    with pytest.raises(ValueError, match="token_counts must be"):
        reinforce_plus_plus_advantages(t([1, 2]), token_counts=torch.tensor([1]))


def test_reinforce_pp_errors():
    with pytest.raises(ValueError, match="1-D"):
        reinforce_plus_plus_advantages(t([[1, 2]]))
    with pytest.raises(ValueError, match="non-empty"):
        reinforce_plus_plus_advantages(t([]))
    with pytest.raises(ValueError, match="group_size"):
        reinforce_plus_plus_advantages(t([1, 2, 3]), group_size=2)
    with pytest.raises(ValueError, match="group_size"):
        reinforce_plus_plus_advantages(t([1, 2, 3]), group_size=0)


# --------------------------------------------------------------------------- registry


def test_registry_new_names():
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
    assert get_advantage_estimator("gae") is gae
    assert get_advantage_estimator("rloo") is rloo_advantages
    r = t([1, 0, 0, 0, 2, 4, 3, 5])
    # uniform (rewards, group_size) signature for all group estimators
    torch.testing.assert_close(
        get_advantage_estimator("grpo_no_std")(r, 4), grpo_advantages(r, 4, normalize_by_std=False)
    )
    torch.testing.assert_close(get_advantage_estimator("rloo")(r, 4), rloo_advantages(r, 4))
    torch.testing.assert_close(
        get_advantage_estimator("reinforce_plus_plus")(r, 4), reinforce_plus_plus_advantages(r)
    )
    torch.testing.assert_close(
        get_advantage_estimator("reinforce_plus_plus_baseline")(r, 4),
        reinforce_plus_plus_advantages(r, group_size=4),
    )
    group_names = ("grpo", "grpo_no_std", "rloo", "reinforce_plus_plus")
    for name in group_names + ("reinforce_plus_plus_baseline",):
        assert ADVANTAGE_ESTIMATORS[name](r, 2).shape == (8,)
    with pytest.raises(ValueError, match="reinforce_plus_plus_baseline"):
        get_advantage_estimator("ppo")


# --------------------------------------------------------------------------- k3_clamped


def test_k3_clamped_hand():
    assert "k3_clamped" in KL_ESTIMATORS and KL_ESTIMATORS[:3] == ("k1", "k2", "k3")
    # log_ratio = [log2, -2, -3, -30, 50]
    #   log2: k3 = .5 - 1 + .693147 = .193147 (no clamp)
    #   -2:   e^2 - 1 - 2 = 7.389056 - 3 = 4.389056 (no clamp)
    #   -3:   e^3 - 1 - 3 = 20.085537 - 4 = 16.085537 -> clamped to 10
    #   -30:  clamp lr to -20: e^20 - 21 = 4.85e8 -> 10
    #   50:   clamp lr to 20: e^-20 - 1 + 20 = 19.000000002 -> 10
    lr = t([[LOG2, -2.0, -3.0, -30.0, 50.0]])
    out = kl_penalty(lr, torch.zeros_like(lr), "k3_clamped")
    torch.testing.assert_close(out, t([[LOG2 - 0.5, math.exp(2) - 3, 10.0, 10.0, 10.0]]))
    # unclamped k3 at -3 is 16.0855; matches k3 inside the range
    k3 = kl_penalty(lr, torch.zeros_like(lr), "k3")
    assert k3[0, 2].item() == pytest.approx(16.085537, abs=1e-6)


def test_k3_clamped_finite_and_bounded():
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(16, 16, generator=g, dtype=D) * 400
    out = kl_penalty(lp, torch.zeros_like(lp), "k3_clamped")
    assert torch.all(torch.isfinite(out)) and torch.all(out >= 0) and torch.all(out <= 10)
    small = torch.randn(8, 8, generator=g, dtype=D) * 0.5
    torch.testing.assert_close(
        kl_penalty(small, torch.zeros_like(small), "k3_clamped"),
        kl_penalty(small, torch.zeros_like(small), "k3"),
    )


# --------------------------------------------------------------------------- controllers


def test_fixed_controller():
    c = FixedKLController(0.05)
    c.update(100.0, 512)
    assert c.value == 0.05
    with pytest.raises(ValueError, match="kl_coef"):
        FixedKLController(-0.1)
    with pytest.raises(ValueError, match="n_steps"):
        c.update(1.0, -1)


def test_adaptive_controller_hand():
    c = AdaptiveKLController(0.1, target_kl=6.0, horizon=10000)
    # kl 9: err = 9/6 - 1 = .5 -> clip .2; mult = 1 + .2*256/10000 = 1.00512 -> .100512
    c.update(9.0, 256)
    assert c.value == pytest.approx(0.100512, rel=1e-12)
    # kl 3: err = -.5 -> -.2; mult = .99488 -> .100512*.99488 = .1*(1 - .00512^2) = .09999737856
    c.update(3.0, 256)
    assert c.value == pytest.approx(0.09999737856, rel=1e-12)
    c2 = AdaptiveKLController(0.1, 6.0, 10000)
    # kl 6.6: err = .1 (inside clip); mult = 1 + .1*1000/10000 = 1.01 -> .101
    c2.update(6.6, 1000)
    assert c2.value == pytest.approx(0.101, rel=1e-12)
    c2.update(6.0, 1000)  # on target: unchanged
    assert c2.value == pytest.approx(0.101, rel=1e-12)
    c2.update(1e9, 0)  # no steps: unchanged
    assert c2.value == pytest.approx(0.101, rel=1e-12)
    c2.update(torch.tensor(12.0), 500)  # 0-d tensor accepted: err .2, mult 1.01
    assert c2.value == pytest.approx(0.10201, rel=1e-12)


def test_adaptive_controller_errors():
    for kwargs, name in (
        (dict(init_kl_coef=0.0, target_kl=6.0, horizon=10.0), "init_kl_coef"),
        (dict(init_kl_coef=0.1, target_kl=0.0, horizon=10.0), "target_kl"),
        (dict(init_kl_coef=0.1, target_kl=6.0, horizon=-1.0), "horizon"),
    ):
        with pytest.raises(ValueError, match=name):
            AdaptiveKLController(**kwargs)
    c = AdaptiveKLController(0.1, 6.0, 10.0)
    with pytest.raises(ValueError, match="current_kl"):
        c.update(float("nan"), 1)
    with pytest.raises(ValueError, match="n_steps"):
        c.update(1.0, -5)


# --------------------------------------------------------------------------- kl_in_reward


def test_kl_in_reward_hand():
    # k1 with ref = 0 -> kl = logprobs; kl_coef = .5
    # row 0: mask [1,1,0], kl [.1,-.2,(5)], reward 1  -> [-.05, .1 + 1 = 1.1, 0]
    # row 1: mask [1,1,1], kl [0,.4,.2],  reward -2 -> [0, -.2, -.1 - 2 = -2.1]
    lp = t([[0.1, -0.2, 5.0], [0.0, 0.4, 0.2]])
    m = t([[1, 1, 0], [1, 1, 1]])
    out = kl_in_reward(t([1.0, -2.0]), lp, torch.zeros_like(lp), m, kl_coef=0.5)
    torch.testing.assert_close(out, t([[-0.05, 1.1, 0.0], [0.0, -0.2, -2.1]]))


def test_kl_in_reward_noncontiguous_mask_and_k3():
    # mask [1,0,1,0]: last valid index is 2. k3 with log_ratio log2 = .193147 per token;
    # coef .1 -> -.0193147; reward 3 at index 2 -> 2.9806853
    lr = torch.full((1, 4), LOG2, dtype=D)
    out = kl_in_reward(
        t([3.0]), lr, torch.zeros_like(lr), t([[1, 0, 1, 0]]), 0.1, estimator="k3"
    )
    k = 0.1 * (LOG2 - 0.5)
    torch.testing.assert_close(out, t([[-k, 0.0, 3.0 - k, 0.0]]))
    # zero coef: only the reward at the last valid token
    out0 = kl_in_reward(t([3.0]), lr, torch.zeros_like(lr), t([[1, 0, 1, 0]]), 0.0)
    torch.testing.assert_close(out0, t([[0.0, 0.0, 3.0, 0.0]]))


def test_kl_in_reward_sum_property():
    # sum over tokens = reward - coef * sum of masked kl
    g = torch.Generator().manual_seed(3)
    lp = torch.randn(5, 6, generator=g, dtype=D)
    ref = torch.randn(5, 6, generator=g, dtype=D)
    m = torch.rand(5, 6, generator=g) > 0.4
    m[:, 0] = True
    r = torch.randn(5, generator=g, dtype=D)
    out = kl_in_reward(r, lp, ref, m, 0.2, "k3")
    expect = r - 0.2 * (kl_penalty(lp, ref, "k3") * m).sum(1)
    torch.testing.assert_close(out.sum(1), expect)
    assert torch.all(out[~m] == 0)


def test_kl_in_reward_errors():
    lp = torch.zeros(2, 3, dtype=D)
    m = torch.ones(2, 3)
    r = torch.zeros(2, dtype=D)
    with pytest.raises(ValueError, match="rewards"):
        kl_in_reward(torch.zeros(3, dtype=D), lp, lp, m, 0.1)
    with pytest.raises(ValueError, match="logprobs"):
        kl_in_reward(r, torch.zeros(2, dtype=D), torch.zeros(2, dtype=D), m, 0.1)
    with pytest.raises(ValueError, match="mask"):
        kl_in_reward(r, lp, lp, torch.ones(2, 4), 0.1)
    with pytest.raises(ValueError, match="mask"):
        kl_in_reward(r, lp, lp, t([[1, 1, 1], [0, 0, 0]]), 0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        kl_in_reward(r, lp, lp, m, -0.1)
    with pytest.raises(ValueError, match="shape"):
        kl_in_reward(r, lp, torch.zeros(2, 4, dtype=D), m, 0.1)
    with pytest.raises(ValueError, match="estimator"):
        kl_in_reward(r, lp, lp, m, 0.1, estimator="k9")


def test_ppo_masked_whiten_uses_the_unbiased_std_over_valid_tokens(monkeypatch):
    # valid tokens [1, 2, 3, 4]: mean 2.5, unbiased var 5/3 (verl's masked_whiten; the population
    # std, OpenRLHF's, would be sqrt(5/4)); padding stays 0
    from alignment.trainers import ppo

    monkeypatch.setattr(ppo, "all_reduce_sum", lambda values, group: values)  # one rank: the global batch
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=D)
    s = math.sqrt(5 / 3)
    expected = torch.tensor([[-1.5 / s, -0.5 / s, 0.5 / s], [1.5 / s, 0.0, 0.0]], dtype=D)
    torch.testing.assert_close(ppo.masked_whiten(x, mask, None), expected, atol=1e-7, rtol=0)
