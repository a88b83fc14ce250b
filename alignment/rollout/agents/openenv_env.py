"""``rollout.environment=openenv``: an environment of Meta's OpenEnv (Gymnasium-style ``reset`` / ``step`` servers,
as TRL and SkyRL train on) as the job's task. ``rollout.environment_id=package.module:Client`` names its
``EnvClient`` subclass; ``rollout.environment_args`` (:data:`ARGS`) say where its server is: ``url`` (a server
already running) or ``app`` (``package.module:app``, the ASGI app megalign serves with uvicorn in a subprocess of
each serving rank, restarted when it dies).

An episode (:func:`episode_agent`): ``reset(seed=...)``'s observation is the first user message; each model reply is
sent as the action (the Action's text field) through ``step()``; the observation is the next user message; the
step rewards add up to the episode's environment reward, and ``done`` (or ``max_turns`` replies, or the episode's
token budget) ends it. The model is called through the job's rollout server with the ``openai`` client, so the
recorded tokens are the sampled ones, as for any agent. A task is a reset seed: ``train_size`` of them train,
``heldout_size`` others are held out; a group's episodes share their seed.

A server that does not answer, an episode whose ``reset`` / ``step`` fails or times out, a crashed server: the
episode is dropped and counted and its group masked, as an agent's failure is.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading
import time
import tempfile
import typing
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignment.data.prompt_data import PromptSets
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rollout.agents.programs import Agent, AgentError

__all__ = ["ARGS", "OpenEnvSpec", "openenv_spec", "EnvServer", "check_server", "check_app", "MAX_FAILED_STARTS",
           "openenv_problems", "reply_text", "episode_agent", "describe", "HELDOUT_SEED"]

#: ``rollout.environment_args`` an OpenEnv environment takes, with their defaults
ARGS: dict[str, Any] = {"url": None, "app": None, "action_field": None, "observation_field": None,
                        "train_size": 1000, "heldout_size": 0, "max_turns": 8, "reset_kwargs": {},
                        "system_prompt": None, "timeout_s": 60.0}
#: the first held-out task's reset seed (training tasks are seeds 0 .. train_size - 1)
HELDOUT_SEED = 1_000_000
_MODEL = "megalign-policy"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")
#: consecutive failed starts of an app's server after which its rank stops trying (each episode would wait again)
MAX_FAILED_STARTS = 3
# runs the app in the server's process: SIGUSR1 ignored (Slurm's preemption notice is for the trainer, which
# checkpoints; `scancel --signal=USR1` reaches every process of the step), and gone when its parent is gone
_BOOT = ("import os, signal, sys, threading, time, uvicorn\n"
         "signal.signal(signal.SIGUSR1, signal.SIG_IGN)\n"
         "parent = os.getppid()\n"
         "def orphaned():\n"
         "    while os.getppid() == parent: time.sleep(1)\n"
         "    os._exit(0)\n"
         "threading.Thread(target=orphaned, daemon=True).start()\n"
         "uvicorn.run(sys.argv[1], host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n")


@dataclass(frozen=True)
class OpenEnvSpec:
    """An OpenEnv environment as a job uses it: its client class, the Action class and the Action field the
    model's reply fills, the Observation field that is the next message, where its server is, its tasks and
    turns (:data:`ARGS`)."""

    environment_id: str
    client: type
    action: type
    observation: type
    action_field: str
    observation_field: str
    url: str | None
    app: str | None
    train_size: int
    heldout_size: int
    max_turns: int
    reset_kwargs: dict = field(default_factory=dict)
    system_prompt: str | None = None
    timeout_s: float = 60.0


def _resolve(given: str, module: str, attr: str) -> Any:
    """``module``'s ``attr``, or an :class:`AgentError` that starts with ``given`` (the setting)."""
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise AgentError(f"{given}: module {module!r} does not import ({type(e).__name__}: {e})") from e
    except AttributeError as e:
        raise AgentError(f"{given}: module {module!r} has no {attr!r}") from e


def _text_fields(model: type, skip: tuple[str, ...]) -> list[str]:
    return [name for name, f in model.model_fields.items() if name not in skip and f.annotation is str]


def _model_types(client: type) -> tuple[type, type]:
    """The Action and Observation classes ``client`` (an ``EnvClient[Action, Observation, State]``) names."""
    from openenv.core import EnvClient

    for klass in client.__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            if typing.get_origin(base) is EnvClient:
                action, observation, _ = typing.get_args(base)
                return action, observation
    raise AgentError(f"rollout.environment_id={client.__module__}:{client.__name__} is not EnvClient[Action, "
                     "Observation, State] with its classes given: subclass it with them")


def openenv_spec(environment_id: str | None, args: Mapping[str, Any] | None = None) -> OpenEnvSpec:
    """The environment ``environment_id`` (``package.module:Client``) and ``args`` name.

    Raises:
        AgentError: openenv-core missing; no or a malformed ``environment_id``, a module that does not import or a
            class that is no ``EnvClient``; an unknown argument, neither or both of ``url`` and ``app``; an Action
            or Observation without one text field (give ``action_field`` / ``observation_field``).
    """
    if importlib.util.find_spec("openenv") is None:
        raise AgentError("rollout.environment=openenv needs the openenv-core package, which is not installed: "
                         "pip install 'megalign[openenv]' (openenv-core 0.3)")
    from openenv.core import EnvClient

    given = f"rollout.environment_id={environment_id}"
    module, _, name = str(environment_id or "").partition(":")
    if not module or not name:
        raise AgentError(f"rollout.environment=openenv needs rollout.environment_id=package.module:Client, its "
                         f"EnvClient subclass (got {environment_id!r})")
    client = _resolve(given, module, name)
    if not (isinstance(client, type) and issubclass(client, EnvClient)):
        raise AgentError(f"{given} is not an openenv EnvClient subclass")
    a = dict(args or {})
    unknown = sorted(set(a) - set(ARGS))
    if unknown:
        raise AgentError(f"rollout.environment_args has {', '.join(unknown)}, which an OpenEnv environment does not "
                         f"take; valid: {', '.join(ARGS)}")
    a = {**ARGS, **a}
    if bool(a["url"]) == bool(a["app"]):
        raise AgentError("rollout.environment=openenv: give rollout.environment_args.url (a running server) or .app "
                         "(package.module:app, served here with uvicorn), one of them")
    action, observation = _model_types(client)
    picked = []
    for kind, model, skip, key in (("Action", action, ("metadata",), "action_field"),
                                   ("Observation", observation, ("metadata", "done", "reward"), "observation_field")):
        fields = _text_fields(model, skip)
        if a[key] is None and len(fields) != 1:
            raise AgentError(f"{given}: its {kind} ({model.__name__}) has {len(fields)} text fields "
                             f"({', '.join(fields) or 'none'}): name the one the {'reply fills' if kind == 'Action' else 'next message is'} "
                             f"with rollout.environment_args.{key}")
        if a[key] is not None and a[key] not in model.model_fields:
            raise AgentError(f"rollout.environment_args.{key}={a[key]}: {model.__name__} has no such field (its "
                             f"fields: {', '.join(model.model_fields)})")
        picked.append(a[key] or fields[0])
    for key in ("train_size", "max_turns"):
        if not isinstance(a[key], int) or a[key] < 1:
            raise AgentError(f"rollout.environment_args.{key}={a[key]!r}: must be an integer >= 1")
    if not isinstance(a["heldout_size"], int) or a["heldout_size"] < 0:
        raise AgentError(f"rollout.environment_args.heldout_size={a['heldout_size']!r}: must be an integer >= 0")
    for key in ("train_size", "heldout_size"):  # the training seeds stay below the held-out ones
        if a[key] > HELDOUT_SEED:
            raise AgentError(f"rollout.environment_args.{key}={a[key]}: at most {HELDOUT_SEED} (the held-out tasks "
                             f"are reset seeds from {HELDOUT_SEED})")
    if not isinstance(a["reset_kwargs"] or {}, Mapping) or "seed" in (a["reset_kwargs"] or {}):
        raise AgentError(f"rollout.environment_args.reset_kwargs={a['reset_kwargs']!r}: give a mapping of reset()'s "
                         "keyword arguments, without seed (each task is its seed)")
    if isinstance(a["timeout_s"], bool) or not isinstance(a["timeout_s"], (int, float)) or a["timeout_s"] <= 0:
        raise AgentError(f"rollout.environment_args.timeout_s={a['timeout_s']!r}: must be a number of seconds > 0")
    return OpenEnvSpec(str(environment_id), client, action, observation, picked[0], picked[1], a["url"], a["app"],
                       a["train_size"], a["heldout_size"], a["max_turns"], dict(a["reset_kwargs"] or {}),
                       a["system_prompt"], float(a["timeout_s"]))


def check_server(url: str, timeout_s: float = 10.0) -> None:
    """The server at ``url`` answers ``GET /health`` (a loopback address directly, never through ``http_proxy``).

    Raises:
        AgentError: it does not within ``timeout_s`` seconds, naming ``rollout.environment_args.url``.
    """
    host = urllib.parse.urlsplit(url).hostname or ""
    opener = urllib.request.build_opener(*([urllib.request.ProxyHandler({})] if host in _LOOPBACK else []))
    try:
        with opener.open(f"{url.rstrip('/')}/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:  # it answered
        return
    except (OSError, ValueError) as e:
        raise AgentError(f"rollout.environment_args.url={url} does not answer ({type(e).__name__}: {e}); start the "
                         "environment's server, or give rollout.environment_args.app to have it served here") from e


def check_app(app: str) -> None:
    """``app`` (``package.module:attr``) imports and names an object, checked before any process starts.

    Raises:
        AgentError: naming ``rollout.environment_args.app``.
    """
    module, _, attr = app.partition(":")
    given = f"rollout.environment_args.app={app}"
    if not module or not attr:
        raise AgentError(f"{given}: give package.module:app, the environment's ASGI app (create_app(...))")
    found = _resolve(given, module, attr)
    if not callable(found):
        raise AgentError(f"{given} is a {type(found).__name__}, not an ASGI app")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EnvServer:
    """Where a rank's episodes find the environment: ``url``, or the ``app`` served with uvicorn on a free port of
    127.0.0.1 in a subprocess (its output in ``log``, a temporary file when None; it ignores Slurm's SIGUSR1
    preemption notice, exits when its parent does and is stopped at exit), started at the first :meth:`url_now`
    and again when it has died (a crashed environment: its episodes failed, the next ones get a new server), until
    :data:`MAX_FAILED_STARTS` starts in a row failed."""

    def __init__(self, spec: OpenEnvSpec, log: Path | None = None):
        self.spec = spec
        self.log = log if log is not None else Path(tempfile.mkstemp(prefix="megalign-openenv-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0
        self.failed_starts = 0  # in a row
        self.last_error = ""
        self._lock = threading.Lock()

    def url_now(self) -> str:
        """The server's URL, the app (re)started first when it is not running.

        Raises:
            AgentError: the app's server does not answer within ``timeout_s`` (its exit status and its log's last
                line), or its last :data:`MAX_FAILED_STARTS` starts failed (not tried again).
        """
        if self.spec.url:
            return self.spec.url
        with self._lock:
            if self.proc is None or self.proc.poll() is not None:
                if self.failed_starts >= MAX_FAILED_STARTS:
                    raise AgentError(f"{self.last_error} (its last {MAX_FAILED_STARTS} starts failed: not started "
                                     "again)")
                if self.starts == 0:
                    atexit.register(self.close)
                try:
                    self._start()
                except AgentError as e:
                    self.failed_starts, self.last_error = self.failed_starts + 1, str(e)
                    raise
                self.failed_starts = 0
            return f"http://127.0.0.1:{self.port}"

    def _start(self) -> None:
        self.port, self.starts = _free_port(), self.starts + 1
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(self.spec.app), str(self.port)],
                                         stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        deadline = time.monotonic() + self.spec.timeout_s
        url = f"http://127.0.0.1:{self.port}"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AgentError(f"rollout.environment_args.app={self.spec.app}: its server exited with status "
                                 f"{self.proc.returncode}: {self._last_line()} (its log: {self.log})")
            try:
                check_server(url, timeout_s=1.0)
                return
            except AgentError:
                time.sleep(0.1)
        self.close()
        raise AgentError(f"rollout.environment_args.app={self.spec.app}: its server did not answer within "
                         f"{self.spec.timeout_s:g} s (rollout.environment_args.timeout_s; its log: {self.log})")

    def _last_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = self.log.read_bytes()[-4096:].decode(errors="replace").strip().splitlines()
            return lines[-1][-300:] if lines else ""
        return ""

    def close(self) -> None:
        """Stop the app's server (nothing for a ``url``)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


def openenv_problems(spec: OpenEnvSpec) -> PromptSets:
    """The tasks: ``train_size`` training episodes (reset seeds 0, 1, ...) and ``heldout_size`` held-out ones (seeds
    from :data:`HELDOUT_SEED`), each a :class:`Problem` whose ``columns`` hold its ``seed``; the prompt is the
    episode's first observation, known once it is reset (so no prompt length is checked before start)."""
    def task(seed: int) -> Problem:
        return Problem(f"{spec.client.__name__} episode, reset seed {seed}", "", FILE_TASK, columns={"seed": seed})

    train = [task(s) for s in range(spec.train_size)]
    heldout = [task(HELDOUT_SEED + s) for s in range(spec.heldout_size)]
    return PromptSets(train, heldout, len(train) + len(heldout), 0, (f"rollout.environment_id={spec.environment_id}",))


def describe(spec: OpenEnvSpec) -> str:
    """One line on the environment for the start-up summary."""
    where = f"server {spec.url}" if spec.url else f"app {spec.app} served by each rank"
    return (f"{where}; the reply is {spec.action.__name__}.{spec.action_field}, the next "
            f"message {spec.observation.__name__}.{spec.observation_field}; at most {spec.max_turns} turn(s), reward: the sum of the steps'; the prompts "
            "are each episode's first observation (rollout.max_model_len: the model's unless set)")


def reply_text(message: Any) -> str:
    """The model's reply as the action's text: the message's content, and any tool calls the rollout server parsed
    off it put back as the Hermes ``<tool_call>`` blocks the model wrote (an OpenEnv action is the whole reply)."""
    calls = [f'<tool_call>\n{{"name": {json.dumps(c.function.name)}, "arguments": {c.function.arguments}}}\n</tool_call>'
             for c in (message.tool_calls or [])]
    return "\n".join([message.content or "", *calls]).strip() if calls else (message.content or "")


def episode_agent(spec: OpenEnvSpec, server: EnvServer) -> Agent:
    """An :data:`alignment.rollout.agents.programs.Agent` that plays one episode (the module docstring) and returns
    the sum of its step rewards.

    Raises (in the agent, which fails the episode): whatever the environment's client raises (a server that does
    not answer, a crashed one, a timeout) and :class:`AgentError` for a server that cannot be restarted.
    """
    from openai import AsyncOpenAI

    async def run(base_url: str, row: dict) -> float | None:
        url = await asyncio.to_thread(server.url_now)
        env = spec.client(base_url=url, message_timeout_s=spec.timeout_s)
        model = AsyncOpenAI(base_url=base_url, api_key="megalign", max_retries=0)
        try:
            result = await env.reset(seed=row["seed"], **spec.reset_kwargs)
            messages = [{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else []
            messages.append({"role": "user", "content": str(getattr(result.observation, spec.observation_field))})
            total = 0.0
            for _ in range(spec.max_turns):
                if result.done:
                    break
                reply = await model.chat.completions.create(model=_MODEL, messages=messages)
                choice = reply.choices[0]
                if choice.finish_reason == "length" and not (reply.usage and reply.usage.completion_tokens):
                    break  # the episode's budget is spent: the server generated nothing
                messages.append(choice.message.model_dump(exclude_none=True))
                result = await env.step(spec.action(**{spec.action_field: reply_text(choice.message)}))
                total += float(result.reward or 0.0)
                if not result.done:
                    messages.append({"role": "user",
                                     "content": str(getattr(result.observation, spec.observation_field))})
            return total
        finally:
            with contextlib.suppress(Exception):  # a crashed server: the episode's own error is what counts
                await env.close()
            await model.close()

    return run
