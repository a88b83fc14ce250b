"""Every reward function an RL job can name in ``reward.functions`` that reads the responses' text:
the built-in text functions (:mod:`alignment.rewards.text`), the graders
(:mod:`alignment.rewards.graders`) and your own, by import path (``my_pkg.rewards:score``). The
functions that run a model (``reward_model``, ``process_reward``) live in the trainers.

Your own function takes one of two conventions, told apart by its parameter names:

* TRL's ``reward_funcs``: ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``,
  called once per batch: ``prompts`` as the dataset gives them (strings, or message lists for chat
  prompts), ``completions`` the responses (strings, or ``[{"role": "assistant", "content": ...}]``
  for chat prompts), ``completion_ids`` their token ids, and every other column of the data as a
  keyword argument holding one value per sample (a built-in task's: ``answer`` and ``task``), plus
  the entry's ``kwargs``. A function without ``**kwargs`` gets only the names it takes.
  (A reward server over HTTP is the ``http`` function, :mod:`alignment.rewards.remote`; an LLM judge
  behind an OpenAI-compatible endpoint the ``judge`` function, :mod:`alignment.rewards.judge`.)
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``, called per
  sample: ``data_source`` the ``data_source`` column (else "file" / the task's name),
  ``ground_truth`` the reference answer, ``extra_info`` the ``extra_info`` column (else every
  column); it may return a float or a dict with a ``score``.

Either may be ``async def``. A call gets ``reward.timeout_s`` seconds. None is "does not apply to
this sample" (TRL): the sample's weighted sum skips that term (a whitened term's statistics too).
Anything else that is not a finite number, a list of the wrong length, or an exception is refused
with the function's name, the sample's index and its prompt (:class:`RewardFunctionError`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import inspect
import math
import numbers
import signal
import threading
from collections.abc import Callable, Sequence

import torch

from alignment.algorithms.composite_reward import RewardTerm
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rewards import judge
from alignment.rewards.graders import GRADERS, check_grader_kwargs
from alignment.rewards.remote import check_settings, http_scores
from alignment.rewards.text import TEXT_FUNCTIONS, text_scores
from alignment.data.samples import Sample
from alignment.sandbox.runner import SandboxPool

__all__ = ["RewardFunctionError", "MODEL_FUNCTIONS", "BUILTINS", "REFERENCE_GRADERS", "is_user_function",
           "load_user_function", "check_function", "reads_of", "required_columns", "function_scores", "problem_columns"]

#: functions that run a model (the trainers compute them)
MODEL_FUNCTIONS = ("reward_model", "process_reward")
HTTP = "http"  # a reward server (alignment/rewards/remote.py)
JUDGE = "judge"  # an LLM as judge behind an OpenAI-compatible endpoint (alignment/rewards/judge.py)
#: every function named by a word
BUILTINS = TEXT_FUNCTIONS + tuple(GRADERS) + (HTTP, JUDGE) + MODEL_FUNCTIONS
TRL, VERL = "trl", "verl"
DEFAULT_TIMEOUT_S = 300.0


class RewardFunctionError(ValueError):
    """A reward function that cannot be loaded or called, or returned what is not a score; the
    message names the function, the sample and the fix."""


def is_user_function(function: str) -> bool:
    """Whether ``function`` is an import path (``package.module:function``) rather than a built-in."""
    return ":" in function


@functools.lru_cache(maxsize=None)
def load_user_function(path: str) -> tuple[Callable, str]:
    """``package.module:function`` imported (once per process), and its convention (TRL or verl).

    Raises:
        RewardFunctionError: the module does not import (naming the error), has no such function,
            or the function's parameters fit neither convention.
    """
    module, _, attr = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise RewardFunctionError(f"reward.functions: {path}: module {module!r} does not import "
                                  f"({type(e).__name__}: {e}); is it on PYTHONPATH (or installed)?") from e
    except AttributeError as e:
        raise RewardFunctionError(f"reward.functions: {path}: module {module!r} has no {attr!r}") from e
    if not callable(fn):
        raise RewardFunctionError(f"reward.functions: {path} is a {type(fn).__name__}, not a function")
    return fn, _convention(path, fn)


def _convention(path: str, fn: Callable) -> str:
    params = inspect.signature(fn).parameters
    if "solution_str" in params and "ground_truth" in params:
        return VERL
    if params.keys() & {"prompts", "completions", "completion_ids"}:  # TRL passes them by name
        return TRL
    shown = ", ".join(str(p) for p in params.values())
    raise RewardFunctionError(
        f"reward.functions: {path}({shown}) fits neither convention: TRL's fn(prompts, completions, completion_ids, "
        "**kwargs) -> list[float | None], or verl's compute_score(data_source, solution_str, ground_truth, "
        "extra_info=None) -> float")


def _accepts(fn: Callable, names) -> dict[str, bool]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {n: True for n in names}
    return {n: n in params for n in names}


def check_function(term: RewardTerm) -> None:
    """What can be checked of ``term``'s function before training: a built-in's options, a user
    function's import, convention and ``kwargs`` it can take.

    Raises:
        RewardFunctionError: naming the function and the fix.
    """
    f = term.runs
    if f in GRADERS or f in (HTTP, JUDGE):
        check = {HTTP: check_settings, JUDGE: judge.check_settings}.get(f)
        try:
            (check_grader_kwargs(f, dict(term.kwargs)) if f in GRADERS else check(term.name, dict(term.kwargs)))
        except ValueError as e:
            raise RewardFunctionError(str(e)) from e
        return
    if not is_user_function(f):
        if term.kwargs:
            raise RewardFunctionError(f"reward.functions[{term.name}].kwargs: {f} takes no options")
        return
    fn, convention = load_user_function(f)
    if convention == TRL:
        missing = [k for k, ok in _accepts(fn, list(term.kwargs)).items() if not ok]
        if missing:
            raise RewardFunctionError(f"reward.functions[{term.name}].kwargs has {missing}, which {f} takes no "
                                      "parameter for (add them, or **kwargs)")


#: graders that compare a response with the problem's reference answer (a sample without one scores None)
REFERENCE_GRADERS = ("math_verify", "exact_match", "numeric")
#: what a TRL reward function gets that is not a data column
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids")


def reads_of(term: RewardTerm) -> tuple[bool, set[str] | None]:
    """What ``term``'s function reads of a prompt file's records: ``(reference, columns)``: whether it reads
    the reference answer (``data.answer_key``'s column: the reference graders, verl's ``ground_truth``, a judge's
    ``{reference}``), and the columns it takes by name (None: every column: a TRL function with ``**kwargs``, a
    reward server)."""
    f = term.runs
    if f in REFERENCE_GRADERS or f == JUDGE:
        return True, set()
    if f == "code_tests":
        return False, {"test", "entry_point", "prompt"}
    if f == HTTP:
        return True, None
    if not is_user_function(f):
        return False, set()
    fn, convention = load_user_function(f)
    if convention == VERL:
        return True, {"data_source", "extra_info"}
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return False, None
    return False, {n for n in params if n not in TRL_ARGUMENTS}


def required_columns(term: RewardTerm) -> list[str]:
    """The parameters of a TRL function of the user's that have no default, are no TRL argument and are not
    in the entry's ``kwargs``: each must be a data column (else the call fails, or worse, gets nothing)."""
    if not is_user_function(term.runs):
        return []
    fn, convention = load_user_function(term.runs)
    if convention != TRL:
        return []
    return [n for n, p in inspect.signature(fn).parameters.items()
            if n not in TRL_ARGUMENTS and n not in term.kwargs and p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)]


def problem_columns(problem: Problem) -> dict:
    """The columns a reward function gets for ``problem``: a file record's own, a built-in task's
    ``answer`` and ``task``."""
    if problem.task == FILE_TASK:
        return dict(problem.columns)
    return {"answer": problem.answer, "task": problem.task}


def _prompt(problem: Problem):
    return [dict(m) for m in problem.messages] if problem.messages is not None else problem.question


def _check_scores(name: str, values, problems: Sequence[Problem]) -> list[float | None]:
    if isinstance(values, torch.Tensor) or hasattr(values, "tolist"):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardFunctionError(f"reward.functions[{name}] returned a {type(values).__name__}; return a list of "
                                  f"{len(problems)} floats (or None), one per completion")
    if len(values) != len(problems):
        raise RewardFunctionError(f"reward.functions[{name}] returned {len(values)} scores for {len(problems)} "
                                  "completions; return one per completion (None where it does not apply)")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
            raise RewardFunctionError(f"reward.functions[{name}] returned {v!r} ({type(v).__name__}) for sample {i} "
                                      f"(prompt {problems[i].question[:80]!r}): a score is a finite number, or None "
                                      "where the function does not apply")
        out.append(float(v))
    return out


class _TimedOut(Exception):
    """Raised in the main thread by :func:`_run`'s watchdog at the timeout."""


def _too_slow(name: str, timeout: float) -> RewardFunctionError:
    return RewardFunctionError(f"reward.functions[{name}] took longer than reward.timeout_s={timeout:g} s; make it "
                               "faster or raise reward.timeout_s")


def _run(call: Callable, is_async: bool, timeout: float, name: str):
    """``call()`` (a coroutine function when ``is_async``) within ``timeout`` seconds. A plain
    function runs in the calling thread, as TRL calls it (``math-verify`` and other ``signal.alarm``
    users work only in the main thread); from the main thread a watchdog interrupts it at the
    timeout (SIGINT to the main thread: a sleep or a blocking call returns, Python code stops at the
    next bytecode), from another thread it runs in a worker thread waited on for ``timeout``."""
    if is_async:
        async def bounded():
            return await asyncio.wait_for(call(), timeout)
        try:
            return asyncio.run(bounded())
        except asyncio.TimeoutError as e:
            raise _too_slow(name, timeout) from e
    if threading.current_thread() is not threading.main_thread():
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            return pool.submit(call).result(timeout=timeout)
        except concurrent.futures.TimeoutError as e:
            raise _too_slow(name, timeout) from e
        finally:
            pool.shutdown(wait=False)
    fired = threading.Event()

    def interrupt():
        fired.set()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def on_sigint(signum, frame):
        if fired.is_set():
            raise _TimedOut
        if callable(previous):  # a real Ctrl-C: what the process did before
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt

    # our own handler for the call's length: the process's may have been replaced or set to ignore
    # SIGINT (a launcher's, a library's), and the watchdog must interrupt all the same
    previous = signal.signal(signal.SIGINT, on_sigint)
    watchdog = threading.Timer(timeout, interrupt)
    watchdog.start()
    try:
        return call()
    except _TimedOut:
        raise _too_slow(name, timeout) from None
    finally:
        watchdog.cancel()
        signal.signal(signal.SIGINT, previous)


def _trl_kwargs(fn, problems: Sequence[Problem], samples: Sequence[Sample], extra: dict) -> dict:
    chat = any(p.messages is not None for p in problems)
    columns: dict[str, list] = {}
    for i, p in enumerate(problems):
        for k, v in problem_columns(p).items():
            columns.setdefault(k, [None] * len(problems))[i] = v
    given = {"prompts": [_prompt(p) for p in problems],
             "completions": [[{"role": "assistant", "content": s.text}] if chat else s.text for s in samples],
             "completion_ids": [list(s.response_ids) for s in samples], **columns, **extra}
    accepts = _accepts(fn, given)
    return {k: v for k, v in given.items() if accepts[k]}


def _call_trl(term: RewardTerm, fn, problems, samples, timeout: float) -> list:
    call = functools.partial(fn, **_trl_kwargs(fn, problems, samples, dict(term.kwargs)))
    try:
        return _run(call, inspect.iscoroutinefunction(fn), timeout, term.name)
    except RewardFunctionError:
        raise
    except Exception as e:  # find the sample it fails on, one at a time
        for i in range(len(problems)):
            one = functools.partial(fn, **_trl_kwargs(fn, problems[i : i + 1], samples[i : i + 1], dict(term.kwargs)))
            try:
                _run(one, inspect.iscoroutinefunction(fn), timeout, term.name)
            except Exception as e_i:  # noqa: BLE001 - reported with the sample
                raise RewardFunctionError(f"reward.functions[{term.name}] ({term.runs}) raised {type(e_i).__name__}: "
                                          f"{e_i} on sample {i} (prompt {problems[i].question[:80]!r})") from e_i
        raise RewardFunctionError(f"reward.functions[{term.name}] ({term.runs}) raised {type(e).__name__}: {e} on the "
                                  f"batch of {len(problems)} (on no sample alone)") from e


def _call_verl(term: RewardTerm, fn, problems, samples, timeout: float) -> list:
    takes_kwargs = _accepts(fn, ["_"])["_"]

    def args(p: Problem, s: Sample) -> dict:
        cols = problem_columns(p)
        return {"data_source": cols.get("data_source", p.task), "solution_str": s.text, "ground_truth": p.answer,
                "extra_info": cols.get("extra_info", cols), **(dict(term.kwargs) if takes_kwargs else {})}

    def score(out):
        return out.get("score") if isinstance(out, dict) else out

    if inspect.iscoroutinefunction(fn):
        async def every():
            return await asyncio.gather(*(fn(**args(p, s)) for p, s in zip(problems, samples)),
                                        return_exceptions=True)
        results = _run(every, True, timeout, term.name)
    else:
        def every():
            out = []
            for p, s in zip(problems, samples):
                try:
                    out.append(fn(**args(p, s)))
                except Exception as e:  # noqa: BLE001 - reported with the sample below
                    out.append(e)
            return out
        results = _run(every, False, timeout, term.name)
    for i, r in enumerate(results):
        if isinstance(r, Exception):
            raise RewardFunctionError(f"reward.functions[{term.name}] ({term.runs}) raised {type(r).__name__}: {r} on "
                                      f"sample {i} (prompt {problems[i].question[:80]!r})") from r
    return [score(r) for r in results]


def function_scores(term: RewardTerm, problems: Sequence[Problem | None], samples: Sequence[Sample],
                    max_tokens: int, timeout: float = DEFAULT_TIMEOUT_S, workers: int = 1,
                    pool: SandboxPool | None = None) -> torch.Tensor:
    """Scores ``[N]`` (float32; NaN where the function returned None) of ``term``'s function for
    ``samples`` (``problems[i]``: what ``samples[i]`` answers; None only for the built-in functions
    that need no problem). ``max_tokens``: ``rollout.max_tokens`` (the ``length`` function);
    ``timeout``: ``reward.timeout_s`` per call of a user function; ``workers``: sandbox processes
    side by side (``code_tests``); ``pool``: the sandbox pool code runs in instead, with the runs it
    started while the answers were generated (:mod:`alignment.rewards.code_runs`).

    Raises:
        RewardFunctionError: a user function that fails, times out or returns what is not a score.
        ValueError: mismatched lengths; a model function (computed by the trainers).
    """
    f = term.runs
    if len(problems) != len(samples):
        raise ValueError(f"{len(problems)} problems for {len(samples)} samples")
    if f in TEXT_FUNCTIONS:
        return text_scores(f, problems, samples, max_tokens, pool)
    if f in MODEL_FUNCTIONS:
        raise ValueError(f"reward function {f} runs a model: the trainers score it")
    if any(p is None for p in problems):
        raise ValueError(f"reward function {term.name} grades answers to problems; these prompts have none")
    texts = [s.text for s in samples]
    if f in GRADERS:
        extra = {"workers": workers, "pool": pool} if f == "code_tests" else {}
        values = GRADERS[f](problems, texts, **dict(term.kwargs), **extra)
    elif f == JUDGE:
        values = judge.judge_scores(term.name, problems, samples, dict(term.kwargs))
    elif f == HTTP:
        values = http_scores(term.name, problems, samples, [problem_columns(p) for p in problems], dict(term.kwargs))
    elif is_user_function(f):
        fn, convention = load_user_function(f)
        values = (_call_trl if convention == TRL else _call_verl)(term, fn, problems, samples, timeout)
    else:
        raise ValueError(f"unknown reward function {f!r}; valid: {', '.join(BUILTINS)} or package.module:function")
    scores = _check_scores(term.name, values, problems)
    return torch.tensor([math.nan if v is None else v for v in scores], dtype=torch.float32)
