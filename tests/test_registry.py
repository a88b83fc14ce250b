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
                                          "distill, sft, rm, dpo, prm$"):
        registry.get("ppo2")
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


def test_every_trainer_has_what_its_job_calls():
    """``online`` and ``ppo``: ``collect`` and ``train``; ``offline``: ``objective(cfg, vocab_size)``."""
    for a in registry.ALGORITHMS.values():
        module = importlib.import_module(a.trainer)
        wanted = ("objective",) if a.job == "offline" else ("collect", "train")
        for name in wanted:
            assert callable(getattr(module, name, None)), (a.name, a.trainer, name)
        if a.job == "offline":
            assert list(inspect.signature(module.objective).parameters) == ["cfg", "vocab_size"], a.name
