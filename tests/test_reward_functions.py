"""Reward functions by import path (TRL's and verl's conventions, sync and async, timeouts, bad
return values, exceptions) and the built-in graders (alignment/rewards/)."""

from __future__ import annotations

import math

import pytest
import torch

from alignment.algorithms.composite_reward import RewardTerm, combine_rewards, whiten_scores
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rewards.functions import RewardFunctionError, check_function, function_scores
from alignment.rewards.graders import check_grader_kwargs, exact_match, math_verify, numeric, regex
from alignment.data.samples import Sample


def sample(text: str, ids=(1, 2, 3)) -> Sample:
    return Sample([0], list(ids), [0.0] * len(ids), text, True)


def problems(n: int, **columns) -> list[Problem]:
    return [Problem(f"q{i}", columns.get("solution", [""] * n)[i], FILE_TASK,
                    columns={k: v[i] for k, v in columns.items()}) for i in range(n)]


def scores(function: str, probs, samples, **kw) -> list[float]:
    return function_scores(RewardTerm("f", function=function, kwargs=kw.pop("kwargs", {})), probs, samples, 16,
                           **kw).tolist()


def test_trl_signature_gets_columns_and_none_means_does_not_apply():
    probs = problems(3, solution=["4", "9", None])
    got = scores("tests.reward_fns:contains_answer", probs, [sample("it is 4"), sample("it is 8"), sample("x")])
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2])
    assert scores("tests.reward_fns:scaled_length", problems(2), [sample("ab"), sample("abcd")],
                  kwargs={"scale": 0.5}) == [1.0, 2.0]  # no **kwargs: only what it takes, and its option
    assert scores("tests.reward_fns:async_ids", problems(2), [sample("a", [1]), sample("b", [1, 2])]) == [1.0, 2.0]
    chat = [Problem("hi", "", FILE_TASK, messages=({"role": "user", "content": "hi"},))]
    assert scores("tests.reward_fns:chat_echo", chat, [sample("hello")]) == [1.0]


def test_verl_signature_sync_and_async():
    probs = [Problem("q", "42", FILE_TASK, columns={"data_source": "mine"}), Problem("q", "7", "gsm8k")]
    assert scores("tests.reward_fns:compute_score", probs, [sample(" 42 "), sample("8")]) == [1.0, 0.0]
    assert scores("tests.reward_fns:async_compute_score", probs, [sample("so 42"), sample("7!")]) == [1.0, 1.0]


@pytest.mark.parametrize("function, says", [
    ("wrong_length", r"returned 1 scores for 2 completions"),
    ("returns_nan", r"returned nan \(float\) for sample 0 \(prompt 'q0'\): a score is a finite number"),
    ("returns_text", r"returned 'good' \(str\) for sample 0"),
    ("fails_on_x", r"raised ZeroDivisionError: float division by zero on sample 1 \(prompt 'q1'\)"),
])
def test_bad_returns_and_exceptions_name_the_function_and_sample(function, says):
    with pytest.raises(RewardFunctionError, match=r"reward.functions\[f\].*" + says):
        scores(f"tests.reward_fns:{function}", problems(2), [sample("a"), sample("x")])


def test_a_slow_function_times_out():
    with pytest.raises(RewardFunctionError, match=r"took longer than reward.timeout_s=0.5 s"):
        scores("tests.reward_fns:slow", problems(1), [sample("a")], timeout=0.5)


@pytest.mark.parametrize("disposition", ["ignored", "another handler"])
def test_a_slow_function_times_out_whatever_the_process_does_with_sigint(disposition):
    """The watchdog does not depend on SIGINT's disposition (a launcher or a library may have set
    it): with SIGINT ignored, or handled by a handler that does not raise, the call still stops at
    the timeout, and the disposition is as before afterwards."""
    import signal

    seen = []
    handler = signal.SIG_IGN if disposition == "ignored" else (lambda signum, frame: seen.append(signum))
    previous = signal.signal(signal.SIGINT, handler)
    try:
        with pytest.raises(RewardFunctionError, match=r"took longer than reward.timeout_s=0.5 s"):
            scores("tests.reward_fns:slow", problems(1), [sample("a")], timeout=0.5)
        assert signal.getsignal(signal.SIGINT) is handler and not seen
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_trl_function_may_take_any_of_trls_arguments_alone():
    """TRL passes prompts, completions and completion_ids by name: a function of ``completion_ids``
    alone is TRL's convention too (tests/test_generalises.py's grader)."""
    got = scores("tests.reward_fns:short_reply", problems(3), [sample("a", (7,)), sample("bb", (7, 2)),
                                                               sample("ccc", (7, 8, 2))])
    assert got == [1.0, 1.0, 0.0]


def test_loading_errors_are_one_clear_line():
    with pytest.raises(RewardFunctionError, match="module 'no_such_pkg.rewards' does not import"):
        check_function(RewardTerm("no_such_pkg.rewards:score"))
    with pytest.raises(RewardFunctionError, match="module 'tests.reward_fns' has no 'nope'"):
        check_function(RewardTerm("tests.reward_fns:nope"))
    with pytest.raises(RewardFunctionError, match=r"no_convention\(a, b\) fits neither convention: TRL's"):
        check_function(RewardTerm("tests.reward_fns:no_convention"))
    with pytest.raises(RewardFunctionError, match=r"kwargs has \['bias'\], which tests.reward_fns:scaled_length"):
        check_function(RewardTerm("s", function="tests.reward_fns:scaled_length", kwargs={"bias": 1}))
    with pytest.raises(ValueError, match=r"reward.functions\[regex\] needs kwargs.pattern"):
        check_grader_kwargs("regex", {})
    with pytest.raises(ValueError, match=r"numeric takes abs_tol, rel_tol"):
        check_grader_kwargs("numeric", {"tolerance": 1})


def test_math_verify_cases_by_hand():
    cases = [  # (reference, response, right?)
        ("42", "The answer is 42.", 1.0), ("42", "The answer is 41.", 0.0),
        ("\\frac{1}{2}", "So $x = \\boxed{0.5}$", 1.0), ("0.5", "\\boxed{\\frac{2}{4}}", 1.0),
        ("1234", "It costs 1,234 dollars: \\boxed{1234}", 1.0), ("\\{1,2\\}", "$\\boxed{\\{2, 1\\}}$", 1.0),
        ("3", "first 3 then \\boxed{4}", 0.0), ("\\sqrt{2}", "$\\boxed{\\sqrt{2}}$", 1.0),
    ]
    probs = [Problem("q", ref, FILE_TASK) for ref, _, _ in cases]
    assert math_verify(probs, [text for _, text, _ in cases]) == [want for _, _, want in cases]
    assert math_verify([Problem("q", "", FILE_TASK)], ["1"]) == [None]  # nothing to grade against


def test_exact_match_numeric_and_regex():
    probs = [Problem("q", "Paris", FILE_TASK), Problem("q", "1,000", FILE_TASK), Problem("q", "", FILE_TASK)]
    assert exact_match(probs, ["  Paris ", "1000", "x"]) == [1.0, 0.0, None]
    assert exact_match(probs[:1], ["paris"], ignore_case=True) == [1.0]
    assert numeric(probs[1:], ["about 1000.0", "7"]) == [1.0, None]
    assert numeric([Problem("q", "10", FILE_TASK)], ["10.04"], rel_tol=0.01) == [1.0]
    assert numeric([Problem("q", "10", FILE_TASK)], ["no number"]) == [0.0]
    assert regex(probs[:2], ["<think>a\nb</think> 4", "4"], pattern=r"<think>.*</think>") == [1.0, 0.0]
    assert regex(probs[:1], ["x 4"], pattern=r"\d", mode="fullmatch") == [0.0]


def test_code_tests_runs_the_problems_tests_in_the_sandbox():
    cols = {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n", "entry_point": "add"}
    probs = [Problem("q", "", FILE_TASK, columns=cols)] * 2 + [Problem("q", "", FILE_TASK)]
    got = scores("code_tests", probs, [sample("```python\ndef add(a, b):\n    return a + b\n```"),
                                        sample("```python\ndef add(a, b):\n    return a - b\n```"), sample("x")])
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2])


def test_none_scores_add_nothing_and_leave_whitening_statistics():
    nan = math.nan
    terms = [RewardTerm("a"), RewardTerm("b", weight=2.0)]
    total = combine_rewards({"a": torch.tensor([1.0, nan, 0.0]), "b": torch.tensor([nan, 1.0, 1.0])}, terms)
    assert total.tolist() == [1.0, 2.0, 2.0]  # TRL's nansum over functions
    w = whiten_scores(torch.tensor([1.0, nan, 3.0]))
    assert math.isnan(w[1]) and torch.allclose(w[[0, 2]], whiten_scores(torch.tensor([1.0, 3.0])))
