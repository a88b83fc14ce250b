"""The algorithm registry (alignment/algorithms/registry.py): records, lookups and what reads them."""

from __future__ import annotations

import importlib
import inspect

import pytest

from alignment.algorithms import registry
from alignment.schema import ConfigError


def test_every_algorithm_is_registered_once_in_the_order_messages_list_them():
    assert list(registry.ALGORITHMS) == ["grpo", "ppo", "rft", "online_dpo", "distill", "sft", "rm", "dpo", "prm"]
    with pytest.raises(ConfigError, match="^algorithm.name='ppo2': valid values are grpo, ppo, rft, online_dpo, "
                                          "distill, sft, rm, dpo, prm, or your own as module.path:Algorithm"):
        registry.get("ppo2")
    with pytest.raises(ValueError, match="config=<class 'dict'> is not a dataclass below"):
        registry.register(registry.Algorithm("mine", "online", "my.module", "mine", dict))
    with pytest.raises(ValueError, match="algorithm 'grpo' is registered already"):
        registry.register(registry.get("grpo"))
    with pytest.raises(ValueError, match="job='batch', valid values are online, ppo, offline"):
        registry.register(registry.Algorithm("mine", "batch", "my.module", "mine"))
    assert "mine" not in registry.ALGORITHMS


def test_capabilities_are_the_sets_the_checks_used_by_name():
    """The name lists the config checks compared against before the registry, by hand."""
    assert registry.names(online=True) == ("grpo", "ppo", "rft", "online_dpo", "distill")
    assert registry.names(online=False) == ("sft", "rm", "dpo", "prm")
    assert registry.names(asks_task=True) == ("grpo", "rft", "online_dpo", "distill")
    assert set(registry.names(takes_images=True)) == {"sft", "dpo", "grpo", "rft", "online_dpo", "distill"}
    assert set(registry.names(policy_gradient=True)) == {"grpo", "distill", "ppo"}  # all but rft / online_dpo
    assert registry.names(replays_routes=True) == ("grpo", "distill")
    assert registry.names(process_reward=True) == ("grpo", "ppo")
    assert registry.names(episodes=True) == ("grpo", "distill") and registry.names(agents=True) == ("grpo",)
    assert registry.names(teacher=True) == ("distill",)
    assert registry.names(online=True, policy_gradient=False) == ("rft", "online_dpo")


def test_each_algorithm_has_its_own_section():
    """Each record's ``config`` holds its algorithm's keys and no other's: the keys the reads table gave each
    algorithm before the sections were split (alignment/reads.py at 9bb914c), by hand."""
    from alignment.algorithms.config import section_keys

    policy_gradient = {"name", "overlong_buffer_len", "overlong_penalty_factor", "clip_ratio", "clip_ratio_high",
                       "policy_loss", "clip_ratio_c", "rollout_correction", "kl_coef", "ppo_epochs", "num_mini_batches"}
    step = {"kl_estimator", "loss_agg_mode", "dynamic_sampling", "max_sampling_rounds", "routing_replay",
            "advantage_estimator", "whiten_level"}
    preference = {"name", "loss_type", "beta", "label_smoothing", "simpo_gamma", "orpo_lambda"}
    expected = {
        "grpo": policy_gradient | step | {"step_separator"},
        "distill": policy_gradient | step | {"distill_loss", "distill_beta", "task_reward_weight", "distill_samples"},
        "ppo": policy_gradient | {"gamma", "gae_lambda", "value_clip", "target_kl", "whiten_advantages",
                                  "step_separator"},
        "rft": {"name", "overlong_buffer_len", "overlong_penalty_factor", "accept_threshold", "dedup_responses",
                "rationalize"},
        "online_dpo": preference | {"overlong_buffer_len", "overlong_penalty_factor", "ref_update", "iteration_steps"},
        "dpo": preference, "sft": {"name"}, "rm": {"name", "center_coef"}, "prm": {"name", "step_separator",
                                                                                 "supervision"}}
    assert {n: set(section_keys(a.config)) for n, a in registry.ALGORITHMS.items()} == expected


def test_every_trainer_has_what_its_job_calls():
    """``online`` and ``ppo``: ``collect`` and ``train``; ``offline``: ``objective(cfg, vocab_size)``."""
    for a in registry.ALGORITHMS.values():
        module = importlib.import_module(a.trainer)
        wanted = ("objective",) if a.job == "offline" else ("collect", "train")
        for name in wanted:
            assert callable(getattr(module, name, None)), (a.name, a.trainer, name)
        if a.job == "offline":
            assert list(inspect.signature(module.objective).parameters) == ["cfg", "vocab_size"], a.name
        elif a.job == "online":  # launchers/train.py calls collect(models, problems, cfg, version, refill)
            assert list(inspect.signature(module.collect).parameters)[:5] == ["models", "problems", "cfg", "version",
                                                                              "refill"], a.name
        # its checks across sections: alignment/checks/<module>.py's validate(cfg, layout, dims)
        assert a.validate.startswith("alignment.checks.") and list(inspect.signature(a.checks()).parameters) == \
            ["cfg", "layout", "dims"], a.name
    with pytest.raises(ConfigError, match="^algorithm.name=mine: validate=alignment.checks.grpo:nothing: "
                                          "alignment.checks.grpo has no function nothing$"):
        registry.Algorithm("mine", "online", "my.module", "mine", validate="alignment.checks.grpo:nothing").checks()


def test_no_algorithm_name_is_compared_outside_the_registry():
    """Behaviour follows the record (its job and capabilities) or the section's class, never the name's spelling."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pattern = re.compile(r"(algorithm|\ba)\.name\s*(==|!=|in\b|not in\b)")
    found = [f"{p.relative_to(root)}:{i}" for folder in ("alignment", "launchers", "tools", "bench")
             for p in sorted((root / folder).rglob("*.py")) if p.name != "registry.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert found == [], found
