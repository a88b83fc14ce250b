"""Code answers graded while the engine still generates: the sandbox pool runs a program as soon as
its answer exists (``SandboxPool.prefetch``) and the grader takes that run (``map``); the program is
built in one place for both (``alignment.rewards.code_runs.program``); the engines' ``on_done``
reaches the right prompt on every rank of a model replica. The real engine's streaming is checked in
``tests/test_vllm_sync.py``; ``bench/code_overlap.py`` measures the overlap."""

from __future__ import annotations

import time

import pytest

from alignment.algorithms.composite_reward import RewardTerm
from alignment.data.code_tasks import CODE_LIMITS, check_program
from alignment.data.tasks import FILE_TASK, Problem, load_problems
from alignment.rewards import code_runs
from alignment.rewards.functions import function_scores
from alignment.rewards.text import text_scores
from alignment.data.samples import Sample, SamplingConfig, report_each
from alignment.sandbox.runner import SandboxLimits, SandboxPool
from alignment.trainers import rl_phases

FAST = SandboxLimits(wall_seconds=5.0, cpu_seconds=3, memory_mb=256)


def sample(text: str) -> Sample:
    return Sample([1], [2], [0.0], text, True)


def test_a_prefetched_run_is_taken_not_run_again():
    slow = "import time; time.sleep(1); print('slow')"
    with SandboxPool(workers=2, limits=FAST) as pool:
        pool.prefetch(slow)
        pool.prefetch(slow)  # started once
        time.sleep(1.5)  # it ran meanwhile
        t = time.perf_counter()
        [r] = pool.map([slow])
        assert r.stdout == "slow\n" and time.perf_counter() - t < 0.5 and (pool.taken, pool.asked) == (1, 1)
        t = time.perf_counter()  # taken: asked again, it runs again
        assert [r.stdout for r in pool.map([slow, "print(2)", slow])] == ["slow\n", "2\n", "slow\n"]
        assert time.perf_counter() - t > 0.9 and (pool.taken, pool.asked) == (1, 4)
        t = time.perf_counter()
        for code in ("import time; time.sleep(30)", "import time; time.sleep(31)", "print(3)"):
            pool.prefetch(code)  # never taken: two run, print(3) waits in the queue
    # closing waits only for the runs under way, which their 5 s wall clock ends (the queued one is cancelled)
    assert time.perf_counter() - t < 8


def test_one_program_for_the_grader_and_the_prefetch():
    [he] = load_problems("humaneval", "heldout", 1)
    text = he.entry["canonical_solution"]
    assert code_runs.program("correctness", he, text) == check_program(he.entry, text)
    gsm = Problem("1+1?", "2", "gsm8k")
    assert code_runs.program("correctness", gsm, "2") is None and code_runs.program("format", he, text) is None
    columns = {"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    row = Problem("Write f.", "", FILE_TASK, columns=columns)
    assert code_runs.program("code_tests", row, "    return 1\n") == check_program(columns, "    return 1\n")
    assert code_runs.program("code_tests", Problem("q", "a", FILE_TASK, columns={}), "x") is None  # no tests: n/a
    assert code_runs.program("code_tests", None, "x") is None


def test_runs_started_as_answers_finish_grade_as_the_grader_does():
    problems = load_problems("humaneval", "heldout", 3)
    answers = [[p.entry["canonical_solution"], "    return None\n"] for p in problems]
    samples = [sample(t) for g in answers for t in g]
    flat = [p for p in problems for _ in range(2)]
    plain = text_scores("correctness", flat, samples, 16).tolist()
    with code_runs.early_grading(["correctness", "format", "length"], problems) as (pool, on_done):
        report_each([[sample(t) for t in g] for g in answers], on_done)  # as an engine hands them out
        scored = function_scores(RewardTerm("correctness"), flat, samples, 16, pool=pool).tolist()
        assert pool.limits == CODE_LIMITS and (pool.taken, pool.asked) == (6, 6)  # every run was the early one
    assert scored == plain == [1.0, 0.0] * 3
    with code_runs.early_grading(["correctness", "length"], [Problem("1+1?", "2", "gsm8k")]) as none:
        assert none == (None, None)  # nothing runs code: no pool


def test_code_tests_take_the_early_runs_and_skip_rows_without_tests():
    columns = {"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"}
    rows = [Problem("Write f.", "", FILE_TASK, columns=columns), Problem("Other.", "", FILE_TASK, columns={})]
    with code_runs.early_grading(["code_tests"], rows) as (pool, on_done):
        on_done(0, [sample("    return 1\n"), sample("    return 2\n")])
        got = function_scores(RewardTerm("code_tests"), [rows[0], rows[0], rows[1]],
                              [sample("    return 1\n"), sample("    return 2\n"), sample("    return 1\n")], 16,
                              pool=pool)
        assert (pool.taken, pool.asked) == (2, 2)
    assert got[:2].tolist() == [1.0, 0.0] and got[2].isnan()  # the row without tests: the function does not apply


class _Dealt:
    """A model replica of 2 ranks seen from rank ``rank``: each generates every 2nd prompt."""

    def __init__(self, monkeypatch, rank: int, other_part: list):
        monkeypatch.setattr(rl_phases, "replica_group", lambda: "replica")
        monkeypatch.setattr(rl_phases.dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(rl_phases.dist, "get_rank", lambda group=None: rank)

        def all_gather_object(out, mine, group=None):
            out[rank], out[1 - rank] = mine, other_part
        monkeypatch.setattr(rl_phases.dist, "all_gather_object", all_gather_object)


class _Engine:
    generates_per_replica = False

    def generate(self, prompts, sampling, on_done=None):
        return report_each([[sample(f"answer to {p[0]}")] * sampling.n for p in prompts], on_done)


@pytest.mark.parametrize("rank", [0, 1])
def test_on_done_names_the_prompt_of_the_whole_list_on_each_rank_of_the_replica(monkeypatch, rank):
    prompts = [[10], [11], [12], [13], [14]]
    other = [[sample(f"answer to {p[0]}")] * 2 for p in prompts[1 - rank::2]]
    _Dealt(monkeypatch, rank, other)
    seen = []
    out = rl_phases.generate_for_group(_Engine(), prompts, SamplingConfig(n=2),
                                       lambda i, s: seen.append((i, s[0].text)))
    assert seen == [(i, f"answer to {prompts[i][0]}") for i in range(rank, 5, 2)]  # this rank's prompts only
    assert [g[0].text for g in out] == [f"answer to {p[0]}" for p in prompts]
