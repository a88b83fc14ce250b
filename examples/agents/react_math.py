"""A ReAct math agent with a calculator tool, written against the ``openai`` client only: the same file is
trained by megalign as ``rollout.agent=examples.agents.react_math:run`` or as
``rollout.agent_command='python -m examples.agents.react_math'`` (then the task comes in ``MEGALIGN_TASK`` and
the client reads ``OPENAI_BASE_URL``), and runs unchanged against any OpenAI-compatible server.

The model sees the question and a ``calculator`` tool; each tool call is evaluated (numbers, + - * / and
parentheses) and returned as a ``tool`` message, until the model answers without a call or ``MAX_TURNS``
turns were taken. It returns None: megalign's ``reward.functions`` grade the last answer.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os

from examples.agents.react_loop import react

MAX_TURNS = 4
SYSTEM = "Solve the problem. Use the calculator for arithmetic, then give the final answer as a number."
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluates an arithmetic expression, e.g. (12 + 3) * 4.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of ``expression`` (numbers, + - * / and parentheses) as text, or an error text."""
    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and parentheses")
    try:
        result = value(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def run(base_url: str, task: dict) -> float | None:
    """One episode on ``task`` (its ``question``) against the model at ``base_url``; returns None."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    await react(base_url, messages, [CALCULATOR], lambda name, args: calculate(args.get("expression", "")), MAX_TURNS)
    return None


if __name__ == "__main__":  # rollout.agent_command: the task in MEGALIGN_TASK, the server in OPENAI_BASE_URL
    asyncio.run(run(os.environ["OPENAI_BASE_URL"], json.loads(os.environ["MEGALIGN_TASK"])))
