"""Reward servers over HTTP (alignment/rewards/remote.py) against a real local server that answers,
answers slowly, fails with 500s or a 404, sends garbage or the wrong count, or never answers."""

from __future__ import annotations

import math
import socket
from types import SimpleNamespace

import pytest

from alignment.algorithms.composite_reward import RewardTerm
from alignment.data.tasks import FILE_TASK, Problem
from alignment.rewards import remote
from alignment.rewards.functions import RewardFunctionError, check_function, function_scores
from alignment.data.samples import Sample
from alignment.trainers.rewarding import drop_failed_groups
from tests.reward_server import RewardServer


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(remote, "BACKOFF_S", 0.01)
    remote.take_failures()


def samples(*texts) -> list[Sample]:
    return [Sample([0], [1] * len(t), [0.0] * len(t), t, True) for t in texts]


def term(url: str, **settings) -> RewardTerm:
    return RewardTerm("judge", function="http", kwargs={"url": url, **settings})


def score(t: RewardTerm, smp) -> list[float]:
    probs = [Problem(f"q{i}", "7", FILE_TASK, columns={"answer": "7", "id": i}) for i in range(len(smp))]
    return function_scores(t, probs, smp, 16).tolist()


def test_scores_come_back_in_batches_with_prompts_completions_and_columns():
    with RewardServer(["ok"]) as server:
        got = score(term(server.url, batch_size=2), samples("ab", "abc", "", "abcd", "x"))
    assert got[:2] == [1.0, 0.0] and math.isnan(got[2]) and got[3:] == [1.0, 0.0]
    assert sorted(len(r["completions"]) for r in server.requests) == [1, 2, 2]
    first = next(r for r in server.requests if r["completions"][0] == "ab")
    assert first["prompts"] == ["q0", "q1"] and first["columns"] == {"answer": ["7", "7"], "id": [0, 1]}
    assert first["completion_ids"] == [[1, 1], [1, 1, 1]]


@pytest.mark.parametrize("script", [["500", "ok"], ["garbage", "ok"], ["short", "500", "ok"], ["slow", "ok"]])
def test_failed_requests_are_retried(script):
    with RewardServer(script, delay=2.0) as server:
        assert score(term(server.url, timeout_s=0.5, max_retries=3), samples("ab", "abc")) == [1.0, 0.0]
    assert len(server.requests) == len(script)


@pytest.mark.parametrize("script, says, tries", [
    (["500"], "failed after 3 tries: HTTP 500", 3),
    (["garbage"], "failed after 3 tries: an answer that is not JSON", 3),
    (["short"], "failed after 3 tries: answered 1 scores for 2 completions", 3),
    (["hang"], "failed after 3 tries: no answer within 0.3 s", 3),
    (["404"], "failed after 1 try: HTTP 404", 1),  # the request itself is wrong: not retried
])
def test_after_the_retries_a_batch_never_scores_zero(script, says, tries):
    with RewardServer(script) as server:
        smp = samples("ab", "abc")
        got = score(term(server.url, timeout_s=0.3, max_retries=2), smp)  # on_error: stop (the default)
        assert all(math.isnan(x) for x in got) and all(s.info["reward_failed"] == "judge" for s in smp)
        [failure] = remote.take_failures()
        assert failure.startswith(f"reward.functions[judge]: reward server {server.url} ") and says in failure
        assert len(server.requests) == tries
        smp = samples("ab", "abc")
        score(term(server.url, timeout_s=0.3, max_retries=0, on_error="skip"), smp)
        assert remote.take_failures() == [] and all(s.info["reward_failed"] == "judge" for s in smp)


def test_failed_groups_leave_the_update():
    smp = samples("a", "bb", "c", "dd", "e", "ff")
    smp[3].info["reward_failed"] = "judge"
    assert drop_failed_groups(smp, 2) == 1
    assert [s.loss_mask for s in smp] == [None, None, [0], [0, 0], None, None]
    assert [bool(s.info.get("reward_skipped")) for s in smp] == [False, False, True, True, False, False]


def test_probe_and_settings():
    with RewardServer(["ok"]) as server:
        remote.probe(server.url, 1.0)
        assert server.requests[0]["completions"] == []
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(remote.RewardServerError, match=f"reward server http://127.0.0.1:{port}/x failed after 1 try: "
                                                        "ConnectionRefusedError"):
        remote.probe(f"http://127.0.0.1:{port}/x", 1.0)
    for settings, says in [({"url": "localhost:8000"}, "give the reward server's http"),
                           ({"url": "http://h", "on_error": "zero"}, "on_error='zero': valid values are stop, skip"),
                           ({"url": "http://h", "batch_size": 0}, "batch_size=0 must be >= 1"),
                           ({"url": "http://h", "retries": 2}, "has \\['retries'\\]")]:
        with pytest.raises(RewardFunctionError, match=says):
            check_function(RewardTerm("judge", function="http", kwargs=settings))


def test_a_server_behind_a_key_gets_its_headers(monkeypatch):
    """``api_key_env`` sends ``Authorization: Bearer <key>`` and ``headers`` any headers, on the start-up probe
    and every batch; without the key the server's 401 is not retried; an unset variable is refused at start."""
    from launchers.input_checks import check_reward_servers

    monkeypatch.setenv("MY_REWARD_KEY", "s3cret")
    with RewardServer(["ok"], key="s3cret") as server:
        t = term(server.url, api_key_env="MY_REWARD_KEY", headers={"X-Team": "rl"}, batch_size=2)
        check_function(t)
        remote.probe(server.url, 5.0, remote.request_headers(t.kwargs))
        assert score(t, samples("ab", "abc", "abcd")) == [1.0, 0.0, 1.0]
        assert len(server.headers) == 3 and all(h["Authorization"] == "Bearer s3cret" and h["X-Team"] == "rl"
                                                for h in server.headers)
        with pytest.raises(remote.RewardServerError, match="failed after 1 try: HTTP 401"):
            remote.probe(server.url, 5.0)
        cfg = SimpleNamespace(algorithm=SimpleNamespace(name="grpo"), reward=SimpleNamespace(functions=[]))
        monkeypatch.setattr("launchers.input_checks.reward_terms", lambda c: [t])
        check_reward_servers(cfg)  # the start-up probe carries the key
    monkeypatch.delenv("MY_REWARD_KEY")
    with pytest.raises(RewardFunctionError, match=r"kwargs.api_key_env=MY_REWARD_KEY: that environment variable is "
                                                  "not set"):
        check_function(t)
    with pytest.raises(RewardFunctionError, match=r"kwargs.headers=\['x'\]: give a mapping of header names"):
        check_function(term("http://localhost:1/s", headers=["x"]))
