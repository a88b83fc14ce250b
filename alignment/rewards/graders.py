"""Built-in graders: reward functions that compare a response with the problem's reference answer
(``reward.functions: [{name: math_verify}]``; options in the entry's ``kwargs``). Each takes the
problems and the response texts and returns one score per response: 1.0 / 0.0, or None where the
problem gives nothing to grade against (TRL's convention: the function does not apply there).

* ``math_verify``: Hugging Face's ``math-verify`` (LaTeX, ``\\boxed{}``, fractions, sets,
  intervals), the grader of TRL's ``accuracy_reward`` and open-r1: the reference parsed as given
  (a plain ``42``, LaTeX with or without ``$``), the response's answer extracted, the two
  compared symbolically.
* ``exact_match``: the response equals the reference, surrounding whitespace and runs of spaces
  ignored (``ignore_case``: false).
* ``numeric``: the response's final number (:func:`alignment.data.tasks.extract_final_number`)
  equals the reference within ``abs_tol`` (1e-6) or ``rel_tol`` (0).
* ``regex``: the response matches ``pattern`` (``mode``: search | match | fullmatch, DOTALL);
  needs no reference: a format check.
* ``code_tests``: the response's program passes the problem's tests in the sandbox
  (:mod:`alignment.sandbox.runner`): HumanEval-style columns ``prompt``, ``test`` and
  ``entry_point`` (:func:`alignment.rewards.code_runs.program`).
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable, Sequence

from alignment.data.tasks import Problem, extract_final_number
from alignment.rewards.code_runs import program, run_programs
from alignment.sandbox.runner import SandboxPool

__all__ = ["GRADERS", "math_verify", "exact_match", "numeric", "regex", "code_tests", "check_grader_kwargs"]


def _reference(problem: Problem) -> str | None:
    return problem.answer if problem.answer.strip() else None


def math_verify(problems: Sequence[Problem], texts: Sequence[str]) -> list[float | None]:
    """1.0 where ``math_verify.verify(parse(reference), parse(response))``, else 0.0; None where the
    reference is empty or ``math-verify`` finds no expression in it. ``math-verify`` bounds each
    parse and comparison by ``signal.alarm`` (5 s), which only the main thread can use: elsewhere
    they run unbounded."""
    from math_verify import parse, verify

    bounded = threading.current_thread() is threading.main_thread()
    limit = {} if bounded else {"parsing_timeout": None}
    out: list[float | None] = []
    for p, text in zip(problems, texts):
        ref = _reference(p)
        # a bare LaTeX reference (\\frac{1}{2}, \\{1, 2\\}) is read as math too
        gold = (parse(ref, **limit) or parse(f"${ref}$", **limit)) if ref is not None else []
        if not gold:
            out.append(None)
            continue
        out.append(1.0 if verify(gold, parse(text, **limit), **({} if bounded else {"timeout_seconds": None})) else 0.0)
    return out


def _normal(text: str, ignore_case: bool) -> str:
    text = " ".join(text.split())
    return text.lower() if ignore_case else text


def exact_match(problems: Sequence[Problem], texts: Sequence[str], ignore_case: bool = False) -> list[float | None]:
    """1.0 where the response equals the reference (whitespace runs collapsed, ends stripped;
    ``ignore_case``), else 0.0; None without a reference."""
    return [None if _reference(p) is None else float(_normal(t, ignore_case) == _normal(p.answer, ignore_case))
            for p, t in zip(problems, texts)]


def numeric(problems: Sequence[Problem], texts: Sequence[str], abs_tol: float = 1e-6,
            rel_tol: float = 0.0) -> list[float | None]:
    """1.0 where the response's final number is ``math.isclose`` to the reference (``abs_tol``,
    ``rel_tol``), else 0.0 (no number in the response: 0.0); None where the reference is not a number."""
    out: list[float | None] = []
    for p, t in zip(problems, texts):
        ref = extract_final_number(p.answer) if _reference(p) is not None else None
        if ref is None:
            out.append(None)
            continue
        pred = extract_final_number(t)
        out.append(float(pred is not None and math.isclose(float(pred), float(ref), rel_tol=rel_tol, abs_tol=abs_tol)))
    return out


MODES = ("search", "match", "fullmatch")


def regex(problems: Sequence[Problem], texts: Sequence[str], pattern: str = "", mode: str = "search") -> list[float]:
    """1.0 where ``re.<mode>(pattern, response, re.DOTALL)`` matches, else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    find = getattr(compiled, mode)
    return [float(find(t) is not None) for t in texts]


def code_tests(problems: Sequence[Problem], texts: Sequence[str], workers: int = 1,
               pool: SandboxPool | None = None) -> list[float | None]:
    """1.0 where the response's program passes the problem's tests in the sandbox, else 0.0; None
    for a problem without ``test`` and ``entry_point`` columns (or a HumanEval entry). Runs in
    ``pool`` (its prefetched runs taken), or ``workers`` sandbox processes side by side."""

    programs = [program("code_tests", p, t) for p, t in zip(problems, texts)]
    runs = [c for c in programs if c is not None]
    scores = iter(run_programs(runs, pool, workers) if runs else [])
    return [None if c is None else next(scores) for c in programs]


GRADERS: dict[str, Callable] = {"math_verify": math_verify, "exact_match": exact_match, "numeric": numeric,
                                "regex": regex, "code_tests": code_tests}
#: the options each grader takes in its ``reward.functions`` entry's ``kwargs``
OPTIONS = {"math_verify": (), "exact_match": ("ignore_case",), "numeric": ("abs_tol", "rel_tol"),
           "regex": ("pattern", "mode"), "code_tests": ()}


def check_grader_kwargs(name: str, kwargs: dict) -> None:
    """A grader's ``kwargs``: known options, a compilable ``pattern`` for ``regex``.

    Raises:
        ValueError: naming the option and what is valid.
    """
    unknown = sorted(set(kwargs) - set(OPTIONS[name]))
    if unknown:
        raise ValueError(f"reward.functions[{name}].kwargs has {unknown}; {name} takes "
                         f"{', '.join(OPTIONS[name]) or 'no options'}")
    if name == "regex":
        if not kwargs.get("pattern"):
            raise ValueError("reward.functions[regex] needs kwargs.pattern, e.g. {pattern: '^<think>.*</think>'}")
        try:
            re.compile(kwargs["pattern"])
        except re.error as e:
            raise ValueError(f"reward.functions[regex].kwargs.pattern={kwargs['pattern']!r}: not a regular "
                             f"expression ({e})") from e
        if kwargs.get("mode", "search") not in MODES:
            raise ValueError(f"reward.functions[regex].kwargs.mode={kwargs['mode']!r}: valid: {', '.join(MODES)}")
