"""Partial rollouts carried across steps (``alignment/rollout/carryover.py``) with a scripted engine whose answers
have a long tail: a step takes the groups that finished, in admission order, the others keep generating under the
next version, each token keeps the version that sampled it, rows too stale restart from the prompt, and what is in
flight is what a checkpoint keeps."""

from __future__ import annotations

import re

import pytest
import torch

from alignment.data.samples import SamplingConfig
from alignment.rollout.carryover import CarryOverPool
from alignment.trainers.rl_phases import token_staleness
from tests.conftest import SMOLLM2_EOS as EOS
from tests.scripted_engine import ScriptedEngine


def continuing(prompt: str, k: int) -> str:
    """The answer to "Say N x." is N x's: a continuation writes the ones still missing (one token each)."""
    target = int(re.search(r"Say (\d+) x\.", prompt).group(1))
    have = len(prompt) - len(prompt.rstrip("x"))
    return "x" * (target - have)


@pytest.fixture
def engine(smollm2_tokenizer):
    return ScriptedEngine(smollm2_tokenizer, continuing, routing=True)


def prompt(engine, n: int) -> list[int]:
    return engine.char_ids(f"Say {n} x.")


def test_a_step_takes_the_finished_groups_and_the_long_tail_goes_on_under_the_next_version(engine, smollm2_tokenizer,
                                                                                            monkeypatch):
    x = engine.char_ids("x")[0]
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=20), chunk_tokens=3, max_staleness=2)
    for index, n in enumerate([2, 9, 4]):  # answers of 2, 9 and 4 tokens (+ EOS)
        pool.admit(index, prompt(engine, n))
    # version 0: two groups must finish: "2" after one chunk (3 tokens: xx EOS), "4" after two (xxx, x EOS)
    assert pool.generate(engine, version=0, needed=2) == 2 and pool.ready() == [0, 2]
    taken, base = pool.take(2, smollm2_tokenizer)
    assert [i for i, _ in taken] == [0, 2] and base == 0
    (_, [a, _]), (_, [c, _]) = taken
    assert a.response_ids == [x, x, EOS] and c.response_ids == [x] * 4 + [EOS] and c.finished
    assert c.weight_updates == [0] * 5
    # the long answer keeps its 6 tokens of version 0 and goes on under version 1, with a new prompt beside it
    assert pool.in_flight() == [1] and len(pool.groups[0].rows[0].ids) == 6
    pool.admit(3, prompt(engine, 1))
    assert pool.generate(engine, version=1, needed=2) == 2 and pool.ready() == [1, 3]
    taken, base = pool.take(2, smollm2_tokenizer)
    (_, [b, _]), (_, [d, _]) = taken
    assert base == 0 and b.response_ids == [x] * 9 + [EOS]
    assert b.weight_updates == [0] * 6 + [1] * 4 and d.weight_updates == [1, 1]
    # each token's staleness when version 1 trains this batch (version base = 0): 1 for the old tokens, 0 after
    monkeypatch.setattr("alignment.trainers.rl_phases.all_reduce_sum", lambda xs: xs)
    monkeypatch.setattr("alignment.trainers.rl_phases.all_reduce_max", lambda xs: xs)
    stale = token_staleness([b, d], staleness=1 - base, count=True)
    assert stale == {"rollout/token_staleness": 6 / 12, "rollout/token_staleness_max": 1.0}
    # R3: every position keeps the routing of the chunk (the engine call) that first routed it
    # the four engine calls: 0 routed the prompt and the first 2 tokens, 1 the next 3, 2 the next 3 (version 1), 3 the
    # next 1; the last token (EOS) never fed back
    p = len(b.prompt_ids)
    expected = torch.tensor([0] * (p + 2) + [1] * 3 + [2] * 3 + [3] * 1 + [-1], dtype=torch.int16)
    assert torch.equal(b.routed_experts[:, 0, 0], expected) and torch.equal(b.routed_experts[:, 1, 0], expected)
    assert pool.in_flight() == [] and pool.pop_counts() == {"rollout/restarted_rows": 0.0,
                                                            "rollout/in_flight_groups": 0.0}


def test_rows_too_stale_for_the_policy_about_to_train_start_again(engine, smollm2_tokenizer):
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=20), chunk_tokens=2, max_staleness=1)
    pool.admit(7, prompt(engine, 12))
    pool.admit(8, prompt(engine, 1))
    assert pool.generate(engine, version=0, needed=1) == 1 and pool.take(1, smollm2_tokenizer)[0][0][0] == 8
    pool.admit(9, prompt(engine, 1))
    pool.generate(engine, version=1, needed=1)  # group 7's rows: 2 tokens of version 0, then 2 of version 1
    assert [r.updates for r in pool.groups[0].rows] == [[0, 0, 1, 1]] * 2
    pool.take(1, smollm2_tokenizer)
    # version 3 would train tokens of version 0 and 1: more than max_staleness=1 behind: both rows restart
    pool.admit(10, prompt(engine, 1))
    assert pool.restart_stale(3) == 2 and [r.ids for r in pool.groups[0].rows] == [[], []]
    assert pool.pop_counts() == {"rollout/restarted_rows": 2.0, "rollout/in_flight_groups": 2.0}
    pool.generate(engine, version=3, needed=2)
    [(i, [s, _]), _], base = pool.take(2, smollm2_tokenizer)
    assert i == 7 and base == 3 and s.weight_updates == [0] * 13 and len(s.response_ids) == 13


def test_what_is_refused(engine, smollm2_tokenizer):
    pool = CarryOverPool(SamplingConfig(n=2, temperature=1.0, max_tokens=8), chunk_tokens=4, max_staleness=1)
    pool.admit(0, prompt(engine, 2))
    with pytest.raises(ValueError, match="prompt 0 is in flight already"):
        pool.admit(0, prompt(engine, 2))
    with pytest.raises(ValueError, match="1 groups are in flight, 2 are needed: admit more prompts"):
        pool.generate(engine, version=0, needed=2)
    with pytest.raises(ValueError, match="0 groups are ready, 1 were asked for"):
        pool.take(1, smollm2_tokenizer)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        CarryOverPool(SamplingConfig(n=2), chunk_tokens=0, max_staleness=1)
