"""Where the features a GRPO-family job turns on plug into GRPO's step (:mod:`alignment.trainers.grpo`, and the
algorithms built on it: distillation, your own): named hooks, chosen once per call from the config by
:func:`step_hooks`, so that the step itself has no branch on them.

================  =========================================  ====================================================
hook              without the feature                        the feature
================  =========================================  ====================================================
``sample``        the engine's episodes: one turn, or        agent programs play them against the rollout server
                  ``rollout.environment``'s turns            (``rollout.agent`` / ``agent_command``)
``keep_group``    None: every group is kept, no refill       dynamic sampling (``algorithm.dynamic_sampling``,
                                                             DAPO Sec. 3.2): only groups whose rewards can differ
``dense``         None: outcome rewards only                 a process reward (``reward.functions``'
                                                             ``process_reward``): the PRM's score of each step
``routes``        MoE: record, then compare                  routing replay (``algorithm.routing_replay``: R2
                                                             replays the recorded routes, R3 the engine's)
================  =========================================  ====================================================
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch

from alignment.algorithms.reward_shaping import informative_groups
from alignment.config import JobConfig
from alignment.data.samples import OnDone, Sample
from alignment.data.tasks import Problem
from alignment.rewards.policy import process_reward_weight
from alignment.trainers.agent_rollout import agent_episodes, uses_agents
from alignment.trainers.models import Models
from alignment.trainers.process_rewarding import StepRewards, score_steps
from alignment.trainers.rewarding import job_terms
from alignment.trainers.rl_phases import generate_episodes, sampling_config
from alignment.training.routing_replay import COMPARE, RECORD, REPLAY, RoutingPass

#: the responses to take instead of sampling, for problems (a dataset's: distillation on it)
Answers = Callable[[list[Problem]], list[str]]
#: ``sample(models, problems, on_done, answers)``: ``([len(problems)][group_size] samples, counts)`` of this DP
#: rank's problems (counts: the agents' global sums)
Sampler = Callable[[Models, list[Problem], OnDone | None, Answers | None], tuple[list[list[Sample]], dict[str, float]]]


@dataclass(frozen=True)
class Routes:
    """A MoE policy's routing in GRPO's passes (:mod:`alignment.training.routing_replay`); a dense policy has
    none (:meth:`RoutingPass.of` is None). ``replay``: ``algorithm.routing_replay`` is ``r2`` or ``r3``."""

    replay: bool

    def before_updates(self, policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> RoutingPass | None:
        """The pass that freezes the sampling policy's logprobs: it replays the engine's routes when the batch
        has them (R3), else records its own (R2's, or the reference that ``moe/routing_agreement`` compares
        with)."""
        return RoutingPass.of(policy, REPLAY if "routed_experts" in batch else RECORD)

    def in_updates(self, policy: torch.nn.Module, batch: dict[str, torch.Tensor]) -> RoutingPass | None:
        """Each update's pass: replays the batch's routes (R2, R3) or compares with them; None when the batch
        has none."""
        if "routed_experts" not in batch:
            return None
        return RoutingPass.of(policy, REPLAY if self.replay else COMPARE)


@dataclass(frozen=True)
class StepHooks:
    """The hooks of one GRPO step (this module's table)."""

    sample: Sampler
    keep_group: Callable[[dict[str, torch.Tensor]], bool] | None
    dense: Callable[[Models, list[Sample]], StepRewards] | None
    routes: Routes
    #: the samples are episodes (an environment's turns, or an agent's): their turns and tool calls are logged
    episodes: bool


def step_hooks(cfg: JobConfig) -> StepHooks:
    """The hooks ``cfg`` turns on (this module's table)."""
    group_size, sampling = cfg.rollout.group_size, sampling_config(cfg.rollout)
    if uses_agents(cfg):
        def sample(models: Models, problems: list[Problem], on_done: OnDone | None,
                   answers: Answers | None) -> tuple[list[list[Sample]], dict[str, float]]:
            return agent_episodes(models, problems, group_size, cfg.rollout.max_tokens)
    else:
        def sample(models: Models, problems: list[Problem], on_done: OnDone | None,
                   answers: Answers | None) -> tuple[list[list[Sample]], dict[str, float]]:
            return generate_episodes(models, problems, sampling, on_done, teacher=models.teacher_engine is not None,
                                     answers=answers(problems) if answers is not None else None), {}
    keep = None
    if cfg.algorithm.dynamic_sampling:
        terms = job_terms(cfg)

        def keep(part: dict[str, torch.Tensor]) -> bool:
            return informative(part, terms, group_size)
    dense = None
    if process_reward_weight(cfg):
        def dense(models: Models, samples: list[Sample]) -> StepRewards:
            return score_steps(models, samples, cfg)
    return StepHooks(sample, keep, dense, Routes(cfg.algorithm.routing_replay != "none"),
                     episodes=cfg.rollout.environment != "single_turn" or uses_agents(cfg))


def informative(part: dict[str, torch.Tensor], terms: list[Any], group_size: int) -> bool:
    """Whether a group's rewards can differ (``part``: each term's ``[group_size]`` scores): its weighted sum of
    terms varies (no whitened term), or some weighted term varies (whitened terms are only known over the whole
    batch)."""
    weighted = [t for t in terms if t.weight != 0]
    if not weighted:  # the dense process reward only: no sample-level reward to differ
        return False
    if any(t.whiten for t in weighted):  # a score of None (NaN) differs from every score and from None
        return any(bool(informative_groups(torch.nan_to_num(part[t.name], nan=math.inf), group_size)[0])
                   for t in weighted)
    total = cast(torch.Tensor, sum(torch.nan_to_num(t.weight * part[t.name].float(), nan=0.0) for t in weighted))
    return bool(informative_groups(total, group_size)[0])

