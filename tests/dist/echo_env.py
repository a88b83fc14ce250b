"""A scripted environment for the multi-turn end-to-end test (``rollout.environment=
tests.dist.echo_env:build``): a random tiny model never calls a tool, so this one answers every
turn with a user message ("Turn k: go on.") and an environment reward of 0.25, and counts each
turn as one tool call; the episode ends at ``rollout.max_turns`` or the token budget."""

from __future__ import annotations

from alignment.data.prompts import prompt_messages
from alignment.envs.base import Transition


class Echo:
    stop = None

    def reset(self, problems):
        return [prompt_messages(p) for p in problems]

    def step(self, problems, messages, replies):
        return [Transition([{"role": "user", "content": f"Turn {len(m) // 2}: go on."}], reward=0.25,
                           info={"tool_calls": 1}) for m in messages]


def build(cfg) -> Echo:
    return Echo()
