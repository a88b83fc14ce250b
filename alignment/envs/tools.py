"""The tools a policy can call (:mod:`alignment.envs.tool_calls`): ``calculator`` (exact arithmetic
on an expression, no code run) and ``python`` (a program run in the sandbox,
:mod:`alignment.rewards.sandbox`, its output returned). Each takes keyword arguments and returns the
text the model reads next; a bad call returns an error text, never raises, so it costs the model a
turn and nothing else.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from dataclasses import dataclass

from alignment.envs.tool_calls import ToolCall
from alignment.rewards.sandbox import SandboxLimits, run_python

__all__ = ["Tool", "calculator", "python_tool", "TOOLS", "run_tool", "evaluate_arithmetic"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT, MAX_DIGITS = 100, 1000  # bounds that keep one call cheap
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


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of ``expression``: numbers, ``+ - * / // % **`` and parentheses only (no names,
    no calls), exponents up to :data:`MAX_EXPONENT`, integers up to :data:`MAX_DIGITS` digits.

    Raises:
        ValueError: anything else, with what was wrong.
        ZeroDivisionError: division by zero.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from e

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            out = _BINARY[type(node.op)](left, right)
            if isinstance(out, int) and abs(out).bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"a result longer than {MAX_DIGITS} digits")
            return out
        raise ValueError(f"{ast.unparse(node)!r} is not a number or + - * / // % ** of numbers")

    return value(tree.body)


def calculator(expression: str = "") -> str:
    """The value of an arithmetic expression as text (integers exact; a whole float without its
    ``.0``), or ``Error: ...``."""
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
