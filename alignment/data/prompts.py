"""Prompt construction: a problem rendered with the model's chat template, as the job's ``data``
section asks (:class:`PromptStyle`: ``data.instruction``, ``data.system_prompt``,
``data.chat_template_kwargs``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from alignment.data.chat_data import encode_prompt
from alignment.data.config import DataConfig
from alignment.data.images import ImageProcessor
from alignment.data.prompt_data import PromptSets, fit_prompts, load_prompt_files
from alignment.data.tasks import FILE_TASK, TASKS, Problem, load_problems

#: Instruction appended to the question, per task.
INSTRUCTIONS: dict[str, str] = {
    "arithmetic": "Answer with a single number.",
    "gsm8k": "Answer with a single number.",
    "length": "Answer in about 20 characters.",
    "humaneval": "Complete this Python function. Answer with the whole function in one ```python code block.",
}


@dataclass(frozen=True)
class PromptStyle:
    """How a job words its prompts: ``instruction`` after the question (None: the task's own from
    :data:`INSTRUCTIONS`; a file's prompts have none), a ``system_prompt`` first (None: the chat
    template's default) and ``chat_template_kwargs`` for ``apply_chat_template`` (e.g. Qwen3's
    ``{"enable_thinking": False}``)."""

    instruction: str | None = None
    system_prompt: str | None = None
    chat_template_kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, d: DataConfig) -> "PromptStyle":
        """The style a job's ``data`` section gives (``instruction``, ``system_prompt``,
        ``chat_template_kwargs``)."""
        kwargs = d.chat_template_kwargs or {}
        return cls(d.instruction, d.system_prompt, dict(kwargs))


def prompt_messages(problem: Problem, style: PromptStyle = PromptStyle(), hint: str | None = None) -> list[dict]:
    """The chat messages asking ``problem``: ``style.system_prompt`` (unless the problem's own chat
    starts with a system message), then the problem's messages or one user message; the last user
    message gets the hint and the instruction (``style.instruction``, else the task's).

    Args:
        hint: the reference answer, given as "Hint: the answer is <hint>." between the question and
            the instruction (STaR's rationalisation, Zelikman et al. 2022 Sec. 3.2); None: no hint.

    Raises:
        ValueError: a problem of an unknown task.
    """
    if problem.task not in INSTRUCTIONS and problem.task != FILE_TASK:
        raise ValueError(f"unknown task {problem.task!r}; valid tasks: {', '.join(TASKS)}")
    said = style.instruction if style.instruction is not None else INSTRUCTIONS.get(problem.task)
    extra = (f"\nHint: the answer is {hint}." if hint is not None else "") + (f"\n{said}" if said else "")
    if problem.messages is not None:
        messages = [dict(m) for m in problem.messages]
        last = messages[-1]["content"]
        if isinstance(last, str):
            messages[-1]["content"] = last + extra
        elif extra:  # content parts (an image's question): the extra text ends the last text part
            parts = [dict(x) for x in last]
            texts = [i for i, x in enumerate(parts) if x["type"] == "text"]
            if texts:
                parts[texts[-1]]["text"] += extra
            else:
                parts.append({"type": "text", "text": extra.lstrip("\n")})
            messages[-1]["content"] = parts
    else:
        messages = [{"role": "user", "content": f"{problem.question.strip()}{extra}" if problem.task != FILE_TASK
                     else problem.question + extra}]
    if style.system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": style.system_prompt})
    return messages


def build_prompt_ids(tokenizer: Any, problem: Problem, style: PromptStyle = PromptStyle(),
                     hint: str | None = None) -> list[int]:
    """Token ids of a chat prompt asking ``problem``, ending with the assistant generation prefix:
    :func:`prompt_messages` rendered with ``tokenizer.apply_chat_template(...,
    add_generation_prompt=True, tokenize=True, **style.chat_template_kwargs)``.

    Returns:
        A flat ``list[int]``.

    Raises:
        ValueError: as :func:`prompt_messages`.
    """
    return encode_prompt(tokenizer, prompt_messages(problem, style, hint), **style.chat_template_kwargs)


def prompt_length(tokenizer, problem: Problem, style: PromptStyle, images: ImageProcessor | None = None) -> int:
    """Tokens of ``problem``'s prompt as the engine holds it (:func:`build_prompt_ids`), each image's
    placeholder counted at its image's token count (its files decoded and processed by ``images``, a
    vision-language model's :class:`alignment.data.images.ImageProcessor`).

    Raises:
        ValueError: a problem with images for a text model (``images`` None), or an image file that
            cannot be decoded; FileNotFoundError: a missing image file (both naming the prompt).
    """
    where = f"prompt {problem.question[:60]!r}"
    if problem.images and images is None:  # before its template renders image parts it does not know
        raise ValueError(f"{where} shows images, but model.path is a text model; give a vision-language model or drop "
                         "the images")
    ids = build_prompt_ids(tokenizer, problem, style)
    if not problem.images:
        return len(ids)
    [inputs] = images.encode_files([tuple(problem.images)], [where])
    return len(images.expand(ids, inputs, where))


def job_prompts(d: DataConfig, seed: int, tokenizer=None, rollout=None, images: ImageProcessor | None = None
                ) -> PromptSets:
    """An RL job's training and held-out problems as a :class:`alignment.data.prompt_data.PromptSets`:
    ``data.train_files`` (:func:`alignment.data.prompt_data.load_prompt_files`) or else the built-in
    ``data.task``'s (``data.train_size``, ``data.heldout_size``; arithmetic-style tasks from
    ``data.generator`` with ``data.generator_kwargs``). With a ``tokenizer`` each prompt, rendered as
    the job renders it (:func:`prompt_length`: with its images' tokens, processed by ``images``), is checked
    against the job's ``rollout`` section's budget (``max_model_len`` - ``max_tokens``;
    ``data.overlong_prompts``, :func:`alignment.data.prompt_data.fit_prompts`). ``seed``: the job's, which
    draws a built-in task's problems.

    Raises:
        FileNotFoundError, ValueError: as ``load_prompt_files``, ``fit_prompts``, :func:`prompt_length` and
            :func:`alignment.data.tasks.load_problems`.
    """
    if d.train_files:
        sets, source = load_prompt_files(d), "data.train_files"
    else:
        kw = {"generator": d.generator, "generator_kwargs": dict(d.generator_kwargs)} \
            if d.task in ("arithmetic", "length") else {}
        train = load_problems(d.task, "train", d.train_size, seed=seed, **kw)
        heldout = load_problems(d.task, "heldout", d.heldout_size, seed=seed, **kw)
        source = f"data.task={d.task}"
        sets = PromptSets(train, heldout, len(train) + len(heldout), 0, (source,))
    if tokenizer is None:
        return sets
    if rollout is None:
        raise ValueError("job_prompts: a tokenizer checks prompts against the rollout's budget; give rollout=")
    style = PromptStyle.of(d)
    return fit_prompts(sets, lambda p: prompt_length(tokenizer, p, style, images), rollout.max_model_len,
                       rollout.max_tokens, d.overlong_prompts, source)
