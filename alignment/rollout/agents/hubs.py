"""The environment hubs a job's task can come from (``rollout.environment``: :data:`alignment.envs.factory.HUB_ENVIRONMENTS`),
one place that knows which module plays each: its prompts (:func:`hub_prompts`), the agent that plays its episodes on a
serving rank (:func:`hub_agent`), and its start-up summary line (:func:`hub_line`).

- ``verifiers``: :mod:`alignment.rollout.agents.verifiers_env` (a task's group played and scored together);
- ``openenv``: :mod:`alignment.rollout.agents.openenv_env` (each episode on its own).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from alignment.data.prompt_data import PromptSets, fit_prompts
from alignment.data.tasks import Problem
from alignment.rollout.agents import openenv_env, verifiers_env
from alignment.rollout.agents.programs import Agent, GroupAgent
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["hub_prompts", "hub_agent", "hub_line", "check_hub"]


def check_hub(r: Any) -> None:
    """What can be checked of ``r``'s hub environment before any process starts (its ``rollout`` section): an
    OpenEnv environment's client and arguments, its ``url``'s server answering or its ``app`` importing.

    Raises:
        AgentError: naming the setting.
    """
    if r.environment == "openenv":
        spec = openenv_env.openenv_spec(r.environment_id, r.environment_args)
        if spec.url:
            openenv_env.check_server(spec.url)
        else:
            openenv_env.check_app(cast(str, spec.app))


def hub_prompts(r: Any, turns: TurnTokens, overlong: str) -> PromptSets:
    """``r``'s hub environment's training and held-out prompts, each (where it is known before the episode starts)
    with ``rollout.max_tokens`` fitting ``rollout.max_model_len`` (``overlong``: ``data.overlong_prompts``).

    Raises:
        AgentError: as the hub's module raises; ValueError: a prompt too long, or none left.
    """
    where = f"rollout.environment_id={r.environment_id}"
    length: Callable[[Problem], int]
    if r.environment == "verifiers":
        env = verifiers_env.load_environment(r.environment_id, r.environment_args)
        sets = verifiers_env.environment_problems(env, r.environment_id)
        length = lambda p: verifiers_env.prompt_length(env, turns, p)  # noqa: E731
    else:
        sets, length = openenv_env.openenv_problems(openenv_env.openenv_spec(r.environment_id, r.environment_args)), \
            lambda p: 0  # noqa: E731 - the first observation comes with the episode
    return fit_prompts(sets, length, r.max_model_len, r.max_tokens, overlong, where)


def hub_agent(r: Any, logs: Path | None = None) -> tuple[Agent | GroupAgent, bool]:
    """The agent that plays ``r``'s hub environment's episodes on this rank, and whether it plays a task's group
    at once (:data:`alignment.rollout.agents.programs.GroupAgent`). ``logs``: where an OpenEnv app's server writes.

    Raises:
        AgentError: as the hub's module raises.
    """
    if r.environment == "verifiers":
        return verifiers_env.group_agent(verifiers_env.load_environment(r.environment_id, r.environment_args)), True
    spec = openenv_env.openenv_spec(r.environment_id, r.environment_args)
    return openenv_env.episode_agent(spec, openenv_env.EnvServer(spec, logs)), False


def hub_line(r: Any) -> str:
    """The start-up summary's line on ``r``'s hub environment."""
    if r.environment == "verifiers":
        what = verifiers_env.describe(verifiers_env.load_environment(r.environment_id, r.environment_args))
    else:
        what = openenv_env.describe(openenv_env.openenv_spec(r.environment_id, r.environment_args))
    return f"environment: {r.environment} {r.environment_id} ({what})"

