"""Prompt construction: a task question rendered with the model's chat template."""

from __future__ import annotations

from typing import Any

from alignment.data.chat_data import encode_prompt
from alignment.data.tasks import TASKS

#: Instruction appended to the question, per task.
INSTRUCTIONS: dict[str, str] = {
    "arithmetic": "Answer with a single number.",
    "gsm8k": "Answer with a single number.",
    "length": "Answer in about 20 characters.",
    "humaneval": "Complete this Python function. Answer with the whole function in one ```python code block.",
}


def prompt_messages(question: str, task: str, hint: str | None = None,
                    instruction: str | None = None) -> list[dict[str, str]]:
    """The chat messages asking ``question``: one user message, ``question`` followed by the task's
    instruction from :data:`INSTRUCTIONS` (``hint``, ``instruction``: as :func:`build_prompt_ids`).

    Raises:
        ValueError: unknown ``task``.
    """
    if task not in INSTRUCTIONS:
        raise ValueError(f"unknown task {task!r}; valid tasks: {', '.join(TASKS)}")
    given = f"\nHint: the answer is {hint}." if hint is not None else ""
    said = INSTRUCTIONS[task] if instruction is None else instruction
    return [{"role": "user", "content": f"{question.strip()}{given}\n{said}"}]


def build_prompt_ids(tokenizer: Any, question: str, task: str, hint: str | None = None,
                     instruction: str | None = None) -> list[int]:
    """Token ids of a chat prompt asking ``question``, ending with the assistant generation prefix.

    The prompt is :func:`prompt_messages` rendered with ``tokenizer.apply_chat_template(...,
    add_generation_prompt=True, tokenize=True)``; the template's default system prompt is kept.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        question: the raw problem text (``Problem.question``).
        task: a task name from ``alignment.data.tasks.TASKS``.
        hint: the reference answer, given as "Hint: the answer is <hint>." between the question and
            the instruction (STaR's rationalisation, Zelikman et al. 2022 Sec. 3.2); None: no hint.
        instruction: replaces the task's instruction (``data.instruction``); None: the task's.

    Returns:
        A flat ``list[int]`` (transformers 5 may return a BatchEncoding; it is unwrapped).

    Raises:
        ValueError: unknown ``task``.
    """
    return encode_prompt(tokenizer, prompt_messages(question, task, hint, instruction))
