"""The reward functions that run code, and the program each runs for an answer.

``correctness`` on a code task (:data:`CODE_TASKS`: HumanEval) and ``code_tests`` (a dataset's
``prompt`` / ``test`` / ``entry_point`` columns) grade an answer by running
:func:`alignment.data.code_tasks.check_program` in the sandbox (:data:`alignment.data.code_tasks.CODE_LIMITS`).
:func:`program` is the one place that builds that program, for the graders at scoring time and for
the rollout as each prompt's answers finish generating (:func:`prefetcher`, the engines' ``on_done``):
a :class:`alignment.sandbox.runner.SandboxPool` starts those runs while the engine goes on generating,
and the grader's :meth:`~alignment.sandbox.runner.SandboxPool.map` takes them instead of running
them again (issue 18's overlap of scoring with generation; ``bench/code_overlap.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Iterator

from alignment.data.code_tasks import CODE_LIMITS, check_program
from alignment.data.tasks import Problem
from alignment.data.samples import OnDone, Sample
from alignment.sandbox.runner import SandboxPool, sandbox_workers

__all__ = ["CODE_TASKS", "CODE_FUNCTIONS", "program", "code_pool", "run_programs", "prefetcher", "early_grading"]

#: tasks whose ``correctness`` runs code in the sandbox (a process per response)
CODE_TASKS = ("humaneval",)
#: the reward functions (``RewardTerm.runs``) that may run code
CODE_FUNCTIONS = ("correctness", "code_tests")


def program(runs: str, problem: Problem | None, text: str) -> str | None:
    """The program the reward function ``runs`` runs in the sandbox to grade ``text``, the answer to
    ``problem``; None where it runs none (another function or task; ``code_tests`` on a problem
    without ``test`` and ``entry_point`` columns: the function does not apply)."""
    if problem is None:
        return None
    if runs == "correctness":
        return check_program(problem.entry, text) if problem.task in CODE_TASKS else None
    if runs == "code_tests":
        entry = problem.entry if problem.entry is not None else problem.columns
        if not all(isinstance(entry.get(k), str) for k in ("test", "entry_point")):
            return None
        return check_program({"prompt": entry.get("prompt", problem.question), **entry}, text)
    return None


def code_pool(workers: int | None = None) -> SandboxPool:
    """A pool of ``workers`` sandboxes (None: :func:`alignment.sandbox.runner.sandbox_workers`) with
    the limits of one test run (:data:`alignment.data.code_tasks.CODE_LIMITS`)."""
    return SandboxPool(max(1, workers or sandbox_workers()), CODE_LIMITS)


def run_programs(programs: Sequence[str], pool: SandboxPool | None = None, workers: int | None = None) -> list[float]:
    """1.0 where the program exits with status 0 within the limits, else 0.0: ``pool``'s runs (its
    prefetched ones taken), or a pool of ``workers`` made for the call when None."""
    if pool is None:
        with code_pool(workers) as own:
            return run_programs(programs, own)
    return [1.0 if r.ok else 0.0 for r in pool.map(list(programs))]


def prefetcher(pool: SandboxPool, functions: Sequence[str], problems: Sequence[Problem | None]
               ) -> OnDone:
    """An engine's ``on_done`` (:meth:`alignment.rollout.base.RolloutEngine.generate`): when prompt
    ``i``'s samples are finished, start in ``pool`` the program each of ``functions`` (reward
    functions, ``RewardTerm.runs``) would run to grade each of them as an answer to ``problems[i]``."""
    def on_done(i: int, samples: list[Sample]) -> None:
        for s in samples:
            for f in functions:
                code = program(f, problems[i], s.text)
                if code is not None:
                    pool.prefetch(code)
    return on_done


@contextmanager
def early_grading(functions: Sequence[str], problems: Sequence[Problem | None]
                  ) -> Iterator[tuple[SandboxPool | None, OnDone | None]]:
    """``(pool, on_done)`` for generating and then grading answers to ``problems`` with the reward
    functions ``functions`` (``RewardTerm.runs``): a :func:`code_pool` (closed on exit) and its
    :func:`prefetcher`, to pass to the engine's ``generate`` and then to the grader; ``(None, None)``
    when none of them runs code on these problems."""
    runs = [f for f in functions if f in CODE_FUNCTIONS]
    if not any(f == "code_tests" or (p is not None and p.task in CODE_TASKS) for f in runs for p in problems):
        yield None, None
        return
    with code_pool() as pool:
        yield pool, prefetcher(pool, runs, problems)
