"""GSPO, CISPO and the rollout-training mismatch correction, by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.aggregation import aggregate
from alignment.algorithms.grpo_loss import GRPOLossConfig, grpo_loss
from alignment.algorithms.policy_loss import cispo_policy_loss, gspo_policy_loss, policy_loss, ppo_policy_loss
from alignment.algorithms.rollout_correction import RolloutCorrection, rollout_correction

D = torch.float64
L = math.log


def t(x, grad=False):
    return torch.tensor(x, dtype=D, requires_grad=grad)


# --------------------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_clip_and_gradient_by_hand():
    # row 0: token ratios 2 and 1 -> s = exp((log 2 + 0) / 2) = sqrt 2 = 1.41421 > 1.2: clipped (A = +1),
    #        loss -1.2 on both tokens, no gradient; the padding position does not enter s
    # row 1: token ratios 1, 1.25, 1 -> s = 1.25^(1/3) = 1.077217 inside [0.8, 1.2] (token 2 alone would be
    #        outside), A = -2: loss -s * A = 2.154435 per token, gradient d loss / d logprob_t = -A * s
    lp = t([[L(0.5), L(0.25), 0.0], [L(0.5), L(0.5), L(0.5)]], grad=True)
    old = t([[L(0.25), L(0.25), 5.0], [L(0.5), L(0.4), L(0.5)]])
    mask = t([[1, 1, 0], [1, 1, 1]])
    adv = t([1.0, -2.0])
    loss, clipped = gspo_policy_loss(lp, old, adv, mask, 0.2, 0.2)
    s1 = 1.25 ** (1 / 3)
    assert loss[0, :2].tolist() == pytest.approx([-1.2, -1.2])
    assert loss[1].tolist() == pytest.approx([2 * s1] * 3)
    assert clipped[0, :2].tolist() == [True, True] and clipped[1].tolist() == [False] * 3
    (loss * mask).sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.0, 0.0])
    assert lp.grad[1].tolist() == pytest.approx([2 * s1] * 3)
    # with seq-mean-token-mean the gradient is GSPO's (1/G) sum_i s_i A_i (1/|y_i|) grad log pi(y_i)
    lp.grad = None
    loss, _ = gspo_policy_loss(lp, old, adv, mask, 0.2, 0.2)
    aggregate(loss, mask, "seq-mean-token-mean", 2.0).backward()
    assert lp.grad[1].tolist() == pytest.approx([2 * s1 / 3 / 2] * 3)


def test_gspo_equals_ppo_for_one_token_sequences():
    lp, old = t([[L(0.3)], [L(0.9)]], grad=True), t([[L(0.2)], [L(0.5)]])
    adv, mask = t([1.5, -0.5]), t([[1], [1]])
    g, gc = gspo_policy_loss(lp, old, adv, mask, 0.2, 0.28)
    p, pc = ppo_policy_loss(lp, old, adv, 0.2, 0.28)
    assert torch.allclose(g, p) and torch.equal(gc, pc)


# --------------------------------------------------------------------------- CISPO


def test_cispo_weight_is_clipped_but_every_token_keeps_its_gradient():
    # ratios 0.6/0.4 = 1.5 and 1.0; no lower bound (low = 1 -> 1 - low = 0), high 0.28: weights 1.28 and 1.0
    # A = 2: loss = -w A logprob = [-1.28 * 2 * log 0.6, -2 log 0.3] = [1.307739, 2.407946]; gradient -w A
    lp = t([[L(0.6), L(0.3)]], grad=True)
    old = t([[L(0.4), L(0.3)]])
    loss, clipped = cispo_policy_loss(lp, old, t([2.0]), 1.0, 0.28)
    assert loss[0].tolist() == pytest.approx([-1.28 * 2 * L(0.6), -2 * L(0.3)])
    assert clipped[0].tolist() == [True, False]
    loss.sum().backward()
    assert lp.grad[0].tolist() == pytest.approx([-2.56, -2.0])
    # PPO with the same bounds zeroes the first token's gradient (ratio 1.5 > 1.28, A > 0)
    lp2 = lp.detach().clone().requires_grad_(True)
    ppo, _ = ppo_policy_loss(lp2, old, t([2.0]), 0.2, 0.28)
    ppo.sum().backward()
    assert lp2.grad[0, 0].item() == 0.0


def test_cispo_negative_advantage_and_lower_bound():
    # ratio 0.1/0.5 = 0.2 with low 0.2: weight clamped up to 0.8; A = -1: loss = 0.8 * log 0.1, gradient 0.8
    lp = t([[L(0.1)]], grad=True)
    loss, clipped = cispo_policy_loss(lp, t([[L(0.5)]]), t([-1.0]), 0.2, 0.2)
    assert loss.item() == pytest.approx(0.8 * L(0.1)) and clipped.item()
    loss.sum().backward()
    assert lp.grad.item() == pytest.approx(0.8)


def test_policy_loss_dispatch_and_errors():
    lp, old, adv, mask = t([[-1.0, -2.0]]), t([[-1.2, -2.0]]), t([1.0]), t([[1, 1]])
    for name, fn in [("ppo", lambda: ppo_policy_loss(lp, old, adv, 0.2, 0.3, 3.0)),
                     ("gspo", lambda: gspo_policy_loss(lp, old, adv, mask, 0.2, 0.3)),
                     ("cispo", lambda: cispo_policy_loss(lp, old, adv, 0.2, 0.3))]:
        got = policy_loss(name, lp, old, adv, mask, 0.2, 0.3, 3.0 if name == "ppo" else None)
        assert torch.equal(got[0], fn()[0]), name
    with pytest.raises(ValueError, match="valid values are ppo, gspo, cispo"):
        policy_loss("grpo", lp, old, adv, mask, 0.2, 0.2)
    with pytest.raises(ValueError, match="applies to the ppo loss only"):
        policy_loss("cispo", lp, old, adv, mask, 0.2, 0.2, 3.0)
    with pytest.raises(ValueError, match="clip_ratio_high must be > 0"):
        gspo_policy_loss(lp, old, adv, mask, 0.2, 0.0)
    with pytest.raises(ValueError, match="response_mask"):
        gspo_policy_loss(lp, old, adv, t([[1, 1, 1]]), 0.2, 0.2)


# --------------------------------------------------------------------------- rollout correction

# trainer (old) and engine (rollout) probabilities of the sampled tokens; row 1 has one padding position
OLD = t([[L(0.5), L(0.4), L(0.3)], [L(0.2), L(0.2), 0.0]])
ROLLOUT = t([[L(0.25), L(0.5), L(0.3)], [L(0.1), L(0.4), 7.0]])
MASK = t([[1, 1, 1], [1, 1, 0]])
# token ratios r = old / rollout: row 0: 2, 0.8, 1 (product 1.6, geometric mean 1.6^(1/3) = 1.169607);
# row 1: 2, 0.5 (product 1, geometric mean 1)


def close(x, expected) -> bool:
    return torch.allclose(x, torch.tensor(expected, dtype=x.dtype), rtol=1e-6, atol=1e-7)  # computed in fp32


def _weights(**kw):
    return rollout_correction(OLD, ROLLOUT, MASK, RolloutCorrection(**kw))


def test_truncated_importance_weights_by_hand():
    w, m = _weights(is_level="token", is_threshold=1.5)
    assert close(w, [[1.5, 0.8, 1.0], [1.5, 0.5, 0.0]])
    assert m["is_weight_sum"].item() == pytest.approx(1.5 + 0.8 + 1 + 1.5 + 0.5)
    assert m["is_weight_sq_sum"].item() == pytest.approx(1.5**2 + 0.8**2 + 1 + 1.5**2 + 0.5**2)
    w, _ = _weights(is_level="sequence", is_threshold=1.5)  # min(1.6, 1.5) and min(1, 1.5)
    assert close(w, [[1.5, 1.5, 1.5], [1.0, 1.0, 0.0]])
    w, m = _weights()  # off: 1 on valid tokens, 0 on padding; the metrics are there all the same
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert m["rollout_kl_sum"].item() == pytest.approx(2 * k3(2.0) + k3(0.8) + k3(0.5))  # 0.830001
    assert m["rollout_ratio_max"].item() == pytest.approx(2.0)
    assert m["masked_tokens"].item() == 0


def test_masked_importance_sampling_by_hand():
    w, m = _weights(mask_level="token", mask_low=0.6, mask_high=1.8)  # drops 2.0, 2.0 and 0.5
    assert w.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert m["masked_tokens"].item() == 3
    w, m = _weights(mask_level="sequence", mask_high=1.5)  # band [2/3, 1.5]: 1.6 out, 1.0 in
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    assert m["masked_tokens"].item() == 3
    w, _ = _weights(mask_level="geometric", mask_high=1.1)  # band [0.909, 1.1]: 1.1696 out, 1.0 in
    assert w.tolist() == [[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]
    w, _ = _weights(mask_level="geometric", mask_high=1.2)  # now 1.1696 is in
    assert w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    w, _ = _weights(is_level="token", is_threshold=1.5, mask_level="token", mask_low=0.6, mask_high=1.8)
    assert close(w, [[0.0, 0.8, 1.0], [0.0, 0.0, 0.0]])


def test_rollout_correction_errors():
    with pytest.raises(ValueError, match="is_level='tok'"):
        RolloutCorrection(is_level="tok")
    with pytest.raises(ValueError, match="mask_level='seq'"):
        RolloutCorrection(mask_level="seq")
    with pytest.raises(ValueError, match="is_threshold=0"):
        RolloutCorrection(is_threshold=0)
    with pytest.raises(ValueError, match="mask_low=1.5"):
        RolloutCorrection(mask_low=1.5, mask_high=2.0)
    with pytest.raises(ValueError, match="must all be"):
        rollout_correction(OLD, ROLLOUT[:, :2], MASK, RolloutCorrection())


def test_grpo_loss_weights_only_the_policy_term():
    lp = t([[L(0.45), L(0.42), L(0.3)], [L(0.25), L(0.2), 0.0]], grad=True)
    ref = t([[L(0.4), L(0.4), L(0.4)], [L(0.2), L(0.2), 0.0]])
    adv = t([1.0, -1.0])
    off = GRPOLossConfig()
    tis = GRPOLossConfig(rollout_correction=RolloutCorrection(is_level="token", is_threshold=1.5))
    base, m0 = grpo_loss(lp, OLD, ref, adv, MASK, 5.0, off)
    same, m1 = grpo_loss(lp, OLD, ref, adv, MASK, 5.0, off, rollout_logprobs=ROLLOUT)
    assert torch.equal(base, same)  # correction off: today's loss exactly, plus the mismatch metrics
    assert "rollout_kl_sum" in m1 and "rollout_kl_sum" not in m0
    got, m2 = grpo_loss(lp, OLD, ref, adv, MASK, 5.0, tis, rollout_logprobs=ROLLOUT)
    pg, _ = ppo_policy_loss(lp, OLD, adv, 0.2, 0.2)
    kl_only = base - aggregate(pg, MASK, "token-mean", 5.0)
    w = torch.tensor([[1.5, 0.8, 1.0], [1.5, 0.5, 0.0]], dtype=D)
    assert got.item() == pytest.approx((aggregate(pg * w, MASK, "token-mean", 5.0) + kl_only).item())
    assert m2["policy_loss_sum"].item() == pytest.approx((pg * w * MASK).sum().item())
