"""The tools a policy can call (:mod:`alignment.envs.tool_calls`): ``calculator`` (exact arithmetic
on an expression, no code run) and ``python`` (a program run in the sandbox,
:mod:`alignment.sandbox.runner`, its output returned). Each takes keyword arguments and returns the
text the model reads next; a bad call returns an error text, never raises, so it costs the model a
turn and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from alignment.data.step_labels import evaluate_arithmetic
from alignment.envs.tool_calls import ToolCall
from alignment.sandbox.runner import SandboxLimits, run_python

__all__ = ["Tool", "calculator", "python_tool", "TOOLS", "run_tool", "is_error"]

PYTHON_LIMITS = SandboxLimits(wall_seconds=5.0, cpu_seconds=3, memory_mb=256, output_bytes=2000)


@dataclass(frozen=True)
class Tool:
    """A callable tool: its ``name``, a one-line ``description`` and its argument for the prompt's
    tool list, and ``run(**arguments) -> text``."""

    name: str
    description: str
    argument: str
    run: Callable[..., str]

    def schema(self) -> dict:
        """The OpenAI-style function schema chat templates render in a tool list."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": {self.argument: {"type": "string"}},
                           "required": [self.argument]}}}


def calculator(expression: str = "") -> str:
    """The value of an arithmetic expression (:func:`alignment.data.step_labels.evaluate_arithmetic`)
    as text (integers exact; a whole float without its ``.0``), or ``Error: ...``."""
    try:
        v = evaluate_arithmetic(str(expression))
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(v)) if isinstance(v, float) and v.is_integer() and abs(v) < 1e15 else str(v)


def python_tool(code: str = "") -> str:
    """Run ``code`` in the sandbox (:data:`PYTHON_LIMITS`); its stdout (cut at 2,000 bytes), and the
    last line of the error when it failed."""
    r = run_python(str(code), PYTHON_LIMITS)
    out = r.stdout + ("\n[output truncated]" if r.truncated else "")
    out += "\n" if out and not out.endswith("\n") and (r.timed_out or r.returncode != 0) else ""
    if r.timed_out:
        return out + f"Error: timed out after {PYTHON_LIMITS.wall_seconds:g} s"
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines()
        return out + f"Error: {lines[-1] if lines else f'exit status {r.returncode}'}"
    return out if out else "(no output: print the result)"


TOOLS = {t.name: t for t in (
    Tool("calculator", "Evaluate an arithmetic expression, e.g. '(12 + 7) * 3'.", "expression", calculator),
    Tool("python", "Run a Python program and return what it prints.", "code", python_tool),
)}


def run_tool(call: ToolCall, tools: dict[str, Tool] = TOOLS) -> str:
    """The text a call returns: its tool's output, or an error text for an unknown tool or
    wrong arguments (naming what is expected)."""
    tool = tools.get(call.name)
    if tool is None:
        return f"Error: unknown tool {call.name!r}; available: {', '.join(tools)}"
    unexpected = sorted(set(call.arguments) - {tool.argument})
    if unexpected or tool.argument not in call.arguments:
        return f"Error: {call.name} takes one argument, {tool.argument!r}; got {sorted(call.arguments)}"
    return tool.run(**{tool.argument: call.arguments[tool.argument]})


def is_error(text: str) -> bool:
    """Whether a tool's text reports a failed call: it starts with ``Error:`` (bad call, failed
    calculation) or ends with the Python tool's ``Error: ...`` line after the program's output."""
    return text.startswith("Error:") or text.rsplit("\n", 1)[-1].startswith("Error:")
