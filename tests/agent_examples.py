"""Agents for the end-to-end tests, written against the ``openai`` client only (rollout.agent=tests.agent_examples:...)."""

from __future__ import annotations

import openai


async def three_turns(base_url: str, row: dict) -> float | None:
    """Three model turns whatever the model writes: the question, then two follow-up user turns. Returns the
    number of characters of the last reply modulo 2 (a reward a random model can learn from); the task row
    whose answer is 7 crashes (a failing agent, dropped and counted)."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for follow_up in ("Are you sure?", "Say it once more.", None):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        messages.append(reply.choices[0].message.model_dump())
        if follow_up is not None:
            messages.append({"role": "user", "content": follow_up})
    if str(row.get("answer")) == "7":
        raise RuntimeError("this agent fails on 7")
    return float(len(reply.choices[0].message.content or "") % 2 == 0)
