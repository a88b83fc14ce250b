"""The ReAct loop both example agents share, on the ``openai`` client only: ask the model (with ``tools``), run
each of its tool calls with ``run_tool(name, arguments) -> text`` (in a thread: the other episodes go on; a
call of a tool not in ``tools`` gets an error text) and send the results back, until it answers without a
call or ``max_turns`` turns were taken."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

import openai


async def react(base_url: str, messages: list[dict], tools: list[dict], run_tool: Callable[[str, dict], str],
                max_turns: int = 4) -> list[dict]:
    """Play the conversation ``messages`` against the model at ``base_url``; returns the whole conversation."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"))
    messages, names = list(messages), {t["function"]["name"] for t in tools}
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=tools)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                arguments = {}
            if call.function.name not in names:
                output = f"Error: no tool named {call.function.name!r}"
            else:
                output = await asyncio.to_thread(run_tool, call.function.name,
                                                 arguments if isinstance(arguments, dict) else {})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return messages


def tool_outputs(conversation: list[dict]) -> list[str]:
    """What the tools returned in ``conversation`` (:func:`react`'s result), in order."""
    return [m["content"] for m in conversation if m["role"] == "tool"]
