"""Reward functions of a user's, for tests/test_reward_functions.py and the end-to-end example test
(``reward.functions=[{name: tests.reward_fns:<function>}]``)."""

from __future__ import annotations

import asyncio
import math
import time


def contains_answer(prompts, completions, completion_ids, solution, **kwargs):
    """TRL's signature: 1.0 where the completion holds the ``solution`` column, None without one."""
    return [None if s is None else float(str(s) in c) for c, s in zip(completions, solution)]


def even_length(completions, **kwargs):
    """1.0 for a completion of an even number of characters (a tiny random model gets a signal)."""
    return [float(len(c) % 2 == 0) for c in completions]


def short_reply(completion_ids, **kwargs):
    """1.0 for a reply of at most 2 tokens (its end-of-text token counted): the held-out grader of
    tests/test_generalises.py, a skill the EOS-prone tiny model can learn in a few steps."""
    return [float(len(ids) <= 2) for ids in completion_ids]


def reply_length(completions, **kwargs):
    """Characters of the reply, for plain and chat completions (TRL gives a chat prompt's completion as
    ``[{"role": "assistant", "content": ...}]``)."""
    return [float(len(c[-1]["content"] if isinstance(c, list) else c)) for c in completions]


def scaled_length(completions, scale=1.0):
    """No **kwargs: gets only ``completions`` and its own ``scale`` option."""
    return [scale * len(c) for c in completions]


async def async_ids(prompts, completions, completion_ids, **kwargs):
    await asyncio.sleep(0)
    return [float(len(ids)) for ids in completion_ids]


def chat_echo(prompts, completions, **kwargs):
    """Chat data: prompts and completions are message lists."""
    return [float(p[-1]["role"] == "user" and c[0]["role"] == "assistant") for p, c in zip(prompts, completions)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature."""
    return {"score": float(solution_str.strip() == ground_truth), "source": data_source}


async def async_compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(ground_truth in solution_str)


def wrong_length(completions, **kwargs):
    return [1.0]


def returns_nan(completions, **kwargs):
    return [math.nan for _ in completions]


def returns_text(completions, **kwargs):
    return ["good" for _ in completions]


def fails_on_x(completions, **kwargs):
    return [1.0 / (0 if "x" in c else 1) for c in completions]


def slow(completions, **kwargs):
    time.sleep(30)
    return [0.0 for _ in completions]


def no_convention(a, b):
    return []

