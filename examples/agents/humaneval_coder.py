"""A code agent for HumanEval, written against the ``openai`` client only (``rollout.agent=
examples.agents.humaneval_coder:run``, with ``data.task=humaneval``): the model may run Python through a
``python`` tool, which executes in megalign's sandbox (``alignment.envs.tools.python_tool``: no network, a
wall clock, memory and process limits), to test its function before it submits it; its last message, the
whole function in a ```python block, is what HumanEval's unit tests grade (megalign's task grader).

As the ReAct math agent does, it shows the call format (a 135M model was not trained for tool calls) and
returns 1.0 when one of its programs ran without an error, else 0.0: a shaping reward for well-formed
calls, the ``environment`` term of ``reward.functions: [{name: correctness}, {name: environment, weight:
0.2}]``.
"""

from __future__ import annotations

from alignment.envs.tools import python_tool
from examples.agents.react_loop import react, tool_outputs

MAX_TURNS = 4
SYSTEM = ("Complete the Python function. You may test it first: call the python tool with a program that defines "
          "it and prints the results of a few calls. Then answer with the whole function in one ```python block.")
INSTRUCTION = ('To run a program, write <tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call> '
               "and read what it prints.")
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Runs a Python program and returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


def ran(output: str) -> bool:
    """Whether a ``python`` tool output is a program's that ran to its end (its last line is no error)."""
    lines = output.strip().splitlines()
    return not (lines and lines[-1].startswith("Error: "))


async def run(base_url: str, task: dict) -> float:
    """One episode on ``task`` (HumanEval's ``question``: the function's signature and docstring); returns 1.0
    if a program ran without an error, else 0.0 (the task's unit tests grade the last message)."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{task['question']}\n\n{INSTRUCTION}"}]
    conversation = await react(base_url, messages, [PYTHON], lambda name, args: python_tool(args.get("code", "")),
                               MAX_TURNS)
    return float(any(ran(out) for out in tool_outputs(conversation)))
