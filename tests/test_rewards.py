"""Composite rewards (``reward.functions``): weighted sums and whitening by hand, the text reward
functions, how dynamic sampling judges a group, and the config checks."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.composite_reward import RewardTerm, combine_rewards, whiten_scores
from alignment.config import ConfigError, reward_terms, validate
from alignment.data.reward_functions import format_score, length_score, text_scores
from alignment.data.tasks import Problem
from alignment.rollout.base import Sample
from tests.test_config import SMOLLM2, cfg


def test_weighted_sum_by_hand():
    scores = {"correctness": torch.tensor([1.0, 0.0, 1.0, 0.0]), "length": torch.tensor([-0.5, -0.25, 0.0, -1.0])}
    terms = [RewardTerm("correctness", 1.0), RewardTerm("length", 0.1)]
    assert torch.allclose(combine_rewards(scores, terms), torch.tensor([0.95, -0.025, 1.0, -0.1]))
    # a term the config does not name is ignored; a weight of 0 drops a term
    assert torch.equal(combine_rewards({**scores, "format": torch.ones(4)}, [RewardTerm("length", 0.0),
                                                                             RewardTerm("correctness", 2.0)]),
                       torch.tensor([2.0, 0.0, 2.0, 0.0]))


def test_whitening_by_hand_and_over_ranks():
    # [1, 2, 3, 4]: mean 2.5, Bessel std sqrt((2.25 + 0.25 + 0.25 + 2.25) / 3) = sqrt(5/3)
    std = math.sqrt(5 / 3)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / (std + 1e-6)
    assert torch.allclose(whiten_scores(torch.tensor([1.0, 2.0, 3.0, 4.0])), expected)
    # two data-parallel ranks holding [1, 2] and [3, 4]: each whitens by the global statistics
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])

    def summed_with(other):
        return lambda sums: [x + y for x, y in zip(sums, [2.0, other.sum().item(), (other ** 2).sum().item()])]

    assert torch.allclose(whiten_scores(a, summed_with(b)), expected[:2])
    assert torch.allclose(whiten_scores(b, summed_with(a)), expected[2:])
    # constant scores and single samples whiten to 0 (no signal), never to a division by zero
    assert torch.equal(whiten_scores(torch.full((3,), 7.0)), torch.zeros(3))
    assert torch.equal(whiten_scores(torch.tensor([5.0])), torch.zeros(1))
    # whitened and plain terms together: 0.5 * white(rm) + 1.0 * correctness
    scores = {"reward_model": torch.tensor([1.0, 2.0, 3.0, 4.0]), "correctness": torch.tensor([0.0, 1.0, 0.0, 1.0])}
    out = combine_rewards(scores, [RewardTerm("reward_model", 0.5, whiten=True), RewardTerm("correctness")])
    assert torch.allclose(out, 0.5 * expected + scores["correctness"])


def test_combination_refuses_bad_input():
    with pytest.raises(ValueError, match="reward.functions is empty"):
        combine_rewards({"a": torch.ones(2)}, [])
    with pytest.raises(ValueError, match=r"no scores for reward function\(s\) \['format'\]"):
        combine_rewards({"a": torch.ones(2)}, [RewardTerm("format")])
    with pytest.raises(ValueError, match="different numbers of samples"):
        combine_rewards({"a": torch.ones(2), "b": torch.ones(3)}, [RewardTerm("a"), RewardTerm("b")])
    with pytest.raises(ValueError, match=r"reward.functions\[a\].weight=nan"):
        RewardTerm("a", float("nan"))


def _sample(text: str, response_tokens: int) -> Sample:
    return Sample([1, 2], list(range(response_tokens)), [0.0] * response_tokens, text, True)


def test_text_reward_functions_by_hand():
    for text in ("42", " -7. ", "$1,234", "3.50\n", "\u22125"):
        assert format_score("arithmetic", text) == 1.0, text
    for text in ("The answer is 4", "4 + 5 = 9", "", "4 5", "nine"):
        assert format_score("gsm8k", text) == 0.0, text
    with pytest.raises(ValueError, match="task 'length' asks for no answer format"):
        format_score("length", "12")
    assert length_score(12, 48) == -0.25 and length_score(0, 48) == 0.0 and length_score(48, 48) == -1.0
    p = Problem("What is 2 + 3?", "5", "gsm8k")
    samples = [_sample("5", 1), _sample("It is 5.", 4), _sample("6", 12)]
    assert text_scores("correctness", [p] * 3, samples, 48).tolist() == [1.0, 1.0, 0.0]
    assert text_scores("format", [p] * 3, samples, 48).tolist() == [1.0, 0.0, 1.0]
    assert torch.equal(text_scores("length", [None] * 3, samples, 48), torch.tensor([-1 / 48, -4 / 48, -0.25]))
    with pytest.raises(ValueError, match="these prompts have none"):
        text_scores("correctness", [None] * 3, samples, 48)
    with pytest.raises(ValueError, match="unknown text reward function 'reward_model'"):
        text_scores("reward_model", [p] * 3, samples, 48)


def test_dynamic_sampling_judges_a_group_by_its_weighted_terms():
    from alignment.trainers.grpo import _informative

    plain = [RewardTerm("correctness"), RewardTerm("length", 0.5)]
    # correctness up by 0.5 where length is down by 1.0 x 0.5: the sum is constant, no advantage
    part = {"correctness": torch.tensor([0.5, 0.0]), "length": torch.tensor([-1.0, 0.0])}
    assert not _informative(part, plain, 2)
    assert _informative({"correctness": torch.tensor([1.0, 0.0]), "length": torch.tensor([-1.0, 0.0])}, plain, 2)
    # a term weighted 0 never makes a group informative
    assert not _informative({"correctness": torch.tensor([1.0, 1.0]), "length": torch.tensor([-1.0, 0.0])},
                            [RewardTerm("correctness"), RewardTerm("length", 0.0)], 2)
    # a whitened term: its scale is only known over the batch, so any weighted term varying counts
    assert _informative(part, [RewardTerm("correctness", whiten=True), RewardTerm("length", 0.5)], 2)


def test_reward_config_defaults_and_overrides():
    assert [t.name for t in reward_terms(cfg())] == ["correctness"]
    assert [t.name for t in reward_terms(cfg(name="ppo"))] == ["reward_model"]
    c = cfg("reward.functions=[{name: correctness}, {name: format, weight: 0.2, whiten: true}, "
            "{name: length, weight: 0.1}]")
    assert reward_terms(c) == [RewardTerm("correctness", 1.0), RewardTerm("format", 0.2, True),
                               RewardTerm("length", 0.1)]
    validate(c, world_size=2, hf_config=SMOLLM2)
    validate(cfg("model.reward_model_path=/rm", "reward.functions=[{name: correctness}, "
                 "{name: reward_model, weight: 0.5, whiten: true}]"), world_size=2, hf_config=SMOLLM2)
    validate(cfg("reward.functions=[{name: reward_model}, {name: length, weight: 0.1}]",
                 "model.reward_model_path=/rm", name="ppo"), world_size=2, hf_config=SMOLLM2)


@pytest.mark.parametrize("overrides,name,message", [
    (["reward.functions=[{name: bleu}]"], "grpo", r"reward.functions names \['bleu'\]: valid names are correctness"),
    (["reward.functions=[{name: format}, {name: format, weight: 2}]"], "grpo", "each function may appear once"),
    (["reward.functions=[{name: correctness, weight: 0}]"], "grpo", "every weight is 0"),
    (["reward.functions=[{name: correctness}, {name: length, weight: inf}]"], "grpo",
     r"reward.functions\[length\].weight=inf: must be a finite number"),
    (["reward.functions=[{name: correctness}]"], "ppo", "PPO trains on dpo_en_demo's prompts, which have no answers"),
    (["reward.functions=[{name: format}]", "data.task=length"], "grpo", "data.task=length asks for no answer format"),
    (["reward.functions=[{name: reward_model}]"], "grpo", "model.reward_model_path is empty"),
    (["reward.functions=[{name: length}]"], "dpo", "algorithm.name=dpo trains on fixed data and computes no rewards"),
])
def test_reward_config_errors_name_the_field(overrides, name, message):
    extra = ["model.reward_model_path=/rm"] if name == "ppo" else []
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*overrides, *extra, name=name), world_size=2, hf_config=SMOLLM2)
