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
from alignment.data.samples import Sample
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


def test_pairwise_rendering_and_verdicts():
    from alignment.rewards.judge import PAIR_TEMPLATE, parse_preference

    text = render(PAIR_TEMPLATE, Problem("Say hi.", "", FILE_TASK), "hi", "hello")
    assert "Question: Say hi.\nReference answer: \n[Answer A]\nhi\n[Answer B]\nhello\nReply [[A]]" in text
    assert [parse_preference(r, {}) for r in ("[[A]]", "I pick [[b]].", "[[C]]", "[[B]] not [[A]]")] == \
        [1.0, 0.0, 0.5, 0.0]  # the first mark counts
    # what small judges write instead (SmolLM2-135M: "...is:\n[A]", "A is better."): a line of the letter alone
    bare = ("The better one is:\n[A]", "A is better.", "Answer B", "B", "A good answer.", "a.", "Both are fine.")
    assert [parse_preference(r, {}) for r in bare] == [1.0, 1.0, 0.0, 0.0, None, None, None]
    assert parse_preference("Better: 2", {"pair_verdicts": {"1": 1.0, "2": 0.0}}) == 0.0


def test_a_pairwise_judge_scores_each_response_by_the_comparisons_it_wins():
    """Groups of 3 and 2 (two prompts): every pair judged in both orders. Shorter wins, so in the first
    group "a" (1 char) beats "bbb" and "cc": 1.0; "cc" beats "bbb": 0.5; "bbb": 0.0; the second group
    ties: 0.5 each. A judge that always answers [[A]] (position bias) gives 0.5 to everyone in both orders."""
    from tests.reward_server import shorter_wins

    probs = [Problem("q0", "", FILE_TASK)] * 3 + [Problem("q1", "", FILE_TASK)] * 2
    smp = [Sample([1], [1], [0.0], t, True) for t in ("a", "bbb", "cc")] + \
          [Sample([2], [1], [0.0], t, True) for t in ("xy", "zw")]
    with ScriptedJudge(shorter_wins) as judge:
        t = RewardTerm("pj", function="judge", kwargs={"url": judge.url, "mode": "pairwise"})
        check_function(t)
        assert function_scores(t, probs, smp, 16).tolist() == [1.0, 0.0, 0.5, 0.5, 0.5]
        assert len(judge.requests) == 2 * (3 + 1)  # (3 choose 2) + (2 choose 2) pairs, both orders
    with ScriptedJudge(lambda m: "[[A]]") as judge:
        both = RewardTerm("pj", function="judge", kwargs={"url": judge.url, "mode": "pairwise"})
        assert function_scores(both, probs, smp, 16).tolist() == [0.5] * 5
        once = RewardTerm("pj", function="judge", kwargs={"url": judge.url, "mode": "pairwise", "swap": False})
        assert function_scores(once, probs, smp, 16).tolist() == [1.0, 0.5, 0.0, 1.0, 0.0]
    alone = [Sample([3], [1], [0.0], "a", True)]
    with ScriptedJudge(shorter_wins) as judge:  # one response: nothing to compare with
        lone = RewardTerm("pj", function="judge", kwargs={"url": judge.url, "mode": "pairwise"})
        assert math.isnan(function_scores(lone, probs[:1], alone, 16).item()) and not judge.requests


def test_judge_compare_and_evaluate_win_rates():
    """tools/evaluate.py --judge: each checkpoint's preference answers against the baseline's."""
    from alignment.rewards.judge import compare
    from tests.reward_server import shorter_wins
    from tools.evaluate import compare as evaluate_compare
    from tools.evaluate import judge_pairs

    probs = [Problem(f"q{i}", "", FILE_TASK) for i in range(3)]
    with ScriptedJudge(shorter_wins) as judge:
        assert compare({"url": judge.url}, probs, ["a", "bb", "cc"], ["aa", "b", "cc"]) == [1.0, 0.0, 0.5]

        def items(texts):
            return {"preference": {"items": [{"prompt": [{"role": "user", "content": f"q{i}"}], "text": t}
                                             for i, t in enumerate(texts)], "metrics": {}}}

        full = {"base": items(["aa", "bb", "c", "dd"]), "new": items(["a", "b", "cc", "dd"])}
        preferred = judge_pairs({"url": judge.url, "mode": "pairwise"}, full, "base")
    assert preferred == {"new": [1.0, 1.0, 0.0, 0.5]}
    wins = evaluate_compare(full, "base", None, preferred)["win_rates"]["new"]["judge (preference)"]
    assert (wins["wins"], wins["ties"], wins["losses"]) == (2, 1, 1) and wins["win_rate"] == 2.5 / 4


@pytest.mark.parametrize("settings, says", [
    ({"url": "http://h/v1", "mode": "pairwise", "template": "{completion_a} vs ?"}, r"template has no \{completion_b\}"),
    ({"url": "http://h/v1", "mode": "pairwise", "template": "{completion}"}, r"template has no \{completion_a\}, "),
    ({"url": "http://h/v1", "mode": "ranked"}, "mode='ranked': valid values are pointwise, pairwise"),
    ({}, "give the judge's url .* or model: an HF model directory"),
    ({"model": "/no/such/dir"}, r"\(/no/such/dir has no config.json\)"),
    ({"url": "http://h/v1", "pair_verdicts": {}}, r"pair_verdicts=\{\}: map words to scores"),
])
def test_more_judge_settings_errors(settings, says):
    with pytest.raises(RewardFunctionError, match=says):
        check_function(RewardTerm("j", function="judge", kwargs=settings))


@pytest.mark.slow
def test_a_judge_model_run_in_the_job_replies_as_transformers_generates(tmp_path):
    """A judge given as an HF directory runs in vLLM in the process (a subprocess here, as in a job): its
    replies are the greedy continuations transformers generates from the same chat-templated prompts."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    out = tmp_path / "replies.json"
    subprocess.run([sys.executable, str(ROOT / "tests/dist/judge_worker.py"), str(tmp_path / "judge"), str(out)],
                   check=True, cwd=ROOT, timeout=600)
    got = json.loads(out.read_text())
    assert got["vllm"] == got["transformers"] and len(got["vllm"]) == 3 and all(got["vllm"]), got
    # the job's parse of its own replies: the hand-set score of the one verdict word each reply holds
    assert got["scores"] == got["expected_scores"] == [0.25, 0.5, 1.0], got
    assert got["default_verdicts"] == [None] * 3, got  # a random model says neither "correct" nor "incorrect"
