"""Two reward functions of a user's, in TRL's signature (``reward.functions: [{name:
examples.own_task.rewards:correct}, ...]``): every other column of the data arrives as a keyword
argument holding one value per completion."""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+")


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]  # chat: messages


def correct(prompts, completions, completion_ids, answer, **kwargs) -> list[float]:
    """1.0 when the last number of the completion is the answer, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer):
        found = NUMBER.findall(_text(completion))
        out.append(float(bool(found) and found[-1] == str(gold)))
    return out


def concise(completions, **kwargs) -> list[float]:
    """1.0 for a completion that is one number and nothing else (the format the prompt asks for)."""
    return [float(NUMBER.fullmatch(_text(c).strip().rstrip(".")) is not None) for c in completions]
