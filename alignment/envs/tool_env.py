"""The tool-use environment (``rollout.environment=tools``): the model may call tools
(:mod:`alignment.envs.tools`) in the Hermes format (:mod:`alignment.envs.tool_calls`), reads their
results as ``tool`` messages and goes on; the episode ends at the first assistant message without a
tool call (the answer, graded by ``reward.functions``) or at ``rollout.max_turns``.

The tools are described in a system message as Qwen2.5's chat template writes it for ``tools=``
(the ``<tools>`` list, then the ``<tool_call>`` format), so any ChatML template renders it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from alignment.data.prompts import PromptStyle, prompt_messages
from alignment.data.tasks import Problem
from alignment.envs.base import Transition
from alignment.envs.tool_calls import TOOL_CALL_CLOSE, parse_tool_calls
from alignment.envs.tools import TOOLS, Tool, is_error, run_tool

__all__ = ["ToolEnvironment", "tools_system_prompt", "TOOL_INSTRUCTION"]

#: the tool task's instruction after the question (``data.instruction`` replaces it)
TOOL_INSTRUCTION = ('Use the calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": '
                    '"..."}}</tool_call>, read its result, then answer with a single number.')


def tools_system_prompt(tools: Sequence[Tool | dict]) -> str:
    """The system message that lists ``tools`` (tools, or OpenAI function schemas) and the call format
    (Qwen2.5's ``tools=`` text)."""
    listed = "\n".join(json.dumps(t if isinstance(t, dict) else t.schema()) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{listed}\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def with_tool_list(messages: Sequence[dict], tools: Sequence[Tool | dict]) -> list[dict]:
    """``messages`` with :func:`tools_system_prompt` as the system message, after the system prompt when
    there is one (for chat templates that do not render ``tools=`` themselves)."""
    listed = tools_system_prompt(tools)
    messages = [dict(m) for m in messages]
    own = bool(messages) and messages[0]["role"] == "system"
    head = messages[0]["content"] + "\n\n" if own else ""
    return [{"role": "system", "content": head + listed}, *messages[own:]]


class ToolEnvironment:
    """Episodes where the model may call ``tools`` before it answers.

    Each ``<tool_call>`` block of a message gets one ``tool`` message back: the tool's output, or
    an error text naming the fix (malformed JSON, unknown tool, wrong arguments, more than
    ``max_calls_per_turn`` calls). Calls of the whole batch run side by side on ``workers``
    threads (a Python call is a sandboxed process, :mod:`alignment.sandbox.runner`).

    Environment reward: 1.0 for the episode's first message whose calls all ran without error, 0
    otherwise (so an episode earns at most 1.0): a shaping term for models that rarely call tools,
    used only when ``reward.functions`` weighs the ``environment`` function (e.g. 0.2).

    Args:
        style: the job's :class:`alignment.data.prompts.PromptStyle`; its instruction follows the
            question (None: :data:`TOOL_INSTRUCTION`), its system prompt precedes the tool list.
        tools: tool names from :data:`alignment.envs.tools.TOOLS`.
        max_calls_per_turn: calls run per message (later ones answered with an error text).
        workers: tool calls run at once.
    Raises:
        ValueError: an unknown tool name or no tools.
    """

    stop = [TOOL_CALL_CLOSE]

    def __init__(self, style: PromptStyle = PromptStyle(), tools: Sequence[str] = ("calculator",),
                 max_calls_per_turn: int = 4, workers: int = 1):
        unknown = [t for t in tools if t not in TOOLS]
        if unknown or not tools:
            raise ValueError(f"rollout.tools={list(tools)}: valid tools are {', '.join(TOOLS)} (at least one)")
        self.style = replace(style, instruction=TOOL_INSTRUCTION if style.instruction is None else style.instruction)
        self.tools = {t: TOOLS[t] for t in tools}
        self.max_calls, self.workers = max_calls_per_turn, workers

    def reset(self, problems: Sequence[Problem]) -> list[list[dict]]:
        """The tool list as a system message (after the system prompt, when there is one), then the
        question with the instruction."""
        return [with_tool_list(prompt_messages(p, self.style), list(self.tools.values())) for p in problems]


    def _answer(self, parsed, k: int) -> tuple[str, bool]:
        """The text for call ``k`` of a message, and whether it is an error."""
        if parsed.errors[k] is not None:
            return f"Error: {parsed.errors[k]}", True
        if k >= self.max_calls:
            return f"Error: at most {self.max_calls} tool calls per message; call {k + 1} was not run", True
        text = run_tool(parsed.calls[k], self.tools)
        return text, is_error(text)

    def step(self, problems, messages, replies: Sequence[str]) -> list[Transition]:
        """A message with tool calls gets their outputs (``info``: ``tool_calls``, ``tool_errors``:
        malformed calls and calls whose output starts with ``Error:``); one without ends the episode."""
        parsed = [parse_tool_calls(r) for r in replies]
        jobs = [(i, k) for i, p in enumerate(parsed) for k in range(len(p.calls))]
        with ThreadPoolExecutor(max_workers=max(1, self.workers)) as pool:
            outputs = list(pool.map(lambda job: self._answer(parsed[job[0]], job[1]), jobs))
        by_reply = [[] for _ in replies]
        for (i, _), out in zip(jobs, outputs):
            by_reply[i].append(out)
        result = []
        for p, outs, history in zip(parsed, by_reply, messages):
            if not p.any:
                result.append(Transition(done=True, info={"tool_calls": 0, "tool_errors": 0}))
                continue
            errors = sum(e for _, e in outs)
            first_good = not errors and not any(m["role"] == "tool" and not is_error(m["content"]) for m in history)
            result.append(Transition([{"role": "tool", "content": text} for text, _ in outs],
                                     reward=1.0 if first_good else 0.0,
                                     info={"tool_calls": len(outs), "tool_errors": errors}))
        return result
