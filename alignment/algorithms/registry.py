"""The algorithms a job can run, by ``algorithm.name``: one :class:`Algorithm` record each, in
:data:`ALGORITHMS` (registration order: the order error messages list them in). A record says which job runs
the algorithm, which module trains it, and what it can do; dispatch (``launchers/train.py``,
``launchers/offline_job.py``) and the capability checks (:mod:`alignment.config`) read the records instead of
comparing names. Records are plain data (module paths, not modules), so reading them imports no trainer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any
from types import ModuleType

from alignment.algorithms import hooks
from alignment.algorithms.config import (AlgorithmConfig, DistillConfig, GRPOConfig, OnlineDPOConfig, PPOConfig,
                                         PreferenceConfig, ProcessRewardConfig, RewardModelConfig, RFTConfig, SFTConfig)
from alignment.schema import ConfigError

#: :attr:`Algorithm.job` values: the loop that runs an algorithm
JOBS = ("online", "ppo", "offline")


@dataclass(frozen=True)
class Algorithm:
    """One algorithm.

    Attributes:
        name: its ``algorithm.name``.
        job: ``online`` (:mod:`launchers.loop`: the trainer's ``collect(models, problems, cfg, ...)`` samples and
            scores, its ``train(models, rollout, cfg)`` updates), ``ppo`` (:mod:`launchers.ppo_job`: policy and
            critic) or ``offline`` (:mod:`launchers.offline_job`: the trainer's ``objective(cfg, vocab_size)``, the loss
            function object, on fixed data).
        trainer: the module that trains it (``alignment.trainers.<...>``).
        summary: one line for the docs (:func:`table`).
        config: its ``algorithm`` section: :class:`alignment.algorithms.config.AlgorithmConfig` or a dataclass
            below it, with its own keys only (their ranges in each field's metadata).
        asks_task: it asks ``data.task``'s questions (or a prompt file's), graded by the task
            (``data.instruction`` applies).
        takes_images: it trains vision-language models.
        policy_gradient: its loss is a policy gradient on sampled tokens (the clipped surrogate, its KL term and
            the rollout correction); samples from an older policy need importance weights.
        replays_routes: ``algorithm.routing_replay`` (r2 / r3) replays a mixture-of-experts model's routes in
            its training passes.
        process_reward: it takes a dense ``process_reward`` term (per-step rewards).
        episodes: it runs multi-turn episodes (``rollout.environment``) on its task.
        agents: an agent of your own (``rollout.agent`` / ``agent_command``) can play its episodes.
        teacher: it distils from ``model.teacher_path``.
        examples: the fixed data it trains on (``data.dataset``): ``sft`` (prompt and response), ``preference``
            (chosen and rejected, or KTO's unpaired records), ``steps`` (step-labelled solutions); empty: none.
        scalar_head: it trains a scalar head (a reward model), exported as a sequence classifier.
        validate: its checks across sections, ``module.path:function`` called as ``fn(cfg, layout, dims)`` by
            :func:`alignment.config.validate` before any process group starts (the built-ins':
            ``alignment/checks/``); empty: none beyond what every job of its kind is checked for.
        like: the built-in algorithm whose reading of the settings outside the ``algorithm`` section this one
            shares (:mod:`alignment.reads`' rules: which ``rollout`` / ``data`` / ``trainer`` keys its job
            reads), e.g. ``grpo`` for a GRPO variant of your own; empty: its own name.
    """

    name: str
    job: str
    trainer: str
    summary: str
    config: type = AlgorithmConfig
    asks_task: bool = False
    takes_images: bool = False
    policy_gradient: bool = False
    replays_routes: bool = False
    process_reward: bool = False
    episodes: bool = False
    agents: bool = False
    teacher: bool = False
    examples: str = ""
    scalar_head: bool = False
    validate: str = ""
    like: str = ""

    @property
    def online(self) -> bool:
        """It samples from the policy as it trains (an RL job: ``online`` or ``ppo``)."""
        return self.job != "offline"

    def checks(self) -> Callable[..., None]:
        """Its :attr:`validate` function, imported (a no-op when it has none).

        Raises:
            ConfigError: a path that does not name a function."""
        if not self.validate:
            return lambda cfg, layout, dims: None
        return hooks.load(self.validate, f"algorithm.name={self.name}: validate")  # called as fn(cfg, layout, dims)

    def trainer_module(self) -> ModuleType:
        """The :attr:`trainer` module, imported (Megatron and torch with it: call in the job, not at config time)."""
        return importlib.import_module(self.trainer)


ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to :data:`ALGORITHMS` under its name and return it.

    Raises:
        ValueError: the name is taken, or ``job`` is not one of :data:`JOBS`."""
    if algorithm.name in ALGORITHMS:
        raise ValueError(f"algorithm {algorithm.name!r} is registered already")
    if not (isinstance(algorithm.config, type) and issubclass(algorithm.config, AlgorithmConfig)):
        raise ValueError(f"algorithm {algorithm.name!r}: config={algorithm.config!r} is not a dataclass below "
                         "alignment.algorithms.config.AlgorithmConfig")
    if algorithm.job not in JOBS:
        raise ValueError(f"algorithm {algorithm.name!r}: job={algorithm.job!r}, valid values are {', '.join(JOBS)}")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm ``algorithm.name=name`` runs: a registered one, or your own by import path
    (``module.path:ATTRIBUTE``, an :class:`Algorithm` record: :func:`own`).

    Raises:
        ConfigError: an unknown name, with the valid ones; your own that does not load (:func:`own`)."""
    if name in ALGORITHMS:
        return ALGORITHMS[name]
    if ":" in str(name):
        return own(name)
    raise ConfigError(f"algorithm.name={name!r}: valid values are {', '.join(ALGORITHMS)}, or your own as "
                      "module.path:Algorithm (an alignment.algorithms.registry.Algorithm record)")


def of(cfg: Any) -> Algorithm:
    """The algorithm the job ``cfg`` runs (:func:`get` of its ``algorithm.name``)."""
    return get(cfg.algorithm.name)


#: what a trainer module provides for each job of an algorithm of your own
TRAINER_FUNCTIONS = {"online": ("collect", "train"), "offline": ("objective",)}


def own(path: str) -> Algorithm:
    """Your own algorithm, ``algorithm.name=module.path:ATTRIBUTE``: the :class:`Algorithm` record that attribute
    holds, its trainer module imported and checked (``online``: ``collect(models, problems, cfg, version,
    refill)`` and ``train(models, rollout, cfg)``; ``offline``: ``objective(cfg, vocab_size)``). Modules are
    imported from the job's working directory or ``PYTHONPATH``.

    Raises:
        ConfigError: naming ``algorithm.name``: a module that does not import, an attribute that is not a record,
            a record that takes a built-in's name, a ``ppo`` job (PPO's critic job is not open to others yet), a
            config class not below AlgorithmConfig, a trainer module without its functions."""
    field = f"algorithm.name={path}"
    module_name, _, attr = str(path).partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{field}: give module.path:ATTRIBUTE, e.g. my_pkg.my_algo:ALGORITHM")
    try:
        record = getattr(importlib.import_module(module_name), attr, None)
        if isinstance(record, Algorithm) and record.job in TRAINER_FUNCTIONS:
            trainer = record.trainer_module()
    except Exception as e:  # the user's module: any error it raises on import
        raise ConfigError(f"{field}: {type(e).__name__}: {e} (imported from the job's working directory or "
                          "PYTHONPATH)") from e
    if not isinstance(record, Algorithm):
        raise ConfigError(f"{field}: {module_name}.{attr} is not an alignment.algorithms.registry.Algorithm record")
    if record.name in ALGORITHMS:
        raise ConfigError(f"{field}: its record's name {record.name!r} is a built-in algorithm's; give it another")
    if record.job not in TRAINER_FUNCTIONS:
        raise ConfigError(f"{field}: job={record.job!r}; an algorithm of your own runs as one of "
                          f"{', '.join(TRAINER_FUNCTIONS)}")
    if not (isinstance(record.config, type) and issubclass(record.config, AlgorithmConfig)):
        raise ConfigError(f"{field}: config={record.config!r} is not a dataclass below "
                          "alignment.algorithms.config.AlgorithmConfig")
    missing = [f for f in TRAINER_FUNCTIONS[record.job] if not callable(getattr(trainer, f, None))]
    if missing:
        raise ConfigError(f"{field}: its trainer module {record.trainer} has no {' / '.join(missing)} (a {record.job} "
                          f"job calls {', '.join(TRAINER_FUNCTIONS[record.job])})")
    if record.like and record.like not in ALGORITHMS:
        raise ConfigError(f"{field}: like={record.like!r}: valid values are {', '.join(ALGORITHMS)}")
    return record


def names(**capabilities: bool) -> tuple[str, ...]:
    """The registered names whose record has every given attribute at the given value, in registration order,
    e.g. ``names(online=True)``, ``names(takes_images=True)``."""
    return tuple(n for n, a in ALGORITHMS.items() if all(getattr(a, k) == v for k, v in capabilities.items()))


_CAPABILITIES = ("asks_task", "takes_images", "policy_gradient", "replays_routes", "process_reward", "episodes",
                 "agents", "teacher", "scalar_head")


def table() -> str:
    """The registered algorithms as a markdown table (docs/guides/algorithms.md holds it; ``python -m
    alignment.algorithms.registry`` prints it)."""
    rows = ["| `algorithm.name` | job | trainer | what it is | can |", "|---|---|---|---|---|"]
    for a in ALGORITHMS.values():
        can = ", ".join([c.replace("_", " ") for c in _CAPABILITIES if getattr(a, c)]
                        + ([f"{a.examples} data"] if a.examples else [])) or "-"
        rows.append(f"| `{a.name}` | {a.job} | `{a.trainer}` | {a.summary} | {can} |")
    return "\n".join(rows)


register(Algorithm("grpo", "online", "alignment.trainers.grpo",
                   "GRPO and its family (Dr.GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO): group-relative advantages",
                   GRPOConfig, asks_task=True, takes_images=True, policy_gradient=True, replays_routes=True,
                   process_reward=True, episodes=True, agents=True, validate="alignment.checks.grpo:validate"))
register(Algorithm("ppo", "ppo", "alignment.trainers.ppo", "PPO with a critic and GAE", PPOConfig,
                   policy_gradient=True, process_reward=True, validate="alignment.checks.ppo:validate"))
register(Algorithm("rft", "online", "alignment.trainers.rft",
                   "rejection-sampling fine-tuning: SFT on the accepted samples", RFTConfig, asks_task=True,
                   takes_images=True, validate="alignment.checks.rft:validate"))
register(Algorithm("online_dpo", "online", "alignment.trainers.online_dpo",
                   "online DPO on the best and worst of the policy's own samples", OnlineDPOConfig, asks_task=True,
                   takes_images=True, validate="alignment.checks.online_dpo:validate"))
register(Algorithm("distill", "online", "alignment.trainers.distill",
                   "on-policy distillation from a teacher (with the task's GRPO advantages, weighted)", DistillConfig,
                   asks_task=True, takes_images=True, policy_gradient=True, replays_routes=True, episodes=True,
                   teacher=True, validate="alignment.checks.distill:validate"))
register(Algorithm("sft", "offline", "alignment.trainers.sft", "supervised fine-tuning", SFTConfig, takes_images=True,
                   examples="sft", validate="alignment.checks.offline:validate"))
register(Algorithm("rm", "offline", "alignment.trainers.reward_model", "a Bradley-Terry reward model",
                   RewardModelConfig, examples="preference", scalar_head=True, validate="alignment.checks.offline:validate"))
register(Algorithm("dpo", "offline", "alignment.trainers.dpo", "DPO and its losses (IPO, hinge, KTO, SimPO, ORPO)",
                   PreferenceConfig, takes_images=True, examples="preference", validate="alignment.checks.offline:validate"))
register(Algorithm("prm", "offline", "alignment.trainers.process_reward", "a process reward model",
                   ProcessRewardConfig, examples="steps", scalar_head=True, validate="alignment.checks.offline:validate"))

if __name__ == "__main__":
    print(table())
