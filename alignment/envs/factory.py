"""``rollout.environment``: which :class:`alignment.envs.base.Environment` an RL job's episodes run in.

- ``single_turn`` (default): the task's prompt, one answer (:class:`alignment.envs.base.SingleTurn`);
- ``tools``: the model may call ``rollout.tools`` before it answers, for up to ``rollout.max_turns``
  turns (:class:`alignment.envs.tool_env.ToolEnvironment`);
- ``verifiers`` / ``openenv``: an environment hub's environment (:mod:`alignment.rollout.agents.hubs`), whose
  episodes play against the rollout server as agents do; the trainers' own environment only renders prompts;
- ``package.module:name``: your own, ``name(cfg)`` returns the environment (NeMo-RL's and verl's
  way of plugging in environments), e.g. ``tests.dist.echo_env:build``.
"""

from __future__ import annotations

import importlib

from alignment.data.prompts import PromptStyle
from alignment.envs.base import Environment, SingleTurn
from alignment.envs.tool_env import ToolEnvironment
from alignment.sandbox.runner import sandbox_workers

#: environments of a hub, played against the rollout server (``rollout.environment_id`` names which)
HUB_ENVIRONMENTS = ("verifiers", "openenv")
ENVIRONMENTS = ("single_turn", "tools", *HUB_ENVIRONMENTS)


def build_environment(cfg) -> Environment:
    """The job's environment for ``cfg.rollout.environment`` (see the module docstring).

    Raises:
        ValueError: an unknown name, or a ``module:name`` that cannot be imported or found.
    """
    name = cfg.rollout.environment
    if name == "single_turn" or name in HUB_ENVIRONMENTS:
        return SingleTurn(PromptStyle.of(cfg.data))
    if name == "tools":

        return ToolEnvironment(PromptStyle.of(cfg.data), list(cfg.rollout.tools),
                               workers=sandbox_workers())
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"rollout.environment={name!r}: cannot load {attr!r} from module {module!r} ({e})") from e
        return factory(cfg)
    raise ValueError(f"rollout.environment={name!r}: valid values are {', '.join(ENVIRONMENTS)} or "
                     "'package.module:factory' (factory(cfg) returns an environment)")
