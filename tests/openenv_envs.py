"""An OpenEnv environment for the tests (``rollout.environment=openenv``), written as OpenEnv's template writes one:
pydantic ``Action`` / ``Observation`` models, a server-side ``Environment`` served by ``create_app`` (``app``, run
with uvicorn), and an ``EnvClient`` subclass (``GuessEnv``).

A number-guessing game: ``reset(seed=s)`` picks the secret digit ``s % 10`` and asks for it; each step reads the
first digit of the model's message: the secret ends the episode with reward 1, another digit gets "higher" or
"lower" (reward 0) and a message without a digit "Say one digit." (reward -0.1); the episode ends after
``GUESSES`` steps. A message holding ``crash`` kills the server process (a crashed environment).
"""

from __future__ import annotations

import os
import re
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

GUESSES = 3


class GuessAction(Action):
    """The model's message."""

    message: str = Field(..., description="the model's guess, in words")


class GuessObservation(Observation):
    """What the game says back."""

    prompt: str = Field(default="", description="the game's message to the player")


class GuessEnvironment(Environment):
    """The game (the module docstring)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state, self.secret = State(step_count=0), 0

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self.secret, self._state = (seed or 0) % 10, State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt="I am thinking of a digit from 0 to 9. Guess it: answer with one digit.",
                                done=False, reward=None)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        if "crash" in action.message:
            os._exit(1)
        self._state.step_count += 1
        digit = re.search(r"\d", action.message)
        last = self._state.step_count >= GUESSES
        if digit is None:
            return GuessObservation(prompt="Say one digit.", done=last, reward=-0.1)
        guess = int(digit.group())
        if guess == self.secret:
            return GuessObservation(prompt="Right!", done=True, reward=1.0)
        return GuessObservation(prompt="higher" if guess < self.secret else "lower", done=last, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=256)


class GuessEnv(EnvClient[GuessAction, GuessObservation, State]):
    """The game's client."""

    def _step_payload(self, action: GuessAction) -> dict:
        return {"message": action.message}

    def _parse_result(self, payload: dict) -> StepResult[GuessObservation]:
        obs = payload.get("observation", {})
        return StepResult(observation=GuessObservation(prompt=obs.get("prompt", ""), done=payload.get("done", False),
                                                       reward=payload.get("reward")),
                          reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))


class TwoFieldAction(Action):
    """An action with two text fields (which one the reply fills must be named)."""

    message: str = ""
    note: str = ""


class TwoFieldEnv(EnvClient[TwoFieldAction, GuessObservation, State]):
    """A client whose Action has two text fields."""

    def _step_payload(self, action: TwoFieldAction) -> dict:
        return {"message": action.message, "note": action.note}

    _parse_result = GuessEnv._parse_result
    _parse_state = GuessEnv._parse_state
