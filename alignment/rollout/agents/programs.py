"""Agent programs as rollouts: ``rollout.agent=pkg.module:run`` (``async def run(base_url, task_row) ->
reward | None``) or ``rollout.agent_command='python my_agent.py'`` (a program run with ``OPENAI_BASE_URL``
and the task in its environment) plays each episode against the rollout server
(:mod:`alignment.rollout.agents.server`), which records its tokens. ``rollout.agent_concurrency``
episodes run at once (asyncio); one that raises, exits non-zero or passes ``rollout.agent_timeout_s``
is dropped and counted (``failed`` / ``timeout``), never trained on half-recorded: its whole group is
masked out of the loss (:func:`episode_samples`), since the others' group-relative advantages would
be measured against a missing sample.

An agent's return value is the episode's environment reward (``Sample.info["env_reward"]``, trained on
with ``reward.functions: [{name: environment}]``); None leaves it unscored (NaN), and ``reward.functions``
grade the episode's last assistant message as they grade any answer.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import os
import shlex
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from alignment.data.tasks import Problem
from alignment.rollout.agents.session import AgentSession
from alignment.data.samples import Sample

__all__ = ["Agent", "GroupAgent", "AgentError", "load_agent", "command_agent", "task_row", "EpisodeOutcome",
           "EpisodeLoop", "play_episodes", "play_groups", "episode_samples", "AGENT_ENV"]

#: an agent: ``await agent(base_url, task_row)`` -> the episode's reward, or None
Agent = Callable[[str, dict], Awaitable[float | None]]
#: an agent that plays a task's whole group at once and scores it together (an environment hub's, whose rubric
#: may compare the group's episodes): ``await agent(base_urls, task_row)`` -> one reward (or None) per base_url
GroupAgent = Callable[[list[str], dict], Awaitable[list[float | None]]]
#: the environment variables an agent command gets (besides its parent's)
AGENT_ENV = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "MEGALIGN_TASK", "MEGALIGN_EPISODE")


T = TypeVar("T")


class EpisodeLoop:
    """One asyncio event loop for a process's episodes, run by a daemon thread of its own for the whole run. What an
    agent or an environment builds once (an ``AsyncOpenAI`` judge client, a sandbox client, a lock) is bound to the
    loop that first uses it, so every rollout phase's episodes run on this one: a fresh ``asyncio.run`` per phase
    would fail them from the second phase on ("Event loop is closed"), and a rubric that catches the error would
    score 0 in silence."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.error: BaseException | None = None  # what stopped the loop (a task's SystemExit or KeyboardInterrupt)
        self.thread = threading.Thread(target=self._forever, name="megalign-episodes", daemon=True)
        self.thread.start()

    def _forever(self) -> None:
        try:
            self.loop.run_forever()
        except BaseException as e:  # noqa: BLE001 - kept for run(), which raises it on the calling thread
            self.error = e

    def run(self, coroutine: Coroutine[Any, Any, T], serve: Callable[[Callable[[], bool]], object]) -> T:
        """Run ``coroutine`` on the loop while ``serve(until)`` works on the calling thread until ``until()`` (the
        coroutine is done, or the loop stopped); returns its result or raises its error (cancelled if ``serve``
        raises).

        Raises:
            RuntimeError: the loop stopped (an episode raised ``SystemExit`` or ``KeyboardInterrupt``, which
                asyncio lets out of its loop), naming why; the loop is not used again.
        """
        if not self.thread.is_alive():
            coroutine.close()
            raise RuntimeError(f"the episodes' event loop stopped earlier ({self.error!r})")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            serve(lambda: future.done() or not self.thread.is_alive())
        except BaseException:
            future.cancel()
            raise
        if not future.done():  # the loop's thread died under it: the future will never be done
            self.thread.join(timeout=5)
            raise RuntimeError(f"the episodes' event loop stopped: an episode raised {self.error!r}, which asyncio "
                               "does not contain; no episode of this phase is kept")
        return future.result()


class AgentError(ValueError):
    """An agent that cannot be loaded or run (the message names ``rollout.agent`` / ``agent_command``)."""


def load_agent(path: str) -> Agent:
    """``package.module:function``, an ``async def run(base_url, task_row)``.

    Raises:
        AgentError: the module does not import, has no such function, or it is not ``async def``
            with two parameters.
    """
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise AgentError(f"rollout.agent={path!r}: give package.module:function (an async def run(base_url, "
                         "task_row))")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise AgentError(f"rollout.agent={path}: module {module!r} does not import ({type(e).__name__}: {e}); is "
                         "it on PYTHONPATH (or installed)?") from e
    except AttributeError as e:
        raise AgentError(f"rollout.agent={path}: module {module!r} has no {attr!r}") from e
    if not inspect.iscoroutinefunction(fn):
        raise AgentError(f"rollout.agent={path} is not an async function; define it as async def "
                         f"{attr}(base_url, task_row)")
    if len(inspect.signature(fn).parameters) < 2:
        raise AgentError(f"rollout.agent={path} takes {len(inspect.signature(fn).parameters)} parameters; it is "
                         f"called as {attr}(base_url, task_row)")
    return fn


def command_agent(command: str) -> Agent:
    """``rollout.agent_command``: an agent that runs ``command`` (through the shell) per episode with
    ``OPENAI_BASE_URL`` (the episode's ``base_url``), ``OPENAI_API_KEY``, ``MEGALIGN_TASK`` (the task row
    as JSON) and ``MEGALIGN_EPISODE`` set. Its reward is the last line of its standard output when that is
    a number or ``{"reward": x}``, else None. A timeout kills the program (and its process group)."""

    async def run(base_url: str, row: dict) -> float | None:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "megalign",
               "MEGALIGN_TASK": json.dumps(row, default=str), "MEGALIGN_EPISODE": base_url.rstrip("/").split("/")[-2]}
        proc = await asyncio.create_subprocess_exec("/bin/sh", "-c", command, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE, start_new_session=True)
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:  # the episode timed out: the program goes with it
            _kill_group(proc.pid)
            await proc.wait()
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            raise AgentError(f"rollout.agent_command={shlex.quote(command)} exited with status {proc.returncode}: "
                             f"{tail[0][-300:]}")
        return _reward(out.decode(errors="replace"))

    return run


def _kill_group(pid: int) -> None:
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reward(stdout: str) -> float | None:
    lines = stdout.strip().splitlines()
    if not lines:
        return None
    last = lines[-1].strip()
    try:
        value = json.loads(last)
    except json.JSONDecodeError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def task_row(problem: Problem) -> dict:
    """What an agent is given about its task: a file's record (every column, the prompt under ``prompt``),
    or a built-in task's ``question``, ``answer`` and ``task``; ``messages`` when the prompt is a chat."""
    row = {"question": problem.question, "answer": problem.answer, "task": problem.task, **problem.columns}
    if problem.messages is not None:
        row["messages"] = [dict(m) for m in problem.messages]
    return row


@dataclass
class EpisodeOutcome:
    """One episode: its session (None if the agent never called the server), its reward, and how it ended
    (``ok``, ``failed``, ``timeout``; ``error`` the reason)."""

    session: AgentSession | None
    reward: float | None
    status: str = "ok"
    error: str = ""


async def play_episodes(agent: Agent, rows: Sequence[dict], n: int, session_url: Callable[[str], str],
                        pop_session: Callable[[str], AgentSession | None], concurrency: int, timeout_s: float,
                        prefix: str, playing: Callable[[int], None] | None = None) -> list[list[EpisodeOutcome]]:
    """``n`` episodes of ``agent`` per task row, at most ``concurrency`` at once, each cut at ``timeout_s``
    seconds; episode ``{prefix}-{i}-{k}`` talks to ``session_url(episode)``; ``playing(+1)`` / ``playing(-1)``
    as each starts and ends (:meth:`alignment.rollout.agents.server.RolloutServer.playing`). Returns ``[len(rows)][n]`` outcomes (no
    exception escapes: a failing episode is an outcome)."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(i: int, k: int) -> EpisodeOutcome:
        episode = f"{prefix}-{i}-{k}"
        async with gate:
            if playing is not None:
                playing(1)
            try:
                reward = await asyncio.wait_for(agent(session_url(episode), dict(rows[i])), timeout_s)
                status, error = "ok", ""
            except asyncio.TimeoutError:
                reward, status, error = None, "timeout", f"episode {episode}: past rollout.agent_timeout_s={timeout_s}"
            except Exception as e:  # noqa: BLE001 - the agent's own error: the episode is dropped and counted
                reward, status, error = None, "failed", f"episode {episode}: {type(e).__name__}: {e}"
            finally:
                if playing is not None:
                    playing(-1)
        session = pop_session(episode)
        if status == "ok" and session is None:
            status, error = "failed", f"episode {episode}: the agent never called the model"
        if status == "ok" and reward is not None and not isinstance(reward, (int, float)):
            status, error = "failed", f"episode {episode}: the agent returned {type(reward).__name__}, not a number"
        return EpisodeOutcome(session, None if reward is None else float(reward), status, error)

    outcomes = await asyncio.gather(*(one(i, k) for i in range(len(rows)) for k in range(n)))
    return [list(outcomes[i * n:(i + 1) * n]) for i in range(len(rows))]


async def play_groups(agent: GroupAgent, rows: Sequence[dict], n: int, session_url: Callable[[str], str],
                      pop_session: Callable[[str], AgentSession | None], concurrency: int, timeout_s: float,
                      prefix: str, playing: Callable[[int], None] | None = None) -> list[list[EpisodeOutcome]]:
    """As :func:`play_episodes`, for an agent that plays and scores a task's ``n`` episodes together: each group
    is one call, ``agent([session_url(f"{prefix}-{i}-{k}") for k in range(n)], rows[i])``; at most
    ``concurrency`` episodes at once (``concurrency // n`` groups, at least one), each group cut at ``timeout_s``
    seconds. A group whose call raises, times out, returns other than ``n`` numbers or Nones, or leaves an
    episode that never called the model, is failed whole (every outcome ``failed`` / ``timeout``). Returns
    ``[len(rows)][n]`` outcomes (no exception escapes)."""
    gate = asyncio.Semaphore(max(1, concurrency // max(1, n)))

    async def one(i: int) -> list[EpisodeOutcome]:
        episodes = [f"{prefix}-{i}-{k}" for k in range(n)]
        rewards: list[float | None] = [None] * n
        async with gate:
            if playing is not None:
                playing(n)
            try:
                got = await asyncio.wait_for(agent([session_url(e) for e in episodes], dict(rows[i])), timeout_s)
                status, error = "ok", ""
                if not isinstance(got, (list, tuple)) or len(got) != n or not all(
                        r is None or (isinstance(r, (int, float)) and not isinstance(r, bool)) for r in got):
                    status, error = "failed", (f"group {prefix}-{i}: the agent returned {got!r:.80}, not {n} "
                                               "rewards (numbers or None)")
                else:
                    rewards = [None if r is None else float(r) for r in got]
            except asyncio.TimeoutError:
                status, error = "timeout", f"group {prefix}-{i}: past rollout.agent_timeout_s={timeout_s}"
            except Exception as e:  # noqa: BLE001 - the agent's own error: the group is dropped and counted
                status, error = "failed", f"group {prefix}-{i}: {type(e).__name__}: {e}"
            finally:
                if playing is not None:
                    playing(-n)
        sessions = [pop_session(e) for e in episodes]
        if status == "ok" and any(s is None for s in sessions):
            status, error = "failed", f"episode {episodes[sessions.index(None)]}: the agent never called the model"
        return [EpisodeOutcome(s, r, status, error) for s, r in zip(sessions, rewards)]

    return list(await asyncio.gather(*(one(i) for i in range(len(rows)))))


def episode_samples(groups: list[list[EpisodeOutcome]], filler_id: int) -> list[list[Sample]]:
    """The episodes as samples, ``[len(groups)][n]``: a finished episode's record
    (:meth:`AgentSession.sample`, its reward in ``info["env_reward"]``, NaN when the agent returned None);
    in a group with a failed or timed-out episode, every sample's loss mask is 0 (nothing of the group is
    trained on) and the failed ones are one ``filler_id`` token. ``info["agent_status"]``: how each ended."""
    out = []
    for group in groups:
        dropped = any(o.status != "ok" for o in group)
        samples = []
        for o in group:
            if o.status == "ok":
                s = o.session.sample()
            else:  # nothing of a half-recorded episode is kept
                prompt = list(o.session.prompt_ids) if o.session is not None and o.session.prompt_ids else [filler_id]
                s = Sample(prompt, [filler_id], [0.0], "", False, [0], {"turns": 0})
            s.info["env_reward"] = math.nan if o.reward is None else o.reward
            s.info["agent_status"] = o.status
            if dropped:
                s.loss_mask = [0] * len(s.response_ids)
            samples.append(s)
        out.append(samples)
    return out
