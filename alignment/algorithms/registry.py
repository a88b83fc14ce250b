"""The algorithms a job can run, by ``algorithm.name``: one :class:`Algorithm` record each, in
:data:`ALGORITHMS` (registration order: the order error messages list them in). A record says which job runs
the algorithm, which module trains it, and what it can do; dispatch (``launchers/train.py``,
``launchers/offline_job.py``) and the capability checks (:mod:`alignment.config`) read the records instead of
comparing names. Records are plain data (module paths, not modules), so reading them imports no trainer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

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
    """

    name: str
    job: str
    trainer: str
    summary: str
    asks_task: bool = False
    takes_images: bool = False
    policy_gradient: bool = False
    replays_routes: bool = False
    process_reward: bool = False
    episodes: bool = False
    agents: bool = False
    teacher: bool = False

    @property
    def online(self) -> bool:
        """It samples from the policy as it trains (an RL job: ``online`` or ``ppo``)."""
        return self.job != "offline"

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
    if algorithm.job not in JOBS:
        raise ValueError(f"algorithm {algorithm.name!r}: job={algorithm.job!r}, valid values are {', '.join(JOBS)}")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def get(name: str) -> Algorithm:
    """The algorithm ``algorithm.name=name`` runs.

    Raises:
        ConfigError: an unknown name, with the valid ones."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ConfigError(f"algorithm.name={name!r}: valid values are {', '.join(ALGORITHMS)}") from None


def names(**capabilities: bool) -> tuple[str, ...]:
    """The registered names whose record has every given attribute at the given value, in registration order,
    e.g. ``names(online=True)``, ``names(takes_images=True)``."""
    return tuple(n for n, a in ALGORITHMS.items() if all(getattr(a, k) == v for k, v in capabilities.items()))


_CAPABILITIES = ("asks_task", "takes_images", "policy_gradient", "replays_routes", "process_reward", "episodes",
                 "agents", "teacher")


def table() -> str:
    """The registered algorithms as a markdown table (docs/guides/algorithms.md holds it; ``python -m
    alignment.algorithms.registry`` prints it)."""
    rows = ["| `algorithm.name` | job | trainer | what it is | can |", "|---|---|---|---|---|"]
    for a in ALGORITHMS.values():
        can = ", ".join(c.replace("_", " ") for c in _CAPABILITIES if getattr(a, c)) or "-"
        rows.append(f"| `{a.name}` | {a.job} | `{a.trainer}` | {a.summary} | {can} |")
    return "\n".join(rows)


register(Algorithm("grpo", "online", "alignment.trainers.grpo",
                   "GRPO and its family (Dr.GRPO, DAPO, RLOO, REINFORCE++, GSPO, CISPO): group-relative advantages",
                   asks_task=True, takes_images=True, policy_gradient=True, replays_routes=True, process_reward=True,
                   episodes=True, agents=True))
register(Algorithm("ppo", "ppo", "alignment.trainers.ppo", "PPO with a critic and GAE",
                   policy_gradient=True, process_reward=True))
register(Algorithm("rft", "online", "alignment.trainers.rft",
                   "rejection-sampling fine-tuning: SFT on the accepted samples", asks_task=True, takes_images=True))
register(Algorithm("online_dpo", "online", "alignment.trainers.online_dpo",
                   "online DPO on the best and worst of the policy's own samples", asks_task=True, takes_images=True))
register(Algorithm("distill", "online", "alignment.trainers.grpo",
                   "on-policy distillation from a teacher (with the task's GRPO advantages, weighted)",
                   asks_task=True, takes_images=True, policy_gradient=True, replays_routes=True, episodes=True,
                   teacher=True))
register(Algorithm("sft", "offline", "alignment.trainers.sft", "supervised fine-tuning", takes_images=True))
register(Algorithm("rm", "offline", "alignment.trainers.reward_model", "a Bradley-Terry reward model"))
register(Algorithm("dpo", "offline", "alignment.trainers.dpo",
                   "DPO and its losses (IPO, hinge, KTO, SimPO, ORPO)", takes_images=True))
register(Algorithm("prm", "offline", "alignment.trainers.process_reward", "a process reward model"))


if __name__ == "__main__":
    print(table())
