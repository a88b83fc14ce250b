"""The rollout phase with agent programs (``rollout.agent`` / ``rollout.agent_command``, or an environment hub's
environment: ``rollout.environment=verifiers`` / ``openenv``, :mod:`alignment.rollout.agents.hubs`): each data-parallel
rank plays its problems' episodes (``group_size`` per problem) with the agent against its own rollout
server (:mod:`alignment.rollout.agents.server`), which the first rank of its model replica serves; the
other ranks of the replica generate in lockstep with it (every engine call is sent to them first, an
empty message keeps them waiting between calls, a last one ends the phase), and all of them end with
the same samples. The episodes then train as multi-turn episodes do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from alignment.config import JobConfig
from alignment.data.tasks import Problem
from alignment.rollout.agents.server import RolloutServer
from alignment.rollout.agents.programs import (Agent, EpisodeLoop, GroupAgent, command_agent, episode_samples,
                                               load_agent, play_episodes, play_groups, task_row)
from alignment.envs.factory import HUB_ENVIRONMENTS
from alignment.rollout.agents.hubs import hub_agent
from alignment.rollout.config import played_by_agents
from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.base import RolloutEngine
from alignment.rollout.episodes.multi_turn import EpisodeSetup
from alignment.trainers.models import Models
from alignment.trainers.rl_phases import generate_for_group
from alignment.training.megatron_step import all_reduce_sum
from parallel.state import replica_group

__all__ = ["AgentRollout", "setup_agents", "agent_episodes", "uses_agents", "AGENT_COUNTS"]

#: the per-step counts of agent episodes (summed over the data-parallel ranks)
AGENT_COUNTS = ("episode/failed", "episode/timeout", "episode/dropped_groups")
_IDLE_S = 1.0  # the lead's message to its replica while no request waits


def uses_agents(cfg: JobConfig) -> bool:
    """Whether the job's episodes are played by an agent program or an environment hub's environment
    (:func:`alignment.rollout.config.played_by_agents`)."""
    return played_by_agents(cfg.rollout)


@dataclass
class AgentRollout:
    """This rank's agent machinery: the agent (``group``: a :data:`GroupAgent`, which plays a task's episodes
    together), its server (the replica's first rank only) and settings."""

    agent: Agent | GroupAgent
    server: RolloutServer | None
    concurrency: int
    timeout_s: float
    episodes: int = 0  # episodes played so far (their names stay unique over the run)
    group: bool = False
    loop: EpisodeLoop | None = None  # where the episodes run, phase after phase (the serving rank's)


def setup_agents(models: Models, cfg: JobConfig) -> AgentRollout:
    """The job's agent and, on the first rank of each model replica, its rollout server, started (before any
    agent runs). Collective-free; called once when the models are built."""
    r = cfg.rollout
    agent: Agent | GroupAgent
    together = False  # a GroupAgent: a task's episodes played together
    if r.environment in HUB_ENVIRONMENTS:
        agent, together = hub_agent(r, Path(cfg.output_dir) / "logs" / f"environment_rank{dist.get_rank()}.log")
    else:  # uses_agents: one of them is set
        agent = load_agent(r.agent) if r.agent else command_agent(cast(str, r.agent_command))
    group = replica_group()
    server = None
    if dist.get_rank(group) == 0:
        engine = cast(RolloutEngine, models.engine)  # set up only with one
        lead = dist.get_global_rank(group, 0)

        def generate(prompts: list[list[int]], sampling: SamplingConfig) -> list[list[Sample]]:
            if dist.get_world_size(group) > 1:
                dist.broadcast_object_list([("generate", prompts, sampling)], src=lead, group=group)
            return generate_for_group(engine, prompts, sampling)

        stops = r.backend == "vllm"  # Megatron's engine ends turns at EOS only
        server = RolloutServer(cast(EpisodeSetup, models.episodes).turns, generate, r.max_tokens,
                               SamplingConfig(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens),
                               tool_stop=("</tool_call>",) if stops else (), stop_strings=stops,
                               max_tokens_per_turn=r.max_tokens_per_turn, max_model_len=r.max_model_len)
        server.start()
    return AgentRollout(agent, server, r.agent_concurrency, r.agent_timeout_s, group=together,
                        loop=EpisodeLoop() if server is not None else None)


def agent_episodes(models: Models, problems: list[Problem], n: int, max_tokens: int,
                   force: SamplingConfig | None = None) -> tuple[list[list[Sample]], dict[str, float]]:
    """``n`` agent episodes for each of this DP rank's ``problems``, each with a budget of ``max_tokens``
    tokens after its prompt (collective over the model replica). ``force``: sampling settings that replace
    the requests' own (the held-out evaluation's temperature and top-p). Returns ``([len(problems)][n]
    samples, counts)``: :data:`AGENT_COUNTS`, summed over the data-parallel ranks (one rank per replica
    counts)."""
    a, group = cast(AgentRollout, models.agents), replica_group()  # set up with the models
    size, lead = dist.get_world_size(group), dist.get_global_rank(group, 0)
    groups: list[list[Sample]] | None = None
    if a.server is not None:
        a.server.max_tokens, a.server.force = max_tokens, force
        # a group agent (an environment's) gets its own dataset's row back; an agent program, the task's row
        rows = [dict(p.columns) if a.group else task_row(p) for p in problems]
        prefix = f"r{dist.get_rank()}-{a.episodes}"  # the rank and the call: unique over the run
        a.episodes += 1
        last = [time.monotonic()]

        def idle() -> None:  # the replica's other ranks wait in a broadcast: keep it short of any timeout
            if size > 1 and time.monotonic() - last[0] > _IDLE_S:
                dist.broadcast_object_list([("idle",)], src=lead, group=group)
                last[0] = time.monotonic()

        server = a.server
        play_all = play_groups if a.group else play_episodes
        try:
            outcomes = cast(EpisodeLoop, a.loop).run(
                play_all(a.agent, rows, n, server.session_url, server.pop_session,  # type: ignore[arg-type]
                         a.concurrency, a.timeout_s, prefix, server.playing),
                lambda until: server.serve(until=until, on_idle=idle))
        finally:
            if size > 1:
                dist.broadcast_object_list([("done",)], src=lead, group=group)
        bad = [o for g in outcomes for o in g if o.status != "ok"]
        if bad:  # what the agent's author needs to mend it: the count and the first reason, in this rank's log
            print(f"agent episodes dropped on rank {dist.get_rank()}: {len(bad)} of "
                  f"{sum(len(g) for g in outcomes)}; the first: {bad[0].error}", flush=True)
        groups = episode_samples(outcomes, models.tokenizer.eos_token_id or 0)
    else:  # the replica's other ranks: generate what the lead's server asks for, until it is done
        while True:
            msg: list[Any] = [None]
            dist.broadcast_object_list(msg, src=lead, group=group)
            if msg[0][0] == "done":
                break
            if msg[0][0] == "generate":
                generate_for_group(cast(RolloutEngine, models.engine), msg[0][1], msg[0][2])
    if size > 1:  # every rank of the replica trains on the same samples
        box = [groups]
        dist.broadcast_object_list(box, src=lead, group=group)
        groups = box[0]
    groups = cast(list[list[Sample]], groups)  # every rank's by now: the lead's own, the others' broadcast to them
    count = dist.get_rank(group) == 0
    statuses = [s.info.get("agent_status") for g in groups for s in g] if count else []
    dropped: float = sum(any(s.info.get("agent_status") != "ok" for s in g) for g in groups) if count else 0
    failed, timeout, dropped = all_reduce_sum([float(statuses.count("failed")), float(statuses.count("timeout")),
                                               float(dropped)])
    return groups, dict(zip(AGENT_COUNTS, (failed, timeout, dropped)))
