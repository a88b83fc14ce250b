"""``reward``: what an RL job's per-sample reward is made of (:class:`RewardConfig`, a list of
:class:`RewardFunctionConfig` terms), the terms it gives (:func:`terms_of`) and the checks of its
own values (:func:`check_functions`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from alignment.algorithms.composite_reward import RewardTerm
from alignment.rewards.functions import BUILTINS, RewardFunctionError, check_function, is_user_function
from alignment.rewards.graders import GRADERS
from alignment.schema import ConfigError, plain, ranged, unbounded

#: a ``reward.functions`` entry's fields for a reward server or a judge -> the functions that take them
SERVER_FIELDS = {"url": ("http", "judge"), "batch_size": ("http",), "timeout_s": ("http", "judge"),
                 "max_retries": ("http", "judge"), "on_error": ("http", "judge"), "model": ("judge",),
                 "mode": ("judge",), "template": ("judge",), "parse": ("judge",)}
#: the built-ins named by name only (not by a term's ``function``)
REWARD_FUNCTIONS = ("correctness", "format", "length", "environment", "reward_model", "process_reward")
PROCESS_REWARD = "process_reward"  # the dense term: per step, not per sample


@dataclass
class RewardFunctionConfig:
    """One entry of ``reward.functions`` (alignment/algorithms/composite_reward.py)."""

    # correctness (the task's grader) | format (the answer in the form the prompt asks for) | length
    # (-tokens / rollout.max_tokens) | environment (a multi-turn episode's environment rewards) |
    # reward_model (model.reward_model_path's score at the last token) |
    # process_reward (reward.process_reward_model's P(step correct) at the end of every step: a dense
    # reward, GRPO family: process-supervised advantages, PPO: rewards on the step-end tokens)
    # graders (alignment/rewards/graders.py): math_verify | exact_match | numeric | regex | code_tests;
    # or your own, by import path: package.module:function (TRL's or verl's signature, alignment/rewards/functions.py)
    name: str = "correctness"
    weight: float = unbounded(1.0)
    whiten: bool = False  # standardise this function's scores over the global batch before weighting
    # a grader or package.module:function that computes this term (null: name), so that one function can
    # appear twice under two names, e.g. {name: strict_format, function: regex, kwargs: {pattern: ...}}
    function: Optional[str] = None
    kwargs: dict[str, Any] = field(default_factory=dict)  # options: a grader's, or keyword arguments of your function
    # function http (alignment/rewards/remote.py): the reward server's URL, completions per request, seconds per
    # request, retries (exponential backoff), and what a batch that still fails does: stop (checkpoint and stop
    # the run) | skip (its groups leave the update, counted as reward/skipped_groups)
    url: Optional[str] = None
    batch_size: Optional[int] = unbounded(None)
    timeout_s: Optional[float] = unbounded(None)
    max_retries: Optional[int] = unbounded(None)
    on_error: Optional[str] = None
    # function judge (alignment/rewards/judge.py; with url, timeout_s, max_retries, on_error): the served model's
    # name (null: the endpoint's first), or without url an HF directory the job runs the judge from with vLLM;
    # pointwise (one reply per response) | pairwise (a prompt's responses compared two by two, both orders);
    # the judge's prompt ({prompt}, {completion} or {completion_a} and {completion_b}, {reference}) and how a
    # pointwise reply becomes a score: verdict (correct / incorrect) | number (kwargs.score_range, scaled to [0, 1])
    model: Optional[str] = None
    mode: Optional[str] = None
    template: Optional[str] = None
    parse: Optional[str] = None


@dataclass
class RewardConfig:
    """``reward``: what an RL job's per-sample reward is made of. ``functions`` empty: the job's own
    (the task's grader for the GRPO family, the reward model for PPO)."""

    functions: list[RewardFunctionConfig] = field(default_factory=list)  # the reward's terms: [{name, weight, ...}]
    # seconds one call of a reward function of your own may take (a batch, TRL's way)
    timeout_s: float = ranged(300.0, 0, low_in=False, note=' (seconds)')
    # HF export of a process reward model (--config-name prm) for the process_reward function; its steps
    # end at algorithm.step_separator
    process_reward_model: str = ""


def terms_of(reward: RewardConfig, default: str = "correctness") -> list[RewardTerm]:
    """The :class:`alignment.algorithms.composite_reward.RewardTerm` s of ``reward.functions``
    (a server's or judge's fields in its ``kwargs``), or the one term ``default`` when it is empty."""

    if not reward.functions:
        return [RewardTerm(default)]
    return [RewardTerm(f.name, float(f.weight), bool(f.whiten), f.function or "",
                       {**plain(f.kwargs or {}), **{k: plain(getattr(f, k)) for k in SERVER_FIELDS
                                                    if getattr(f, k) is not None}})
            for f in reward.functions]


def is_pairwise(term) -> bool:
    """Whether ``term`` is a judge comparing a prompt's responses with each other (``mode: pairwise``): it
    scores groups, so it cannot grade a lone held-out answer."""
    return term.runs == "judge" and term.kwargs.get("mode") == "pairwise"


def check_functions(reward: RewardConfig) -> None:
    """``reward.functions``: each names a built-in, a grader or ``package.module:function`` that
    loads, sets only the server or judge fields its function takes, appears once, and has a finite
    weight, not all of them 0.

    Raises:
        ConfigError: naming the entry and the fix.
    """
    functions = list(reward.functions)
    names = [f.name for f in functions]
    for f in functions:
        runs = f.function or f.name
        if f.function and f.function in REWARD_FUNCTIONS:
            raise ConfigError(f"reward.functions[{f.name}].function={f.function}: the built-in {f.function} is named "
                              f"by name ({{name: {f.function}}}); function names a grader ({', '.join(GRADERS)}) or "
                              "package.module:function")
        if runs not in BUILTINS and not is_user_function(runs):
            raise ConfigError(f"reward.functions names {runs!r}: valid are {', '.join(BUILTINS)}, or your own as "
                              "package.module:function")
        given = [k for k in SERVER_FIELDS if getattr(f, k) is not None]
        wrong = [k for k in given if runs not in SERVER_FIELDS[k]]
        if wrong:
            raise ConfigError(f"reward.functions[{f.name}] sets {wrong}, which configure "
                              f"{' or '.join(sorted({x for k in wrong for x in SERVER_FIELDS[k]}))}, not {runs}; unset them")
    if len(set(names)) != len(names):
        raise ConfigError(f"reward.functions={names}: each name may appear once (one weight each; to use a function "
                          "twice, give the second a name of its own and function: <the function>)")
    if functions and not any(math.isfinite(f.weight) and f.weight != 0 for f in functions):
        raise ConfigError("reward.functions: every weight is 0 (or not finite); give at least one non-zero weight")
    for f in functions:
        if not math.isfinite(f.weight):
            raise ConfigError(f"reward.functions[{f.name}].weight={f.weight}: must be a finite number")
    for t in terms_of(reward):
        try:
            check_function(t)
        except RewardFunctionError as e:
            raise ConfigError(str(e)) from e
