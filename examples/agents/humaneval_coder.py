"""A code agent for HumanEval, written against the ``openai`` client only (``rollout.agent=
examples.agents.humaneval_coder:run``, with ``data.task=humaneval``): the model may run Python through a
``python`` tool, which executes in megalign's sandbox (``alignment.envs.tools.python_tool``: no network, a
wall clock, memory and process limits), to test its function before it submits it; its last message, the
whole function in a ```python block, is what HumanEval's unit tests grade (megalign's task grader).
"""

from __future__ import annotations

import asyncio
import json
import os

import openai

from alignment.envs.tools import python_tool

MAX_TURNS = 4
SYSTEM = ("Complete the Python function. You may test it first: call the python tool with a program that defines "
          "it and prints the results of a few calls. Then answer with the whole function in one ```python block.")
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "Runs a Python program and returns what it prints.",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}


async def run(base_url: str, task: dict) -> float | None:
    """One episode on ``task`` (HumanEval's ``question``: the function's signature and docstring); returns
    None (the task's unit tests grade the last message)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    for _ in range(MAX_TURNS):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[PYTHON])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                code = json.loads(call.function.arguments).get("code", "")
            except json.JSONDecodeError:
                code = ""
            output = await asyncio.to_thread(python_tool, code)  # a sandboxed process: the other episodes go on
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return None
