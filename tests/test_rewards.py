"""Composite rewards (``reward.functions``): weighted sums and whitening by hand, the text reward
functions, how dynamic sampling judges a group, and the config checks."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.composite_reward import RewardTerm, combine_rewards, whiten_scores
from alignment.config import validate
from alignment.data.tasks import Problem
from alignment.rewards.policy import ppo_on_task, process_reward_weight, reward_terms
from alignment.rewards.text import format_score, length_score, text_scores
from alignment.data.samples import Sample
from alignment.schema import ConfigError
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

    def summed_with(other):  # the other rank's share of each all-reduce: (count, sum), then centred squares
        seen = []

        def all_reduce(sums):
            if len(sums) == 2:
                total = [sums[0] + other.numel(), sums[1] + other.sum().item()]
                seen.append(total[1] / total[0])
                return total
            return [sums[0] + ((other - seen[0]) ** 2).sum().item()]
        return all_reduce

    assert torch.allclose(whiten_scores(a, summed_with(b)), expected[:2])
    assert torch.allclose(whiten_scores(b, summed_with(a)), expected[2:])
    # constant scores and single samples whiten to 0 (no signal), never to a division by zero
    assert torch.equal(whiten_scores(torch.full((3,), 7.0)), torch.zeros(3))
    assert torch.equal(whiten_scores(torch.tensor([5.0])), torch.zeros(1))
    # a spread of 0.005 around 20 (reward-model logits): one float32 pass of sum and squares cancels to 0
    x = 20 + 0.005 * torch.randn(1024, generator=torch.Generator().manual_seed(0))
    w = whiten_scores(x.float())
    assert abs(w.mean().item()) < 1e-3 and abs(w.std().item() - 1.0) < 1e-3
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
    from alignment.trainers.grpo_hooks import informative

    plain = [RewardTerm("correctness"), RewardTerm("length", 0.5)]
    # correctness up by 0.5 where length is down by 1.0 x 0.5: the sum is constant, no advantage
    part = {"correctness": torch.tensor([0.5, 0.0]), "length": torch.tensor([-1.0, 0.0])}
    assert not informative(part, plain, 2)
    assert informative({"correctness": torch.tensor([1.0, 0.0]), "length": torch.tensor([-1.0, 0.0])}, plain, 2)
    # a term weighted 0 never makes a group informative
    assert not informative({"correctness": torch.tensor([1.0, 1.0]), "length": torch.tensor([-1.0, 0.0])},
                           [RewardTerm("correctness"), RewardTerm("length", 0.0)], 2)
    # a whitened term: its scale is only known over the batch, so any weighted term varying counts
    assert informative(part, [RewardTerm("correctness", whiten=True), RewardTerm("length", 0.5)], 2)


def test_grpo_step_hooks_are_what_the_config_turns_on():
    """The named hooks of GRPO's step (alignment/trainers/grpo_hooks.py): each feature's hook is set exactly when its
    setting is, and does what the step did by branch before."""
    from alignment.trainers.grpo_hooks import step_hooks

    plain = step_hooks(cfg())
    assert plain.keep_group is None and plain.dense is None and not plain.routes.replay and not plain.episodes
    dapo_cfg = cfg(name="dapo")
    dapo, g = step_hooks(dapo_cfg), dapo_cfg.rollout.group_size
    assert dapo.keep_group is not None and dapo.dense is None
    # DAPO's filter on its own terms (correctness + the overlong penalty): a group whose sums are equal is dropped
    # (here a right answer cut short balances a wrong one in time), one whose sums differ kept
    right, wrong = torch.tensor([1.0] + [0.0] * (g - 1)), torch.tensor([-1.0] + [0.0] * (g - 1))
    assert not dapo.keep_group({"correctness": right, "overlong": wrong})
    assert dapo.keep_group({"correctness": right, "overlong": torch.zeros(g)})
    dense = step_hooks(cfg("reward.functions=[{name: correctness}, {name: process_reward, weight: 0.5}]",
                           "reward.process_reward_model=/prm"))
    assert dense.dense is not None and dense.keep_group is None
    assert step_hooks(cfg("algorithm.routing_replay=r2")).routes.replay
    assert step_hooks(cfg("rollout.agent=tests.agent_examples:three_turns")).episodes
    assert step_hooks(cfg("rollout.environment=tests.dist.echo_env:build")).episodes
    # routing: a batch without recorded routes is compared with nothing; a dense model has no routing at all
    assert plain.routes.in_updates(torch.nn.Linear(1, 1), {"input_ids": torch.zeros(1, 1)}) is None


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
    # the dense process reward: GRPO (and Dr.GRPO) with step-by-step prompts, PPO
    c = cfg("reward.functions=[{name: correctness}, {name: process_reward, weight: 0.5}]",
            "reward.process_reward_model=/prm", "data.instruction=Solve it step by step.")
    assert process_reward_weight(c) == 0.5 and process_reward_weight(cfg()) == 0.0
    validate(c, world_size=2, hf_config=SMOLLM2)
    validate(cfg("reward.functions=[{name: process_reward}]", "reward.process_reward_model=/prm",
                 "algorithm=dr_grpo"), world_size=2, hf_config=SMOLLM2)
    validate(cfg("reward.functions=[{name: reward_model}, {name: process_reward}]", "reward.process_reward_model=/prm",
                 "model.reward_model_path=/rm", name="ppo"), world_size=2, hf_config=SMOLLM2)
    # PPO on a task: graded answers, no reward model; multi-turn tool episodes and an instruction allowed
    on_task = cfg("reward.functions=[{name: correctness}, {name: environment, weight: 0.2}]", "data=arithmetic_tools",
                  "model.critic_path=/critic", "model.reward_model_path=''", "rollout.environment=tools",
                  "rollout.max_turns=3", "data.instruction=Use the calculator.", name="ppo")
    assert ppo_on_task(on_task) and not ppo_on_task(cfg("model.reward_model_path=/rm", name="ppo"))
    validate(on_task, world_size=2, hf_config=SMOLLM2)


P = "reward.process_reward_model=/prm"


@pytest.mark.parametrize("overrides,name,message", [
    (["reward.functions=[{name: bleu}]"], "grpo", r"reward.functions names 'bleu': valid are correctness, format, length, environment, math_verify"),
    (["reward.functions=[{name: format}, {name: format, weight: 2}]"], "grpo", "each name may appear once"),
    (["reward.functions=[{name: correctness, weight: 0}]"], "grpo", "every weight is 0"),
    (["reward.functions=[{name: correctness}, {name: length, weight: inf}]"], "grpo",
     r"reward.functions\[length\].weight=inf: must be a finite number"),
    (["reward.functions=[{name: correctness}, {name: reward_model}]"], "ppo",
     "with a reward_model term PPO trains on dpo_en_demo's prompts, which have no answers"),
    (["reward.functions=[{name: correctness}]", "model.reward_model_path=''"], "ppo",
     "model.critic_path and model.reward_model_path are empty: PPO's critic starts from one"),
    (["reward.functions=[{name: format}]", "data.task=length"], "grpo", "data.task=length asks for no answer format"),
    (["reward.functions=[{name: reward_model}]"], "grpo", "model.reward_model_path is empty"),
    (["reward.functions=[{name: length}]"], "dpo", "algorithm.name=dpo trains on fixed data and computes no rewards"),
    # the dense process reward (P: its model's path)
    ([P], "grpo", r"reward.process_reward_model=/prm is set, but reward.functions has "
     r"no process_reward term to use it; add \{name: process_reward, weight: 1.0\}"),
    (["reward.functions=[{name: process_reward}]"], "grpo", "reward.process_reward_model is empty"),
    (["reward.functions=[{name: process_reward}]", P], "rft", "algorithm.name=rft judges whole samples"),
    (["reward.functions=[{name: process_reward, whiten: true}]", P], "grpo", r"whiten=true: its step rewards"),
    (["reward.functions=[{name: process_reward}]", P, "algorithm.advantage_estimator=rloo"], "grpo",
     "defined for algorithm.advantage_estimator in grpo, grpo_no_std, not rloo"),
    (["reward.functions=[{name: correctness}, {name: process_reward}]", P, "algorithm.dynamic_sampling=true"], "grpo",
     "set algorithm.dynamic_sampling=false"),
    (["reward.functions=[{name: process_reward}]", P, "algorithm.step_separator=''"], "grpo",
     "algorithm.step_separator is empty"),
    ([P], "dpo", "reward.process_reward_model is set, but algorithm.name=dpo trains on fixed data"),
    (["data.instruction=Think."], "ppo", "data.instruction is set, but algorithm.name=ppo does not ask data.task's "
     "questions"),
])
def test_reward_config_errors_name_the_field(overrides, name, message):
    extra = ["model.reward_model_path=/rm"] if name == "ppo" and not any("reward_model_path" in o for o in overrides) \
        else []
    with pytest.raises(ConfigError, match=message):
        validate(cfg(*overrides, *extra, name=name), world_size=2, hf_config=SMOLLM2)


def test_rejection_sampling_keeps_distinct_accepted_answers_by_hand():
    from alignment.algorithms.rejection_sampling import accepted_indices

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.9])
    texts = ["4", "5", " 4", "four", "x", "y", "a", "b", "c"]
    # problem 0: "4" and " 4" are one answer; problem 1: nothing accepted; problem 2: by threshold
    assert accepted_indices(rewards, 3, 1.0, texts) == [[0], [3], []]
    assert accepted_indices(rewards, 3, 1.0) == [[0, 2], [3], []]
    assert accepted_indices(rewards.reshape(-1)[:6], 3, 1.0, texts[:6]) == [[0], [3]]
    assert accepted_indices(rewards, 3, 0.5, texts) == [[0], [3], [7, 8]]
    assert accepted_indices(rewards, 9, 2.0) == [[]]  # nothing reaches the threshold
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        accepted_indices(rewards, 4, 1.0)
    with pytest.raises(ValueError, match="2 texts for 9 rewards"):
        accepted_indices(rewards, 3, 1.0, ["a", "b"])


def test_rft_config_and_its_errors():
    c = cfg(name="rft")
    assert (c.algorithm.name, c.algorithm.accept_threshold) == ("rft", 1.0) and "kl_coef" not in c.algorithm
    validate(c, world_size=2, hf_config=SMOLLM2)
    validate(cfg("rollout.group_size=1", "rollout.max_staleness=1", name="rft"), world_size=2, hf_config=SMOLLM2)
    for overrides, message in [
        (["algorithm.accept_threshold=nan"], "algorithm.accept_threshold=nan: give a finite reward"),
        (["reward.functions=[{name: correctness, whiten: true}]"], r"reward.functions \['correctness'\] whiten"),
        (["rollout.prompts_per_step=3"], "rollout.prompts_per_step=3 must be a multiple of the data-parallel size 2"),
        (["rollout.temperature=0"], "rejection sampling draws group_size samples per problem at a temperature"),
        (["parallel.pipeline_model_parallel_size=2", "trainer.sequence_packing=false"],
         "set trainer.sequence_packing=true"),
        (["reward.functions=[{name: correctness}, {name: length, weight: 0.1}]"],
         "algorithm.accept_threshold=1.0 is above the best reward reward.functions can give"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0: must be >= 1"),
        (["algorithm.overlong_buffer_len=64"],
         r"algorithm.overlong_buffer_len=64 must be in \(0, rollout.max_tokens=48\]"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides, name="rft"), world_size=2, hf_config=SMOLLM2)
    # a length reward with a negative weight raises the best reward: 1 + 0.5 = 1.5 >= the threshold
    validate(cfg("reward.functions=[{name: correctness}, {name: length, weight: -0.5}]",
                 "algorithm.accept_threshold=1.5", name="rft"), world_size=2, hf_config=SMOLLM2)
    # the overlong range is checked for every RL job (a reward term of each), PPO included
    with pytest.raises(ConfigError, match="algorithm.overlong_buffer_len=100"):
        validate(cfg("algorithm.overlong_buffer_len=100", "model.reward_model_path=/rm", name="ppo"), world_size=2,
                 hf_config=SMOLLM2)
    with pytest.raises(ConfigError, match="dynamic_sampling with a reward_model term"):
        validate(cfg("algorithm.dynamic_sampling=true", "model.reward_model_path=/rm", "reward.functions=[{name: "
                     "reward_model}]", "parallel.pipeline_model_parallel_size=2", "trainer.sequence_packing=false"),
                 world_size=2, hf_config=SMOLLM2)


def test_online_dpo_pairs_by_hand():
    from alignment.algorithms.preference_pairs import best_worst_pairs

    # n = 4: best 0.9 at 1 vs worst 0.0 at 2; the first of equal maxima / minima is taken;
    # all equal: a tie, no pair
    rewards = torch.tensor([0.5, 0.9, 0.0, 0.3, 1.0, 0.0, 1.0, 0.0, 0.2, 0.2, 0.2, 0.2])
    assert best_worst_pairs(rewards, 4) == [(1, 2), (4, 5), None]
    # n = 2: a pair exactly when the two differ, whichever comes first
    assert best_worst_pairs(torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, -1.0]), 2) == [(1, 0), None, (4, 5)]
    assert best_worst_pairs(torch.zeros(6), 3) == [None, None]  # all equal: nothing to learn from
    with pytest.raises(ValueError, match="a preference pair needs >= 2 samples per prompt"):
        best_worst_pairs(torch.zeros(3), 1)
    with pytest.raises(ValueError, match="not a whole number of groups of 4"):
        best_worst_pairs(torch.zeros(6), 4)


def test_online_dpo_config_and_its_errors():
    c = cfg(name="online_dpo")
    a = c.algorithm
    assert (a.name, a.loss_type, a.ref_update) == ("online_dpo", "sigmoid", "initial") and "kl_coef" not in a
    validate(c, world_size=2, hf_config=SMOLLM2)
    validate(cfg("algorithm.ref_update=iteration", "algorithm.loss_type=ipo", "model.reward_model_path=/rm",
                 "reward.functions=[{name: reward_model, whiten: true}, {name: correctness}]", name="online_dpo"),
             world_size=2, hf_config=SMOLLM2)
    for name in ("rft", "online_dpo"):  # no KL term of their own (online DPO's KL strength is algorithm.beta)
        with pytest.raises(ConfigError, match=f"algorithm.kl_coef=0.04 is set, but algorithm.name={name} has no such"):
            cfg("algorithm.kl_coef=0.04", name=name)
    for overrides, message in [
        (["algorithm.loss_type=dpo"], "algorithm.loss_type='dpo': valid values are sigmoid"),
        (["algorithm.beta=0"], "algorithm.beta=0.0: must be > 0"),
        (["rollout.group_size=1"], "online DPO pairs the best and worst of group_size >= 2 samples"),
        (["algorithm.ref_update=epoch"], "algorithm.ref_update='epoch': valid values are initial, iteration"),
        (["algorithm.ref_update=iteration", "algorithm.iteration_steps=0"], "algorithm.iteration_steps=0"),
        (["algorithm.ref_update=iteration", "algorithm.loss_type=simpo"],
         "algorithm.loss_type=simpo uses no reference"),
        (["algorithm.ref_update=iteration", "model.lora.rank=8"], "a LoRA job's reference is the frozen base"),
        (["rollout.prompts_per_step=3"], "rollout.prompts_per_step=3 must be a multiple of the data-parallel size 2"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate(cfg(*overrides, name="online_dpo"), world_size=2, hf_config=SMOLLM2)


def test_rft_and_online_dpo_refuse_expert_parallelism():
    """Their ranks train on different numbers of rows, and the experts' all-to-all spans them."""
    from tests.dist.tiny_models import tiny_qwen3_moe_config

    moe = tiny_qwen3_moe_config()
    for name, what in (("rft", "accepted samples"), ("online_dpo", "pairs")):
        validate(cfg("data.task=length", name=name), world_size=2, hf_config=moe)  # EP 1: fine
        with pytest.raises(ConfigError, match=f"algorithm.name={name} trains on however many {what}"):
            validate(cfg("parallel.expert_model_parallel_size=2", "data.task=length", name=name), world_size=2,
                     hf_config=moe)
