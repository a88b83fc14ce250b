"""``rollout.environment=verifiers``: an environment of prime-intellect's ``verifiers`` (the Environments Hub's
format, prime-rl's) as the job's task. ``rollout.environment_id`` names the module (or installed package) whose
``load_environment(**rollout.environment_args)`` builds it.

- Its dataset is the training prompts, its eval dataset (when it has one) the held-out prompts
  (:func:`environment_problems`): each row's ``prompt`` messages, ``answer``, ``info`` and ``task`` as the
  environment formatted them.
- Its rollouts play against the job's OpenAI-compatible rollout server, one client per episode
  (:func:`group_agent`; :mod:`alignment.rollout.agents.server`), so the recorded tokens are exactly the sampled
  ones, as for any agent; ``SingleTurnEnv``, ``MultiTurnEnv`` and ``ToolEnv`` alike.
- Its ``Rubric`` scores each task's group of episodes together (``score_group``: group-level reward functions
  see the whole group), and the weighted sum is the episode's environment reward: ``reward.functions``'
  ``environment`` term (the default here), which other terms may join.

The classic API (``vf.SingleTurnEnv``, ``vf.Rubric``, ``vf.load_environment``) is what Hub environments are
written against; verifiers 0.3 keeps it (0.4 dropped it for ``verifiers.v1``), so the ``environments`` extra pins
``verifiers>=0.3,<0.4``. Sampling is the job's: the rollout server applies ``rollout.temperature`` / ``top_p``
and ``rollout.agent_max_tokens_per_turn``, as prime-rl's trainer sets them, and the environment's own
``sampling_args`` are not sent.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import json
import logging
import signal
import threading
import typing
from collections.abc import Mapping
from typing import Any

from datasets.utils import logging as datasets_logging

from alignment.data.content import content_text
from alignment.data.prompt_data import PromptSets
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rollout.agents.programs import AgentError, GroupAgent
from alignment.rollout.agents.session import opening_ids
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["load_environment", "describe", "environment_problems", "environment_tools", "prompt_length",
           "group_agent", "MODEL_NAME"]

#: the model name the environment's requests carry (the rollout server serves one model: the policy)
MODEL_NAME = "megalign-policy"
#: the environments loaded in this process, by (environment_id, its arguments as JSON)
_LOADED: dict[tuple[str, str], Any] = {}


def _verifiers():
    """The ``verifiers`` module with the classic API, or an :class:`AgentError` saying how to install it."""
    if importlib.util.find_spec("verifiers") is None:
        raise AgentError("rollout.environment=verifiers needs the verifiers package, which is not installed: "
                         "pip install 'megalign[verifiers]' (verifiers 0.3)")
    import verifiers as vf
    if not hasattr(vf, "load_environment") or not hasattr(vf, "Rubric"):
        raise AgentError(f"rollout.environment=verifiers: verifiers {getattr(vf, '__version__', '?')} has no classic "
                         "API (vf.load_environment, vf.Rubric; 0.4 moved to verifiers.v1): pip install "
                         "'verifiers>=0.3,<0.4'")
    return vf


def load_environment(environment_id: str | None, args: Mapping[str, Any] | None = None):
    """The verifiers environment ``load_environment(**args)`` of the module ``environment_id`` builds (once per
    process; later calls with the same arguments return it). The module is imported as verifiers does: ``-``
    read as ``_``, a dotted path as given. verifiers installs SIGINT / SIGTERM handlers of its own when an
    environment is built; the job's are put back (a preemption's SIGTERM still checkpoints).

    Raises:
        AgentError: verifiers missing or without its classic API, no ``environment_id``, a module that does
            not import or has no ``load_environment``, one that raises, or returns no verifiers environment
            (each one line naming ``rollout.environment_id`` / ``environment_args``).
    """
    vf = _verifiers()
    if not environment_id:
        raise AgentError("rollout.environment=verifiers needs rollout.environment_id: the module (or installed "
                         "package) whose load_environment() builds the environment, e.g. tests.verifiers_envs")
    args = dict(args or {})
    key = (environment_id, json.dumps(args, sort_keys=True, default=str))
    if key in _LOADED:
        return _LOADED[key]
    main = threading.current_thread() is threading.main_thread()
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    given = f"rollout.environment_id={environment_id}"
    log = logging.getLogger("verifiers")  # its loader logs each failure too: the error below says it once
    level = log.level
    log.setLevel(logging.CRITICAL)
    bars = datasets_logging.is_progress_bar_enabled()  # the environment's dataset.map calls, once per rank
    datasets_logging.disable_progress_bar()
    try:
        env = vf.load_environment(environment_id, **args)
    except ValueError as e:  # verifiers' own error for a module that does not import
        cause = e.__cause__ or e
        raise AgentError(f"{given}: Could not import {environment_id!r} ({type(cause).__name__}: {cause}); give a "
                         "module on PYTHONPATH or an installed environment package") from e
    except Exception as e:  # noqa: BLE001 - the environment's own error, named
        cause = e.__cause__ or e
        raise AgentError(f"{given}: load_environment(**rollout.environment_args={args}) failed: "
                         f"{type(cause).__name__}: {cause}") from e
    finally:
        log.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()
        for s, handler in saved.items():
            signal.signal(s, handler)
    if not isinstance(env, vf.Environment):
        raise AgentError(f"{given}: load_environment() returned {type(env).__name__}, not a verifiers Environment")
    _LOADED[key] = env
    return env


def describe(env) -> str:
    """One line on ``env`` for the start-up summary: its class, turns and tools, its rubric's functions and
    weights (group-level ones marked), and the sampling settings of its own that the job's replace."""
    if hasattr(env, "env_map"):  # an EnvGroup: a row's task names the environment that plays it
        return f"EnvGroup of {', '.join(f'{name}: {describe(e)}' for name, e in env.env_map.items())}"
    pairs = [(f, w) for r in _rubrics(env.rubric) for f, w in zip(r.funcs, r.weights) if w]  # weight 0: a metric
    funcs = ", ".join(f"{getattr(f, '__name__', f)} x {w:g}{' (group)' if _group_level(f) else ''}" for f, w in pairs)
    turns = getattr(env, "max_turns", 1)
    tools = [t.name for t in env.tool_defs or []]
    own = {k: v for k, v in env.sampling_args.items() if k != "n" and v not in ({}, None)}
    return (f"{type(env).__name__}, {'at most ' + str(turns) if turns and turns > 0 else 'unlimited'} turn(s)"
            + (f", tools {', '.join(tools)}" if tools else "") + f"; rubric: {funcs or 'no function'}"
            + (f"; its sampling_args {own} are replaced by rollout.temperature / top_p / agent_max_tokens_per_turn"
               if own else ""))


#: the parameters that make a rubric function group-level (verifiers' Rubric: plural names, or a list returned)
_GROUP_PARAMETERS = {"states", "prompts", "completions", "answers", "tasks", "infos"}


def _rubrics(rubric) -> list:
    """A rubric and those of a RubricGroup (a multi-turn environment wraps its own with its monitors)."""
    return [x for r in getattr(rubric, "rubrics", [rubric]) for x in _rubrics(r)] if hasattr(rubric, "rubrics") \
        else [rubric]


def _group_level(fn) -> bool:
    sig = inspect.signature(fn)
    returns = sig.return_annotation
    return bool(set(sig.parameters) & _GROUP_PARAMETERS) or returns is list or typing.get_origin(returns) is list


def _problems(dataset) -> list[Problem]:
    out = []
    for row in dataset:
        row = dict(row)
        messages = tuple(dict(m) for m in row["prompt"])
        users = [m for m in messages if m.get("role") == "user"]
        question = content_text(users[-1]["content"]) if users else content_text(messages[-1]["content"])
        answer = row.get("answer")
        out.append(Problem(question, "" if answer is None else str(answer), FILE_TASK, messages=messages,
                           columns=row))
    return out


def environment_problems(env, environment_id: str) -> PromptSets:
    """``env``'s dataset as the training problems and its eval dataset (none: no held-out evaluation) as the
    held-out ones: each row's ``prompt`` messages as the problem's chat, its last user message's text as the
    question, ``answer`` as the reference, and the whole row (``prompt``, ``answer``, ``info``, ``task``,
    ``example_id``, as the environment formatted it) as its columns, which :func:`group_agent` is given back.

    Raises:
        AgentError: an environment without a training dataset, one whose dataset builder raises, or an empty
            dataset.
    """
    source = f"rollout.environment_id={environment_id}"
    if env.dataset is None and env.dataset_source is None:
        raise AgentError(f"{source}: the environment has no training dataset (only an eval dataset); give it one")
    bars = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:  # a dataset builder runs here, the first time a dataset is asked for
        train = _problems(env.get_dataset())
        held = env.build_eval_dataset()
    except Exception as e:  # noqa: BLE001 - the environment's own builder's error, named
        raise AgentError(f"{source}: building the environment's dataset failed: {type(e).__name__}: {e}") from e
    finally:
        if bars:
            datasets_logging.enable_progress_bar()
    if not train:
        raise AgentError(f"{source}: the environment's dataset is empty")
    heldout = _problems(held) if held is not None else []
    return PromptSets(train, heldout, len(train) + len(heldout), 0, (source,))


def environment_tools(env, problem: Problem) -> list[dict] | None:
    """The tools ``env``'s rollout of ``problem`` offers the model (a row's ``info["tool_defs"]``, else the
    environment's ``tool_defs``) as the OpenAI function schemas its client sends; None without tools."""
    info = problem.columns.get("info")
    info = json.loads(info) if isinstance(info, str) and info.strip().startswith("{") else info
    env = getattr(env, "env_map", {}).get(problem.columns.get("task"), env)  # an EnvGroup's member plays the row
    tools = info["tool_defs"] if isinstance(info, dict) and info.get("tool_defs") else env.tool_defs
    if not tools:
        return None
    out = []
    for t in tools:
        t = t if isinstance(t, dict) else t.model_dump()
        function = {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("parameters") or {}}
        if t.get("strict") is not None:
            function["strict"] = t["strict"]
        out.append({"type": "function", "function": function})
    return out


def prompt_length(env, turns: TurnTokens, problem: Problem) -> int:
    """Tokens of ``problem``'s prompt as the rollout server renders the environment's first request: its
    messages with the tools it offers (:func:`alignment.rollout.agents.session.opening_ids`)."""
    return len(opening_ids(turns, [dict(m) for m in problem.messages or ()], environment_tools(env, problem)))


def group_agent(env) -> GroupAgent:
    """A :data:`alignment.rollout.agents.programs.GroupAgent` that plays ``env``'s rollouts of one task row, one
    per base URL (each through its own ``OpenAIChatCompletionsClient``), then scores them together with the
    environment's rubric (``score_group``). Returns each episode's reward (the rubric's weighted sum).

    Raises (in the agent, which fails the group):
        AgentError: a rollout that ended with an error (the model's server refused a request, a tool raised
            where the environment does not catch it), naming the first.
    """
    vf = _verifiers()
    from openai import AsyncOpenAI  # the client the environment's rollouts call the server with

    class ServerClient(vf.OpenAIChatCompletionsClient):
        """verifiers' chat client, reading two of the rollout server's replies as training needs them: the
        empty ``length`` reply to a request past the episode's budget (nothing generated) is the context-length
        error a vLLM server gives (``OverlongPromptError``: the environment ends the episode, truncated); an
        empty answer the model chose to give (EOS at once) is an answer, trained on and scored, not an error."""

        async def raise_from_native_response(self, response: Any) -> None:
            try:
                await super().raise_from_native_response(response)
            except vf.EmptyModelResponseError:
                usage = getattr(response, "usage", None)
                if response.choices[0].finish_reason == "length" and not getattr(usage, "completion_tokens", 0):
                    raise vf.OverlongPromptError("the episode's budget (rollout.agent_max_tokens) is spent") from None

    async def play(base_urls: list[str], row: dict) -> list[float | None]:
        """``row``: the environment's own dataset row (its ``prompt``, ``answer``, ``info``, ``task``, ...)."""
        clients = [ServerClient(AsyncOpenAI(base_url=url, api_key="megalign", max_retries=0)) for url in base_urls]
        states: list[Any] = []
        try:  # every rollout ends (or fails) before any client closes
            states = await asyncio.gather(*(env.rollout(dict(row), c, MODEL_NAME, {}) for c in clients),
                                          return_exceptions=True)
            failed = [s for s in states if isinstance(s, BaseException)]
            if failed:
                raise failed[0]
            errors = [s.get("error") for s in states if s.get("error") is not None]
            if errors:
                raise AgentError(f"the environment's rollout ended with {type(errors[0]).__name__}: {errors[0]}")
            await env.rubric.score_group(states)
        finally:
            for s in states:  # the rubric's per-rollout resources (sandboxes), as verifiers' own group run frees them
                if not isinstance(s, BaseException):
                    await env.rubric.cleanup(s)
            for c in clients:
                await c.close()
        return [float(s["reward"]) for s in states]

    return play
