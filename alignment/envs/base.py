"""The environment interface of multi-turn rollouts (``rollout.environment``), after NeMo-RL's
``EnvironmentInterface`` and verl's agent loop: an environment opens an episode with the messages
the model first reads, then answers each assistant message with observation messages, a reward
and whether the episode is over. Batched: one call steps every live episode of a rank, so slow
tools (sandboxed programs) run side by side.

The environment sees text; :mod:`alignment.rollout.episodes.multi_turn` keeps the tokens (what the engine
generated is never re-tokenised) and renders observations with the chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from alignment.data.prompts import PromptStyle, prompt_messages
from alignment.data.tasks import Problem

__all__ = ["Transition", "Environment", "SingleTurn"]


@dataclass
class Transition:
    """An environment's answer to one assistant message.

    ``observation``: chat messages the model reads next (e.g. ``{"role": "tool", "content": ...}``),
    empty when ``done``; ``reward``: added to the episode's environment reward (the ``environment``
    reward function reads the sum); ``done``: the episode is over; ``info``: counts the episode sums
    (``tool_calls``, ``tool_errors``).
    """

    observation: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


class Environment(Protocol):
    """What :func:`alignment.rollout.episodes.multi_turn.run_episodes` needs from an environment."""

    #: strings that end a model turn besides the end-of-sequence token (``SamplingConfig.stop``),
    #: e.g. ``["</tool_call>"]``; None: the turn ends at EOS
    stop: list[str] | None

    def reset(self, problems: Sequence[Problem]) -> list[list[dict]]:
        """The opening messages of an episode for each problem (rendered as the prompt)."""

    def step(self, problems: Sequence[Problem], messages: Sequence[list[dict]],
             replies: Sequence[str]) -> list[Transition]:
        """Answer ``replies[i]``, the assistant's latest message in the episode of ``problems[i]``
        whose conversation so far (``replies[i]`` included, last) is ``messages[i]``."""


class SingleTurn:
    """The trivial environment (``rollout.environment=single_turn``): the task's prompt, one answer,
    done; the reward functions grade the answer. The same prompts and samples as without an
    environment.

    Args:
        style: the job's :class:`alignment.data.prompts.PromptStyle` (``data.instruction``,
            ``data.system_prompt``, ``data.chat_template_kwargs``).
    """

    stop = None

    def __init__(self, style: PromptStyle = PromptStyle()):
        self.style = style

    def reset(self, problems: Sequence[Problem]) -> list[list[dict]]:
        """:func:`alignment.data.prompts.prompt_messages` of each problem."""
        return [prompt_messages(p, self.style) for p in problems]

    def step(self, problems, messages, replies) -> list[Transition]:
        """Every episode ends after its first answer, with no environment reward."""
        return [Transition(done=True) for _ in replies]
