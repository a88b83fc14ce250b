"""The reward functions that read only the text of a response (``reward.functions``; the one
that runs a model, ``reward_model``, lives in :mod:`alignment.trainers.rewarding`):

* ``correctness``: the task's grader (:func:`alignment.data.tasks.score_response`, in [0, 1]); the
  tasks that run code (:data:`alignment.rewards.code_runs.CODE_TASKS`) are graded in a sandbox pool,
  :func:`alignment.sandbox.runner.sandbox_workers` samples at a time (the runs it started while the
  engine generated taken: :mod:`alignment.rewards.code_runs`).
* ``format``: 1.0 when the response is in the form the task's prompt asks for
  (:data:`alignment.data.prompts.INSTRUCTIONS`: "Answer with a single number." -> the stripped
  response is one number, thousands commas, ``$`` and a final ``.`` allowed), else 0.0. The
  format reward of DeepSeek-R1 (Sec. 2.2.2) and TRL's ``format_reward``, for this task's format.
* ``length``: ``-len(response_ids) / rollout.max_tokens``, in [-1, 0]: a length penalty
  (Kimi k1.5's length reward pushes the same way), to be weighted, e.g. 0.1.
* ``environment``: the sum of the rewards a multi-turn episode's environment gave
  (``rollout.environment``, :class:`alignment.envs.base.Transition`); 0 for single answers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from alignment.data import tasks
from alignment.rewards.code_runs import CODE_TASKS, program, run_programs
from alignment.data.samples import Sample
from alignment.sandbox.runner import SandboxPool

TEXT_FUNCTIONS = ("correctness", "format", "length", "environment")
#: tasks whose prompt asks for a format :func:`format_score` checks
FORMAT_TASKS = ("arithmetic", "gsm8k")
_SINGLE_NUMBER = re.compile(r"\s*\$?(?:" + tasks.NUMBER_PATTERN + r")\.?\s*")


def format_score(task: str, text: str) -> float:
    """1.0 if ``text`` answers in the form ``task``'s prompt asks for, else 0.0 (see the module
    docstring).

    Raises:
        ValueError: ``task`` asks for no checkable format (not in :data:`FORMAT_TASKS`).
    """
    if task not in FORMAT_TASKS:
        raise ValueError(f"task {task!r} asks for no answer format; the format reward applies to "
                         f"{', '.join(FORMAT_TASKS)}")
    return 1.0 if _SINGLE_NUMBER.fullmatch(text.replace("\u2212", "-")) else 0.0


def length_score(response_tokens: int, max_tokens: int) -> float:
    """``-response_tokens / max_tokens``: 0 for an empty response, -1 at the token budget.

    Raises:
        ValueError: ``max_tokens`` < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"rollout.max_tokens={max_tokens}: must be >= 1")
    return -response_tokens / max_tokens


def text_scores(name: str, problems: Sequence[tasks.Problem | None], samples: Sequence[Sample],
                max_tokens: int, pool: SandboxPool | None = None) -> torch.Tensor:
    """Scores ``[N]`` (float32) of the text function ``name`` for ``samples``; ``problems[i]`` is
    the problem ``samples[i]`` answers (None for prompts without one: ``length`` only). ``pool``:
    where code tasks' answers run (:func:`alignment.rewards.code_runs.run_programs`; None: a pool
    made for the call).

    Raises:
        ValueError: an unknown ``name``, mismatched lengths, or a function that needs a problem
            given None.
    """
    if name not in TEXT_FUNCTIONS:
        raise ValueError(f"unknown text reward function {name!r}; valid: {', '.join(TEXT_FUNCTIONS)}")
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems for {len(samples)} samples")
    if name == "length":
        return torch.tensor([length_score(len(s.response_ids), max_tokens) for s in samples], dtype=torch.float32)
    if name == "environment":
        return torch.tensor([float(s.info.get("env_reward", 0.0)) for s in samples], dtype=torch.float32)
    if any(p is None for p in problems):
        raise ValueError(f"the {name} reward grades answers to a task's problems; these prompts have none")
    if name == "correctness":  # looked up at call time (tests replace the grader)
        texts = [s.text for s in samples]
        code = [i for i, p in enumerate(problems) if p.task in CODE_TASKS]  # sandbox processes side by side
        ran = dict(zip(code, run_programs([program(name, problems[i], texts[i]) for i in code], pool))) if code else {}
        return torch.tensor([ran[i] if i in ran else tasks.score_response(p, t)
                             for i, (p, t) in enumerate(zip(problems, texts))], dtype=torch.float32)
    return torch.tensor([format_score(p.task, s.text) for p, s in zip(problems, samples)], dtype=torch.float32)
