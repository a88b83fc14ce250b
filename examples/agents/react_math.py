"""A ReAct math agent with a calculator tool, written against the ``openai`` client only: the same file is
trained by megalign as ``rollout.agent=examples.agents.react_math:run`` or as
``rollout.agent_command='python -m examples.agents.react_math'`` (then the task comes in ``MEGALIGN_TASK`` and
the client reads ``OPENAI_BASE_URL``), and runs unchanged against any OpenAI-compatible server.

The model sees the question, an instruction that shows one call (a 135M model was not trained for tool
calls: without it SmolLM2 never calls) and a ``calculator`` tool; each tool call is evaluated (numbers,
+ - * / and parentheses) and returned as a ``tool`` message, until the model answers without a call or
``MAX_TURNS`` turns were taken. It returns 1.0 when a call returned a value (no error), else 0.0: a shaping
reward for well-formed calls, trained on as the ``environment`` term (``reward.functions: [{name:
correctness}, {name: environment, weight: 0.2}]``) while ``correctness`` grades the last answer.
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os

from examples.agents.react_loop import react, tool_outputs

MAX_TURNS = 4
SYSTEM = "Solve the problem. Use the calculator for arithmetic, then give the final answer as a number."
INSTRUCTION = ('Use the calculator: write <tool_call>{"name": "calculator", "arguments": {"expression": "..."}}'
               '</tool_call>, read its result, then answer with a single number.')
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
    except (SyntaxError, ValueError, ArithmeticError, TypeError, RecursionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


async def run(base_url: str, task: dict) -> float:
    """One episode on ``task`` (its ``question``) against the model at ``base_url``; returns 1.0 if a
    calculator call returned a value, else 0.0."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task['question']}\n\n{INSTRUCTION}"}]
    conversation = await react(base_url, messages, [CALCULATOR],
                               lambda name, args: calculate(args.get("expression", "")), MAX_TURNS)
    return float(any(not out.startswith("Error") for out in tool_outputs(conversation)))


if __name__ == "__main__":  # rollout.agent_command: the task in MEGALIGN_TASK, the server in OPENAI_BASE_URL
    print(asyncio.run(run(os.environ["OPENAI_BASE_URL"], json.loads(os.environ["MEGALIGN_TASK"]))))  # the reward
