"""Process reward model pieces by hand: steps of a response, their automatic arithmetic labels,
label placement at step ends and the step-level BCE (gradient parity through Megatron is in
``test_offline_invariance.py``, kind ``prm``)."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.prm_loss import place_step_labels, prm_loss
from alignment.data.step_labels import arithmetic_step_label
from alignment.trainers.process_reward import ProcessRewardObjective


@pytest.mark.parametrize("step,label", [
    ("3 + 4 = 7", 1), ("7 - 9 = 2", 0), ("7 - 9 = -2", 1), ("2 * (3 + 4) = 14\n", 1), ("1 + 2 + 3 = 6.", 1),
    ("So the answer is 12.", None), ("3 + 4 = 7, 7 + 5 = 13", 0), ("\u22125 + 2 = \u22123", 1), ("4 \u00d7 3 = 12", 1),
    ("Step 1: 12 - 5 = 8", 0), ("6 / 2 = 3", 1), ("1.5 + 2 = 3.5", 1), ("3 + 4 = 7.9", 0), ("So 3 + 4 = 7.", 1),
    ("5 + 9 + 7 = 19, we", 0), ("-4 + 1 = -3", 1),
    # not an equation standing on its own: inside a number, after a variable, a chain or a reversed form
    ("1,000 - 1 = 999", None), ("1 + 1 = 1,000", None), ("x - 3 = 4", None), ("a2 + 3 = 5", None),
    ("12 = 3 * 4", None), ("3 + 4 = 7 + 5 = 12", None),
])
def test_arithmetic_step_labels_by_hand(step, label):
    assert arithmetic_step_label(step) == label


def test_label_placement_and_loss_by_hand():
    target, mask = place_step_labels([[1, 3], [2]], [[1, 0], [0]], 5)
    assert target.tolist() == [[0, 1, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert mask.tolist() == [[0, 1, 0, 1, 0], [0, 0, 1, 0, 0]]
    values = torch.tensor([[5.0, 2.0, 5.0, -1.0, 5.0], [5.0, 5.0, 0.0, 5.0, 5.0]])  # unmasked positions ignored
    # BCE(2, 1) = log(1 + e^-2), BCE(-1, 0) = log(1 + e^-1), BCE(0, 0) = log 2; mean over the 3 steps
    expected = (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1)) + math.log(2)) / 3
    assert prm_loss(values, target, mask, 3.0).item() == pytest.approx(expected, rel=1e-6)
    # summed over two "ranks" holding one row each, normalised by the global count: the same
    halves = [prm_loss(values[i:i + 1], target[i:i + 1], mask[i:i + 1], 3.0) for i in range(2)]
    assert sum(halves).item() == pytest.approx(expected, rel=1e-6)
    v = values.clone().requires_grad_(True)
    prm_loss(v, target, mask, 3.0).backward()  # d/dv BCE = (sigmoid(v) - y) / 3 at the step ends only
    grad = (torch.sigmoid(values) - target) * mask / 3
    assert torch.allclose(v.grad, grad)
    obj = ProcessRewardObjective()
    batch = {"step_labels": target, "step_mask": mask}
    assert obj.normalizer(batch) == (3.0,)
    _, sums = obj.loss(batch, {"values": values}, (3.0,))
    m = obj.metrics({k: float(x) for k, x in sums.items()})
    # logits 2 (label 1: right), -1 (label 0: right), 0 (label 0: sigmoid 0.5 is not > 0.5, so right)
    assert m["step_accuracy"] == 1.0 and m["positive_fraction"] == pytest.approx(1 / 3)
    assert m["loss"] == pytest.approx(expected, rel=1e-6)


def test_bad_step_labels_are_refused():
    with pytest.raises(ValueError, match="row 0: 2 step ends for 1 labels"):
        place_step_labels([[1, 2]], [[1]], 4)
    with pytest.raises(ValueError, match="step label 2 must be 0 or 1"):
        place_step_labels([[1]], [[2]], 4)
    with pytest.raises(ValueError, match=r"step end 4 outside \[0, 4\)"):
        place_step_labels([[4]], [[1]], 4)
    with pytest.raises(ValueError, match="a position ends two steps"):
        place_step_labels([[1, 1]], [[1, 0]], 4)
    with pytest.raises(ValueError, match="num_steps=0.0 must be > 0"):
        prm_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2), 0)
