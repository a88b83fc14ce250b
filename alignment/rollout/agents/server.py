"""The rollout server: during the rollout phase, an OpenAI-compatible HTTP endpoint on 127.0.0.1 in front of
a rank's rollout engine, so that any agent program written against the OpenAI API (the ``openai`` client,
LangGraph, the Agents SDK, its own ReAct loop) can be trained by changing only its ``base_url``, as
AReaL's proxy and verl's agent loop allow.

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (and ``GET /v1/models``). The episode is named
  by the path, ``{base}/sessions/{episode_id}/v1`` (:meth:`RolloutServer.session_url`), or by the
  ``X-Megalign-Episode`` header on ``{base}/v1``.
- Each episode's tokens are recorded token-in/token-out (:class:`alignment.rollout.agents.session.AgentSession`):
  the exact ids of every turn, the sampled tokens' logprobs, the loss mask. A request that rewrites the
  history gets HTTP 400 with the reason.
- Requests carry ``tools`` (OpenAI function schemas, rendered by the chat template), ``temperature``,
  ``top_p``, ``max_tokens`` / ``max_completion_tokens`` and ``stop``; replies carry the model's Hermes
  tool calls parsed into ``tool_calls``, ``finish_reason`` and ``usage``.
- Generation runs on the thread that calls :meth:`RolloutServer.serve` (the rank's own, which owns the
  engine): the HTTP thread only queues requests, and ``serve`` takes every queued request at once and
  generates them in one engine call per distinct sampling setting. Outside ``serve`` (a weight sync, the
  trainer's phases) requests wait in the queue; none fails.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from alignment.rollout.agents.session import AgentSession, EpisodeTooLong, HistoryRewritten
from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.episodes.multi_turn import cut_sample
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["RolloutServer", "EPISODE_HEADER"]

EPISODE_HEADER = "X-Megalign-Episode"
#: a generate function: prompts (token ids) and one sampling setting -> ``[len(prompts)][1]`` samples
Generate = Callable[[list[list[int]], SamplingConfig], list[list[Sample]]]


class _BadRequest(ValueError):
    pass


@dataclass
class _Pending:
    ids: list[int]
    sampling: SamplingConfig
    future: Future


def _sampling(body: dict, defaults: SamplingConfig, budget: int, stop: Sequence[str], stop_strings: bool = True
              ) -> SamplingConfig:
    """The request's sampling settings over ``defaults``, its ``max_tokens`` capped at the episode's ``budget``.

    Raises:
        _BadRequest: ``n`` other than 1, a setting out of range, or ``stop`` strings for an engine
            without them (``stop_strings`` False).
    """
    if int(body.get("n") or 1) != 1:
        raise _BadRequest(f"n={body.get('n')}: the rollout server records one answer per request; send n=1 "
                          "(run more episodes for more samples)")
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    max_tokens = min(int(asked), budget) if asked else budget
    temperature = float(body["temperature"]) if body.get("temperature") is not None else defaults.temperature
    top_p = float(body["top_p"]) if body.get("top_p") is not None else defaults.top_p
    if temperature < 0 or not 0 < top_p <= 1 or max_tokens < 1:
        raise _BadRequest(f"temperature={temperature}, top_p={top_p}, max_tokens={max_tokens}: need temperature >= 0, "
                          "0 < top_p <= 1 and max_tokens >= 1")
    asked_stop = body.get("stop")
    words = [asked_stop] if isinstance(asked_stop, str) else list(asked_stop or [])
    if words and not stop_strings:
        raise _BadRequest(f"stop={words}: this job's engine (rollout.backend=megatron) ends turns at EOS only; "
                          "drop stop, or train with rollout.backend=vllm")
    words = list(dict.fromkeys(words + list(stop))) or None
    return SamplingConfig(n=1, temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=words)


class RolloutServer:
    """The OpenAI-compatible endpoint of one rank's engine (see the module docstring).

    Args:
        turns: the chat template's turn tokens (``Models.episodes.turns``).
        generate: the engine's generation (e.g. ``engine.generate``); called on :meth:`serve`'s thread.
        max_tokens: each episode's token budget after its prompt (``rollout.max_tokens``).
        defaults: sampling settings a request does not give (the rollout's temperature and top-p).
        tool_stop: stop strings added to every chat request: a turn ends at its tool call, as the
            multi-turn tool environment's turns do (the end of the turn is then the template's, mask 0).
        max_tokens_per_turn: the most tokens of one reply (``rollout.max_tokens_per_turn``; None: what is
            left of the episode's budget); a request's own ``max_tokens`` may ask for fewer.
        stop_strings: whether the engine takes stop strings (Megatron's does not: requests with ``stop``
            are refused, and ``tool_stop`` should be empty).
        batch_window_s: after a request arrives, the engine call waits for the others, which reach the
            server one by one, so that they share a batch (the engine generates a static batch per call,
            unlike vLLM's own server: without waiting, the first request of a turn went alone and the rest
            waited for it): until every episode being played (:meth:`playing`) has a request queued, or no
            request arrived for ``batch_window_s`` (an episode running a tool), or ``batch_max_wait_s`` passed.
        model: the model name ``/v1/models`` lists and replies carry.
        max_model_len: the engine's context (``rollout.max_model_len``): a request whose episode's prompt and
            budget pass it is refused (HTTP 400, naming both; the episode fails and is counted) instead of
            reaching the engine, which would fail the whole batch. None: not checked (every prompt was fitted).
    """

    def __init__(self, turns: TurnTokens, generate: Generate, max_tokens: int,
                 defaults: SamplingConfig | None = None, tool_stop: Sequence[str] = ("</tool_call>",),
                 model: str = "megalign-policy", stop_strings: bool = True, max_tokens_per_turn: int | None = None,
                 batch_window_s: float = 0.05, batch_max_wait_s: float = 1.0, max_model_len: int | None = None):
        self.turns, self.generate, self.max_tokens = turns, generate, max_tokens
        self.max_model_len = max_model_len
        self.batch_window_s, self.batch_max_wait_s = batch_window_s, batch_max_wait_s
        self._playing = 0  # episodes being played (the agent runner's count)
        self.defaults = defaults or SamplingConfig()
        self.tool_stop, self.model, self.stop_strings = list(tool_stop), model, stop_strings
        self.max_tokens_per_turn = max_tokens_per_turn
        #: sampling settings that replace the requests' own temperature and top-p (None: the requests'),
        #: e.g. greedy for a held-out evaluation; ``max_tokens`` (above) is the budget of sessions started from now
        self.force: SamplingConfig | None = None
        self.sessions: dict[str, AgentSession] = {}
        self._busy: set[str] = set()
        self._lock = threading.Lock()
        self._queue: queue.Queue[_Pending] = queue.Queue()
        self._ids = itertools.count()
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""
        self.requests = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self, host: str = "127.0.0.1", port: int = 0, timeout_s: float = 30.0) -> str:
        """Serve HTTP on ``host:port`` (0: a free port) in a daemon thread; returns the base URL once
        the server accepts connections.

        Raises:
            RuntimeError: the server did not come up within ``timeout_s``.
        """
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="megalign-rollout-server")
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the rollout server on {host}:{sock.getsockname()[1]} did not start "
                                   f"within {timeout_s} s")
            time.sleep(0.01)
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        return self.url

    def close(self) -> None:
        """Stop the HTTP server (requests still queued are failed with HTTP 503)."""
        while True:
            try:
                self._queue.get_nowait().future.set_exception(RuntimeError("the rollout server closed"))
            except queue.Empty:
                break
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None

    def session_url(self, episode_id: str) -> str:
        """The ``base_url`` an agent of episode ``episode_id`` talks to (OpenAI clients append ``/chat/completions``)."""
        return f"{self.url}/sessions/{episode_id}/v1"

    def playing(self, delta: int) -> None:
        """The agent runner's count of episodes being played, changed by ``delta`` (+1 when one starts, -1
        when it ends): an engine call goes as soon as each of them has a request queued."""
        with self._lock:
            self._playing += delta

    def pop_session(self, episode_id: str) -> AgentSession | None:
        """The episode's record, removed from the server (None if it never sent a request)."""
        with self._lock:
            return self.sessions.pop(episode_id, None)

    # ------------------------------------------------------------------ generation (the engine's thread)

    def serve(self, until: Callable[[], bool], poll_s: float = 0.002, on_idle: Callable[[], None] | None = None) -> int:
        """Generate for queued requests, batch after batch, until ``until()`` is true (checked between
        batches); returns the number of requests answered. Call it on the thread that owns the engine.
        ``on_idle``: called whenever ``poll_s`` passed without a request."""
        answered = 0
        while not until():
            batch = self._take(poll_s)
            if not batch:
                if on_idle is not None:
                    on_idle()
                continue
            answered += len(batch)
            groups: dict[tuple, list[_Pending]] = {}
            for p in batch:  # one engine call per sampling setting; the budget is cut per request afterwards
                key = (p.sampling.temperature, p.sampling.top_p, tuple(p.sampling.stop or ()))
                groups.setdefault(key, []).append(p)
            for group in groups.values():
                sampling = replace(group[0].sampling, max_tokens=max(p.sampling.max_tokens for p in group))
                try:
                    outs = self.generate([p.ids for p in group], sampling)
                except Exception as e:  # noqa: BLE001 - handed to each waiting request, then raised here
                    for p in group:
                        p.future.set_exception(e)
                    raise
                for p, [s] in zip(group, outs):
                    p.future.set_result(cut_sample(s, p.sampling.max_tokens, self.turns.tokenizer))
        return answered

    def _take(self, poll_s: float) -> list[_Pending]:
        try:
            first = self._queue.get(timeout=poll_s)
        except queue.Empty:
            return []
        batch, deadline = [first], time.monotonic() + self.batch_max_wait_s
        while True:  # until every episode played waits, the queue was quiet for batch_window_s, or the deadline
            if 0 < self._playing <= len(batch):
                return batch
            wait = min(self.batch_window_s, deadline - time.monotonic())
            try:
                batch.append(self._queue.get(timeout=wait) if wait > 0 else self._queue.get_nowait())
            except queue.Empty:
                return batch

    # ------------------------------------------------------------------ HTTP (the server's thread)

    def _app(self) -> FastAPI:
        app = FastAPI(title="megalign rollout server")

        async def handle(request: Request, episode: str | None, kind: str):
            episode = episode or request.headers.get(EPISODE_HEADER)
            if not episode:
                return _error(400, f"no episode: use {self.url}/sessions/<episode_id>/v1 as base_url, or send the "
                                   f"{EPISODE_HEADER} header")
            try:
                body = await request.json()
            except ValueError:
                return _error(400, "the request body is not JSON")
            try:
                pending, session = self._admit(episode, body, kind)
            except EpisodeTooLong:  # the budget is spent: the episode ends, as a multi-turn episode is cut there
                return JSONResponse(self._spent(episode, kind))
            except (_BadRequest, HistoryRewritten) as e:
                return _error(400, str(e))
            try:
                sample = await asyncio.wrap_future(pending.future)
            except Exception as e:  # noqa: BLE001 - the engine failed: the agent sees why
                self._release(episode)
                return _error(503, f"generation failed: {e}")
            reply = self._reply(session, sample, kind, len(pending.ids))
            self._release(episode)
            return JSONResponse(reply)

        for prefix in ("", "/sessions/{episode}"):  # the episode in the path, or in the header
            for path, kind in (("/v1/chat/completions", "chat"), ("/v1/completions", "text")):
                app.add_api_route(prefix + path, _route(handle, kind), methods=["POST"])

        @app.get("/v1/models")
        @app.get("/sessions/{episode}/v1/models")
        async def models(episode: str | None = None):
            return {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "megalign"}]}

        return app

    def _admit(self, episode: str, body: dict, kind: str) -> tuple[_Pending, AgentSession]:
        """Record the request in its session and queue its generation."""
        with self._lock:
            if episode in self._busy:
                raise _BadRequest(f"episode {episode}: a request is already in flight; an episode's requests "
                                  "follow one another (wait for the reply)")
            session = self.sessions.get(episode)
            if session is None:
                session = self.sessions[episode] = AgentSession(self.turns, episode, self.max_tokens)
            stop = self.tool_stop if kind == "chat" else []
            _sampling(body, self.defaults, self.max_tokens, stop, self.stop_strings)  # refused before the session changes
            if kind == "chat":
                if not isinstance(body.get("messages"), list):
                    raise _BadRequest("messages: a list of chat messages is required")
                ids = session.request_ids(body["messages"], body.get("tools"))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    prompt = list(self.turns.tokenizer.encode(prompt, add_special_tokens=False))
                if not isinstance(prompt, list) or not prompt or not all(isinstance(i, int) for i in prompt):
                    raise _BadRequest("prompt: a string or a list of token ids is required")
                ids = session.request_token_ids(prompt)
            if self.max_model_len is not None and len(session.prompt_ids) + session.max_tokens > self.max_model_len:
                raise _BadRequest(f"episode {episode}: its prompt is {len(session.prompt_ids)} tokens, which with "
                                  f"the episode's budget of {session.max_tokens} (rollout.max_tokens) passes "
                                  f"rollout.max_model_len={self.max_model_len}; raise rollout.max_model_len or "
                                  "shorten the prompt")
            turn_cap = min(session.budget, self.max_tokens_per_turn or session.budget)
            sampling = _sampling(body, self.defaults, turn_cap, stop, self.stop_strings)
            if self.force is not None:
                sampling = replace(sampling, temperature=self.force.temperature, top_p=self.force.top_p)
            self._busy.add(episode)
            self.requests += 1
        pending = _Pending(ids, sampling, Future())
        self._queue.put(pending)
        return pending, session

    def _spent(self, episode: str, kind: str) -> dict:
        """The reply to a request whose new messages leave no room in the episode's budget: no tokens,
        ``finish_reason`` ``length`` (an agent loop ends on a reply without tool calls); nothing is recorded,
        so the episode's sample ends with the model's last turn."""
        return self._envelope(episode, kind, {"role": "assistant", "content": ""}, "", "length", "length", 0, 0)

    def _envelope(self, episode: str, kind: str, message: dict, text: str, finish: str, text_finish: str,
                  prompt_tokens: int, completion_tokens: int) -> dict:
        """An OpenAI reply: a ``chat.completion`` with ``message`` or a ``text_completion`` with ``text``."""
        rid = f"{episode}-{next(self._ids)}"
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if kind == "chat":
            return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
                    "model": self.model, "usage": usage,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}]}
        return {"id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": self.model,
                "usage": usage, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": text_finish}]}

    def _release(self, episode: str) -> None:
        with self._lock:
            self._busy.discard(episode)

    def _reply(self, session: AgentSession, sample: Sample, kind: str, prompt_tokens: int) -> dict:
        with self._lock:
            message, finish = session.record_turn(sample)
        return self._envelope(session.episode_id, kind, message, sample.text, finish,
                              "stop" if sample.finished else "length", prompt_tokens, len(sample.response_ids))


def _route(handle, kind: str):
    """The endpoint of ``kind`` (``chat`` or ``text``) for FastAPI: the episode from the path when it has one."""
    async def endpoint(request: Request, episode: str | None = None):
        return await handle(request, episode, kind)
    return endpoint


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error" if status == 400
                                   else "server_error", "code": status}}, status_code=status)
