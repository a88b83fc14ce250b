"""One agent episode as the rollout server records it (token-in/token-out): an agent written against
the OpenAI API sends its whole chat history with every request, and the server must train on the
tokens the engine sampled, never on a re-rendering of them (re-tokenised histories drift from the
sampled tokens: TRL #5224; verl's agent loop and AReaL's proxy keep token ids for this reason).

:class:`AgentSession` keeps the episode's token ids. The first request's messages are rendered by
the chat template (with the request's ``tools``; a template that does not render ``tools=`` gets them as
the tool environment writes them, a system message in the Hermes format) as the prompt. Each later request must repeat the
session's messages so far, the assistant turns as the server answered them, and add new messages
(tool results, the user's next turn) at the end. Only those new messages are tokenised
(:meth:`alignment.rollout.episodes.turn_tokens.TurnTokens.continuation_ids`), the model's own tokens are kept
as sampled, and a request that changes an earlier message is refused (:class:`HistoryRewritten`).

:meth:`AgentSession.sample` is the episode as a :class:`alignment.data.samples.Sample`, exactly as a
multi-turn episode of :mod:`alignment.rollout.episodes.multi_turn` is: ``response_ids`` every token after the
prompt, ``logprobs`` the engine's on the model's tokens (0 elsewhere), ``loss_mask`` 1 on the model's
tokens only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from alignment.envs.tool_calls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, parse_tool_calls
from alignment.envs.tool_env import with_tool_list
from alignment.data.samples import Sample
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["AgentSession", "HistoryRewritten", "EpisodeTooLong", "assistant_message", "same_message", "opening_ids"]


class HistoryRewritten(ValueError):
    """A request whose messages do not begin with the session's conversation so far."""


class EpisodeTooLong(ValueError):
    """A request whose new messages leave no token of the episode's budget for the model."""


def _text(content) -> str:
    """A message's content as text: a string, None (no text), or OpenAI's list of content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _calls(message: dict) -> list[tuple[str, dict]]:
    out = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # compared as the string it is
        out.append((str(call.get("id", "")), {"name": fn.get("name"), "arguments": args}))
    return out


def same_message(sent: dict, known: dict) -> bool:
    """Whether the message ``sent`` in a request is ``known``, the session's: the same role, text
    (a string or content parts), tool calls (id, name and arguments, the arguments as JSON values) and
    ``tool_call_id``; keys the ``openai`` client adds with no value (``refusal``, ``audio``...) are ignored."""
    return (sent.get("role") == known.get("role") and _text(sent.get("content")) == _text(known.get("content"))
            and _calls(sent) == _calls(known) and sent.get("tool_call_id") == known.get("tool_call_id"))


def opening_ids(turns: TurnTokens, messages: Sequence[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt token ids of an episode whose first request has ``messages`` and ``tools`` (OpenAI function
    schemas): the chat template's rendering with ``tools=``, or, for a template that does not render them,
    with the tool list in the system message as ``rollout.environment=tools`` writes it."""
    if tools and not turns.renders_tools():
        return turns.prompt_ids(with_tool_list(messages, tools))
    return turns.prompt_ids(list(messages), tools)


def assistant_message(text: str, call_prefix: str) -> tuple[dict, str]:
    """The OpenAI assistant message of the model's reply ``text`` and its ``finish_reason`` part:
    the Hermes ``<tool_call>`` blocks (:mod:`alignment.envs.tool_calls`) become ``tool_calls`` (ids
    ``{call_prefix}_{k}``, arguments as a JSON string) and leave the content; a malformed block stays
    in the content, as the model wrote it. Returns ``(message, "tool_calls" or "")``."""
    parsed = parse_tool_calls(text)
    good = [c for c in parsed.calls if c is not None]
    if not good:
        return {"role": "assistant", "content": text}, ""
    content = text
    if all(c is not None for c in parsed.calls):  # every block parsed: the calls leave the text
        while TOOL_CALL_OPEN in content and TOOL_CALL_CLOSE in content:
            start = content.index(TOOL_CALL_OPEN)
            end = content.index(TOOL_CALL_CLOSE, start) + len(TOOL_CALL_CLOSE)
            content = content[:start] + content[end:]
        content = content.strip()
    calls = [{"id": f"{call_prefix}_{k}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(good)]
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


class AgentSession:
    """The token record of one episode (``episode_id``) of an agent talking to the rollout server.

    Args:
        turns: the chat template's turn tokens.
        episode_id: the session's name (from the request's ``base_url`` or header).
        max_tokens: the episode's token budget after the prompt (model and inserted tokens together,
            as ``rollout.max_tokens`` is for multi-turn episodes).
    """

    def __init__(self, turns: TurnTokens, episode_id: str, max_tokens: int):
        self.turns, self.episode_id, self.max_tokens = turns, episode_id, max_tokens
        self.prompt_ids: list[int] = []
        self.messages: list[dict] = []
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.last_turn: list[int] = []
        self.text, self.finished, self.turn_count, self.env_tokens = "", False, 0, 0
        self.tools: list[dict] | None = None

    @property
    def budget(self) -> int:
        """Tokens the model may still write in this episode."""
        return self.max_tokens - len(self.ids)

    def request_ids(self, messages: Sequence[dict], tools: list[dict] | None = None) -> list[int]:
        """The token ids the engine continues from for a request with ``messages`` (and ``tools``,
        given with the first request): the prompt for the first one; then the episode so far plus the
        request's new messages, which are recorded (loss mask 0).

        Raises:
            HistoryRewritten: the request does not repeat the session's messages unchanged, or adds none.
            EpisodeTooLong: the new messages leave no token of the budget.
        """
        messages = [dict(m) for m in messages]
        if not self.prompt_ids:
            if not messages:
                raise HistoryRewritten(f"episode {self.episode_id}: a request without messages")
            self.tools = tools
            self.prompt_ids = opening_ids(self.turns, messages, tools)
            self.messages = messages
            return list(self.prompt_ids)
        known = len(self.messages)
        for k, (sent, mine) in enumerate(zip(messages, self.messages)):
            if not same_message(sent, mine):
                raise HistoryRewritten(
                    f"episode {self.episode_id}: message {k} ({mine.get('role')}) differs from the one this session "
                    "holds; send the conversation as it was, the assistant's turns as the server returned them, and "
                    "append new messages only")
        if len(messages) <= known:
            raise HistoryRewritten(f"episode {self.episode_id}: the request has {len(messages)} messages, the "
                                   f"session {known}; append the new ones (tool results, the next user turn)")
        new = messages[known:]
        if any(m.get("role") == "assistant" for m in new):
            raise HistoryRewritten(f"episode {self.episode_id}: a request may add tool and user messages, not "
                                   "assistant turns the model did not write")
        ids = self.turns.continuation_ids(self.last_turn, new)
        if len(self.ids) + len(ids) >= self.max_tokens:
            raise EpisodeTooLong(f"episode {self.episode_id}: {len(ids)} tokens of new messages leave no room in the "
                                 f"episode's {self.max_tokens} tokens (rollout.max_tokens)")
        self._insert(ids, new)
        return self.prompt_ids + self.ids

    def request_token_ids(self, prompt: Sequence[int]) -> list[int]:
        """As :meth:`request_ids` for ``/v1/completions``: ``prompt`` (token ids) is the first request's
        prompt; a later one must begin with the episode's ids so far, and the ids after them are recorded
        (loss mask 0).

        Raises:
            HistoryRewritten: ``prompt`` does not begin with the episode's ids (e.g. a text prompt whose
                re-tokenisation differs from the sampled tokens: send token ids).
            EpisodeTooLong: the new ids leave no token of the budget.
        """
        prompt = [int(i) for i in prompt]
        if not self.prompt_ids:
            self.prompt_ids = prompt
            return list(prompt)
        so_far = self.prompt_ids + self.ids
        if prompt[: len(so_far)] != so_far:
            k = next((k for k, (a, b) in enumerate(zip(prompt, so_far)) if a != b), min(len(prompt), len(so_far)))
            raise HistoryRewritten(f"episode {self.episode_id}: the prompt differs from the episode's tokens at "
                                   f"token {k} of {len(so_far)}; send the episode's token ids (prompt as a list of "
                                   "ints, the model's tokens as sampled) followed by the new ones")
        new = prompt[len(so_far):]
        if len(self.ids) + len(new) >= self.max_tokens:
            raise EpisodeTooLong(f"episode {self.episode_id}: {len(new)} new tokens leave no room in the episode's "
                                 f"{self.max_tokens} tokens (rollout.max_tokens)")
        self._insert(new, [])
        return prompt

    def _insert(self, ids: list[int], messages: list[dict]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.messages += messages
        self.env_tokens += len(ids)

    def record_turn(self, turn: Sample) -> tuple[dict, str]:
        """Record the model's turn (``turn.response_ids`` after :meth:`request_ids`' ids, with their
        logprobs). Returns the assistant message to answer with and its ``finish_reason``
        (``tool_calls``, ``stop`` or ``length``)."""
        self.ids += turn.response_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.response_ids)
        self.last_turn, self.text, self.finished = list(turn.response_ids), turn.text, turn.finished
        self.turn_count += 1
        message, calls = assistant_message(turn.text, f"call_{self.episode_id}_{self.turn_count}")
        self.messages.append(message)
        return message, calls or ("stop" if turn.finished else "length")

    def sample(self) -> Sample:
        """The episode as one sample (``info``: ``turns``, ``tool_calls``, ``env_tokens``, ``messages``)."""
        calls = sum(len(m.get("tool_calls") or []) for m in self.messages if m.get("role") == "assistant")
        info = {"turns": self.turn_count, "tool_calls": calls, "tool_errors": 0, "env_tokens": self.env_tokens,
                "messages": self.messages}
        return Sample(list(self.prompt_ids), list(self.ids), list(self.logprobs), self.text, self.finished,
                      None if all(self.mask) else list(self.mask), info)
