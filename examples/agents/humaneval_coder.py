"""A code agent for HumanEval, written against the ``openai`` client only (``rollout.agent=
examples.agents.humaneval_coder:run``, with ``data.task=humaneval``): the model may run Python through a
``python`` tool, which executes in megalign's sandbox (``alignment.envs.tools.python_tool``: no network, a
wall clock, memory and process limits), to test its function before it submits it; its last message, the
whole function in a ```python block, is what HumanEval's unit tests grade (megalign's task grader).
"""

from __future__ import annotations

from alignment.envs.tools import python_tool
from examples.agents.react_loop import react

MAX_TURNS = 4
SYSTEM = ("Complete the Python function. You may test it first: call the python tool with a program that defines "
          "it and prints the results of a few calls. Then answer with the whole function in one ```python block.")
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Runs a Python program and returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


async def run(base_url: str, task: dict) -> float | None:
    """One episode on ``task`` (HumanEval's ``question``: the function's signature and docstring); returns
    None (the task's unit tests grade the last message)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    await react(base_url, messages, [PYTHON], lambda name, args: python_tool(args.get("code", "")), MAX_TURNS)
    return None
