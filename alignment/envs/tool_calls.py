"""Tool calls in the Hermes format that Qwen2.5 / Qwen3 chat templates (and NousResearch's Hermes
models) use and vLLM's ``hermes`` tool parser reads::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12 * 7"}}
    </tool_call>

A malformed call is not dropped: it becomes an error message for the model (fed back as the tool's
answer), so the policy can learn the format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

__all__ = ["ToolCall", "ParsedCalls", "parse_tool_calls", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE"]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)
FORMAT_HINT = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


@dataclass
class ToolCall:
    """One well-formed call: the tool's ``name`` and its keyword ``arguments``."""

    name: str
    arguments: dict = field(default_factory=dict)


@dataclass
class ParsedCalls:
    """The calls of a message in order, and one message per malformed call (None for a good one,
    so ``errors[i]`` belongs to the i-th ``<tool_call>`` block)."""

    calls: list[ToolCall | None]
    errors: list[str | None]

    @property
    def any(self) -> bool:
        """The message holds at least one ``<tool_call>`` block (well-formed or not)."""
        return bool(self.calls)


def _parse_one(body: str, k: int) -> tuple[ToolCall | None, str | None]:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"tool call {k}: not valid JSON ({e.msg} at character {e.pos}); write {FORMAT_HINT}"
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, f'tool call {k}: needs a "name" string; write {FORMAT_HINT}'
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None, f'tool call {k}: "arguments" is a string that is not a JSON object; write {FORMAT_HINT}'
    if not isinstance(args, dict):
        return None, f'tool call {k}: "arguments" must be a JSON object; write {FORMAT_HINT}'
    return ToolCall(obj["name"], args), None


def parse_tool_calls(text: str) -> ParsedCalls:
    """Every ``<tool_call>...</tool_call>`` block of an assistant message, parsed (JSON with a
    ``name`` and an ``arguments`` object, or a JSON string of one; ``parameters`` is read as
    ``arguments``); an opening tag without its closing tag is one more malformed call."""
    calls, errors = [], []
    for k, m in enumerate(_CALL.finditer(text), 1):
        call, error = _parse_one(m.group(1).strip(), k)
        calls.append(call)
        errors.append(error)
    rest = _CALL.sub("", text)
    if TOOL_CALL_OPEN in rest:
        calls.append(None)
        errors.append(f"tool call {len(calls)}: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}; write {FORMAT_HINT}")
    return ParsedCalls(calls, errors)
