"""Your own advantage estimator and policy loss by import path (alignment/algorithms/hooks.py), your own whole
algorithm by import path (alignment/algorithms/registry.py), and the three in examples/custom_algorithm: their
values by hand, their contracts checked before start, and GRPO jobs that train with them."""

from __future__ import annotations

import json

import pytest
import torch

from alignment.algorithms import hooks, registry
from alignment.algorithms.advantages import get_advantage_estimator
from alignment.algorithms.policy_loss import policy_loss, ppo_policy_loss
from alignment.schema import ConfigError
from examples.custom_algorithm.advantages import median_baseline
from examples.custom_algorithm.losses import unclipped_surrogate
from examples.custom_algorithm.quantile_grpo import ALGORITHM, QuantileGRPOConfig, quantile_advantages
from tests.conftest import Job, run_jobs
from tests.dist.tiny_llama import save_tiny_hf_dir

MEDIAN = "examples.custom_algorithm.advantages:median_baseline"
UNCLIPPED = "examples.custom_algorithm.losses:unclipped_surrogate"
QUANTILE = "examples.custom_algorithm.quantile_grpo:ALGORITHM"
PROBE = list(hooks.PROBE_REWARDS)  # the contract's check before start calls the estimator on these


def test_median_baseline_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 0.0, 3.0])
    # groups of 3: medians 0.5 and 1.0; the group of 2 (the last two, on their own below) takes the lower, 0.0
    assert median_baseline(rewards[:6], 3).tolist() == [0.5, -0.5, 0.0, 1.0, 0.0, 0.0]
    assert median_baseline(rewards[6:], 2).tolist() == [0.0, 3.0]
    with pytest.raises(ValueError, match="7 rewards are not groups of 3"):
        median_baseline(rewards[:7], 3)
    assert get_advantage_estimator(MEDIAN) is median_baseline  # the job's lookup


def test_unclipped_surrogate_is_ppo_inside_the_clip_range_and_keeps_going_outside():
    """Ratios 1.1 and 0.9 (inside 1 +- 0.2): loss and gradient equal PPO's. A ratio of 1.5 with A = 1: PPO's loss is
    the constant -1.2 (clipped, no gradient), the unclipped one -1.5 with gradient -1.5 (d/dlogp of -exp(.) * A)."""
    old = torch.zeros(1, 3)
    logprobs = torch.log(torch.tensor([[1.1, 0.9, 1.5]])).requires_grad_()
    adv, mask = torch.tensor([1.0]), torch.ones(1, 3)
    mine, clipped = policy_loss(UNCLIPPED, logprobs, old, adv, mask, 0.2, 0.2)
    (grad,) = torch.autograd.grad(mine.sum(), logprobs)
    ppo, ppo_clipped = ppo_policy_loss(logprobs, old, adv, 0.2, 0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logprobs)
    assert torch.allclose(mine[0, :2], ppo[0, :2]) and torch.allclose(grad[0, :2], ppo_grad[0, :2])
    assert mine[0, 2].item() == pytest.approx(-1.5) and grad[0, 2].item() == pytest.approx(-1.5)
    assert ppo[0, 2].item() == pytest.approx(-1.2) and ppo_grad[0, 2].item() == 0.0 and ppo_clipped[0, 2]
    assert not clipped.any()
    with pytest.raises(ValueError, match="dual clip"):
        policy_loss(UNCLIPPED, logprobs, old, adv, mask, 0.2, 0.2, clip_ratio_c=3.0)


def returns_a_scalar(rewards, group_size):
    return rewards.mean()


def detached_loss(logprobs, old_logprobs, advantages, response_mask, low, high):
    loss = -advantages[:, None].expand_as(logprobs).clone()
    return loss, torch.zeros_like(loss, dtype=torch.bool)


def float_clip_mask(logprobs, old_logprobs, advantages, response_mask, low, high):
    return -logprobs * advantages[:, None], torch.zeros_like(logprobs)


@pytest.mark.parametrize("path, hook, says", [
    ("median_baseline", hooks.advantage_estimator, "give module.path:function"),
    ("examples.nowhere:fn", hooks.advantage_estimator,
     "module examples.nowhere does not import (ModuleNotFoundError: No module named 'examples.nowhere')"),
    ("tests.test_algorithm_hooks:returns_a_scalar", hooks.advantage_estimator,
     "returned shape () torch.float32 for rewards [6], group_size=3; the contract is fn(rewards [batch], group_size)"),
    ("tests.test_algorithm_hooks:returns_a_scalar", hooks.policy_loss,
     "failed on logprobs [2, 3] (TypeError: returns_a_scalar() takes 2 positional arguments but 6 were given)"),
    ("tests.test_algorithm_hooks:detached_loss", hooks.policy_loss, "its loss has no gradient through logprobs"),
    ("tests.test_algorithm_hooks:float_clip_mask", hooks.policy_loss,
     "returned ((2, 3) torch.float32, (2, 3) torch.float32) for logprobs [2, 3]"),
])
def test_a_hook_off_its_contract_is_one_line_naming_the_field(path, hook, says):
    field = "algorithm.policy_loss" if hook is hooks.policy_loss else "algorithm.advantage_estimator"
    with pytest.raises(ConfigError) as e:
        hook(path)
    assert str(e.value).startswith(f"{field}={path}: ") and says in str(e.value) and "\n" not in str(e.value), e.value


def test_quantile_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 3.0, 0.0])
    # groups of 4: sorted [0, 0.5, 1, 2] and [0, 1, 1, 3]; "lower" quantiles: 0.5 -> 0.5 and 1; 0 -> the minimum;
    # 1 -> the maximum; 0.75 -> index floor(0.75 * 3) = 2: 1 and 1
    assert quantile_advantages(rewards, 4, 0.5).tolist() == [0.5, -0.5, 0.0, 1.5, 0.0, 0.0, 2.0, -1.0]
    assert quantile_advantages(rewards, 4, 0.0).tolist() == [1.0, 0.0, 0.5, 2.0, 1.0, 1.0, 3.0, 0.0]
    assert quantile_advantages(rewards, 4, 1.0).tolist() == [-1.0, -2.0, -1.5, 0.0, -2.0, -2.0, 0.0, -3.0]
    assert quantile_advantages(rewards, 4, 0.75).tolist() == [0.0, -1.0, -0.5, 1.0, 0.0, 0.0, 2.0, -1.0]
    assert torch.equal(quantile_advantages(rewards[:6], 3, 0.5), median_baseline(rewards[:6], 3))  # the median
    with pytest.raises(ValueError, match="7 rewards are not groups of 3"):
        quantile_advantages(rewards[:7], 3, 0.5)


class NotARecord:
    pass


NAMED_LIKE_GRPO = registry.Algorithm("grpo", "online", "examples.custom_algorithm.quantile_grpo", "x")
PPO_JOB = registry.Algorithm("my_ppo", "ppo", "examples.custom_algorithm.quantile_grpo", "x")
NO_TRAINER = registry.Algorithm("no_trainer", "online", "examples.custom_algorithm.losses", "x")


@pytest.mark.parametrize("path, says", [
    ("examples.nowhere:ALGORITHM", "ModuleNotFoundError: No module named 'examples.nowhere'"),
    ("tests.test_algorithm_hooks:NotARecord", "tests.test_algorithm_hooks.NotARecord is not an "
                                              "alignment.algorithms.registry.Algorithm record"),
    ("tests.test_algorithm_hooks:NAMED_LIKE_GRPO", "its record's name 'grpo' is a built-in algorithm's"),
    ("tests.test_algorithm_hooks:PPO_JOB", "job='ppo'; an algorithm of your own runs as one of online, offline"),
    ("tests.test_algorithm_hooks:NO_TRAINER", "its trainer module examples.custom_algorithm.losses has no collect / "
                                              "train"),
])
def test_your_own_algorithm_off_its_contract_is_one_line(path, says):
    with pytest.raises(ConfigError) as e:
        registry.get(path)
    assert str(e.value).startswith(f"algorithm.name={path}: ") and says in str(e.value), e.value


def test_your_own_algorithm_has_its_own_section_and_reads_as_grpo():
    from alignment.compose import compose_job
    from alignment.config import job_config

    assert registry.get(QUANTILE) is ALGORITHM and QUANTILE not in registry.ALGORITHMS  # not added to the built-ins
    comp = compose_job("grpo", [f"algorithm.name={QUANTILE}", "algorithm.baseline_quantile=0.25",
                                "rollout.temperature=0.9"])
    a = job_config(comp.cfg).algorithm
    assert type(a) is QuantileGRPOConfig and (a.baseline_quantile, a.clip_ratio, a.kl_coef) == (0.25, 0.2, 0.04)
    assert comp.dropped == {"algorithm.advantage_estimator": "grpo"}  # grpo.yaml's, not this algorithm's
    with pytest.raises(ConfigError, match=f"algorithm.advantage_estimator=rloo is set, but algorithm.name={QUANTILE} "
                                          "has no such setting"):
        compose_job("grpo", [f"algorithm.name={QUANTILE}", "algorithm.advantage_estimator=rloo"])
    with pytest.raises(ConfigError, match=f"data.columns is set, but algorithm.name={QUANTILE} does not read it"):
        compose_job("grpo", [f"algorithm.name={QUANTILE}", "data.columns={prompt: q}"])  # read as grpo reads


def test_the_examples_keep_the_contract():
    assert hooks.advantage_estimator(MEDIAN) is median_baseline
    assert hooks.policy_loss(UNCLIPPED) is unclipped_surrogate


COMMON = ["trainer.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=3", "trainer.micro_batch_size=3",
          "data.heldout_size=4", "data.train_size=40", "rollout.max_tokens=8", "rollout.eval_max_tokens=4",
          "trainer.lr=1e-3", "trainer.progress_bar=false", "trainer.eval_before=false", "trainer.save_checkpoint=false",
          "trainer.export_hf=false", "algorithm.kl_coef=0.0", "algorithm.clip_ratio=10.0"]


@pytest.mark.slow
def test_grpo_trains_with_your_own_advantage_estimator_and_policy_loss(tmp_path):
    """Four 2-step GRPO jobs (2 ranks, groups of 3, the tiny Llama, even-length reward), one launch:
    A the built-ins ``grpo_no_std`` + ``ppo``; B the same two written by hand and given by import path
    (``tests.recording_hooks:mean_baseline``, examples/custom_algorithm's unclipped surrogate: PPO's loss while the
    ratio stays inside ``clip_ratio=10``); C examples/custom_algorithm's median baseline (recorded) and its loss.
    B equals A step for step, so the job trains on what the hooks return; C's advantages are checked by hand
    against the rewards each rank's hook was given, its loss is called on every micro-batch, and it trains. D, the
    whole algorithm ``examples.custom_algorithm.quantile_grpo:ALGORITHM`` at quantile 0.5 with the same loss, equals
    C step for step."""
    model_dir = save_tiny_hf_dir(tmp_path / "tiny")
    record = tmp_path / "record"
    a, b, c, d = run_jobs(
        Job("grpo", model_dir, tmp_path / "builtin", [*COMMON, "algorithm.advantage_estimator=grpo_no_std"],
            reward="even_length"),
        Job("grpo", model_dir, tmp_path / "by_hand", [*COMMON, "algorithm.advantage_estimator="
                                                       "tests.recording_hooks:mean_baseline", f"algorithm.policy_loss={UNCLIPPED}"],
            reward="even_length"),
        Job("grpo", model_dir, tmp_path / "median", [*COMMON, "algorithm.advantage_estimator="
                                                      "tests.recording_hooks:recorded_median_baseline",
                                                      "algorithm.policy_loss=tests.recording_hooks:recorded_unclipped_surrogate"],
            reward="even_length", env={"MEGALIGN_HOOK_RECORD": str(record)}),
        Job("grpo", model_dir, tmp_path / "quantile", [*COMMON, f"algorithm.name={QUANTILE}",
                                                        "algorithm.baseline_quantile=0.5",
                                                        f"algorithm.policy_loss={UNCLIPPED}"], reward="even_length"))
    # D, the whole algorithm of examples/custom_algorithm at its median, is C (the median baseline and the same loss
    # by the narrow hooks) step for step: the job trains on what its own train() computes
    for mc, md in zip(c["history"], d["history"], strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "grad_norm", "clip_fraction", "entropy"):
            assert md[key] == pytest.approx(mc[key], rel=1e-5, abs=1e-7), (key, mc[key], md[key])
    for ma, mb in zip(a["history"], b["history"], strict=True):
        for key in ("reward/mean", "reward/std", "loss/policy", "grad_norm", "clip_fraction", "entropy"):
            assert mb[key] == pytest.approx(ma[key], rel=1e-5, abs=1e-7), (key, ma[key], mb[key])
    assert a["history"][0]["grad_norm"] > 0.0 and a["history"][0]["reward/std"] > 0.0
    calls, probes, losses = {}, 0, {}
    for rank in (0, 1):
        lines = [json.loads(line) for line in (tmp_path / f"record.{rank}").read_text().splitlines()]
        # the contract's checks before start call the hooks on their probes: rewards PROBE, logprobs [2, 3]
        probes += sum(c.get("rewards") == PROBE or c.get("loss_input") == [2, 3] for c in lines)
        calls[rank] = [c for c in lines if "rewards" in c and c["rewards"] != PROBE]
        losses[rank] = [c["loss_input"] for c in lines if c.get("loss_input", [2, 3]) != [2, 3]]
    assert probes >= 2 and [len(v) for v in calls.values()] == [2, 2]  # each rank, each step: 2 prompts x 3 samples
    # the job's loss is the hook's: called on every micro-batch of 3 sequences, at least once a step on each rank
    assert all(len(v) >= 2 and all(shape[0] == 3 for shape in v) for v in losses.values()), losses
    for call in calls[0] + calls[1]:
        r = call["rewards"]
        assert call["group_size"] == 3 and len(r) == 6 and set(r) <= {0.0, 1.0}  # even_length: right or wrong
        medians = [sorted(r[i:i + 3])[1] for i in (0, 3)]
        assert call["advantages"] == [x - medians[i // 3] for i, x in enumerate(r)], call
    moved = [m["grad_norm"] for m in c["history"]]
    assert len(moved) == 2 and max(moved) > 0.0  # some group was not all-equal: the policy trained
    assert sum(abs(x) for call in calls[0] + calls[1] for x in call["advantages"]) > 0
