"""An LLM as judge behind an OpenAI-compatible endpoint (alignment/rewards/judge.py): the prompt it
is sent, the score read from its reply (numbers and verdicts), the settings' errors, the start-up
probe, and an endpoint that fails (a scripted local server spoken to by the real ``openai`` client)."""

from __future__ import annotations

import math

import pytest

from alignment.algorithms.composite_reward import RewardTerm
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rewards import remote
from alignment.rewards.functions import RewardFunctionError, check_function, function_scores
from alignment.rewards.judge import parse_score, probe_judge, render
from alignment.rollout.base import Sample
from tests.reward_server import ScriptedJudge

TEMPLATE = "Q: {prompt}\nGold: {reference}\nA: {completion}\nScore 0-10:"


def sample(text: str) -> Sample:
    return Sample([0], [1], [0.0], text, True)


def test_render_fills_the_fields_and_leaves_other_braces():
    p = Problem("What is 2+2?", "4", FILE_TASK)
    assert render(TEMPLATE, p, "four") == "Q: What is 2+2?\nGold: 4\nA: four\nScore 0-10:"
    assert render("{completion} as JSON {\"score\": n}", p, "x") == "x as JSON {\"score\": n}"


@pytest.mark.parametrize("reply, settings, want", [
    ("Score: 7", {"parse": "number"}, 0.7),
    ("I'd say 3/10... final: 12", {"parse": "number"}, 1.0),  # the last number, clipped to the range
    ("4", {"parse": "number", "score_range": [1, 5]}, 0.75),
    ("no idea", {"parse": "number"}, None),
    ("Correct.", {}, 1.0), ("This is INCORRECT", {}, 0.0), ("incorrect, not correct", {}, 0.0),
    ("Verdict: yes", {"verdicts": {"no": 0.0, "yes": 1.0}}, 1.0), ("maybe", {}, None),
])
def test_parse_score(reply, settings, want):
    got = parse_score(reply, settings)
    assert got == pytest.approx(want) if want is not None else got is None


def test_the_judge_scores_through_the_openai_client():
    def reply(message: str) -> str:
        gold, answer = message.split("Gold: ")[1].split("\n")[0], message.split("A: ")[1].split("\n")[0]
        return "10" if gold in answer else ("garbled" if "?" in answer else "2")

    probs = [Problem(f"q{i}", str(i), FILE_TASK) for i in range(3)]
    with ScriptedJudge(reply) as judge:
        t = RewardTerm("j", function="judge", kwargs={"url": judge.url, "template": TEMPLATE, "parse": "number"})
        probe_judge(t.kwargs)
        smp = [sample("it is 0"), sample("it is 5"), sample("who knows?")]
        got = function_scores(t, probs, smp, 16).tolist()
    assert got[:2] == [1.0, pytest.approx(0.2)] and math.isnan(got[2]) and smp[2].info["judge_unparsed"]
    assert {r["model"] for r in judge.requests} == {"judge-1"} and all(r["temperature"] == 0.0 for r in judge.requests)
    assert sorted(r["messages"][0]["content"] for r in judge.requests)[0] == "Q: q0\nGold: 0\nA: it is 0\nScore 0-10:"


def test_a_failing_judge_marks_the_samples_and_stops_or_skips():
    remote.take_failures()
    with ScriptedJudge(lambda m: "", fail=True) as judge:
        for on_error, recorded in (("stop", 1), ("skip", 0)):
            t = RewardTerm("j", function="judge", kwargs={"url": judge.url, "max_retries": 0, "on_error": on_error})
            smp = [sample("a"), sample("b")]
            got = function_scores(t, [Problem("q", "1", FILE_TASK)] * 2, smp, 16).tolist()
            failures = remote.take_failures()
            assert all(math.isnan(x) for x in got) and all(s.info["reward_failed"] == "j" for s in smp)
            assert len(failures) == recorded and all(f"judge {judge.url} failed after 1 tries: InternalServerError"
                                                     in f for f in failures)
    with ScriptedJudge(lambda m: "") as judge, pytest.raises(ValueError, match=r"serves \['judge-1'\], not model='big'"):
        probe_judge({"url": judge.url, "model": "big"})


@pytest.mark.parametrize("settings, says", [
    ({"url": "http://h/v1", "template": "Rate {prompt}"}, r"template has no \{completion\}"),
    ({"url": "http://h/v1", "template": "{completion} {answer}"}, r"template names \['answer'\]"),
    ({"url": "h:8000"}, "give the judge's OpenAI-compatible endpoint"),
    ({"url": "http://h/v1", "parse": "json"}, "parse='json': valid values are number, verdict"),
    ({"url": "http://h/v1", "parse": "number", "score_range": [5, 1]}, r"score_range=\[5, 1\]"),
    ({"url": "http://h/v1", "temperature": 1}, r"has \['temperature'\]"),
])
def test_judge_settings_errors(settings, says):
    with pytest.raises(RewardFunctionError, match=says):
        check_function(RewardTerm("j", function="judge", kwargs=settings))
