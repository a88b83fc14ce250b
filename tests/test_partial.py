"""Partial rollouts generated chunk by chunk (``alignment/rollout/engines/partial.py``) in front of a scripted
engine: each row continues ``prompt + its tokens so far``, keeps every token's logprob and the weight updates
the engine had taken when it was sampled, and (R3) each position the routing of the chunk that first routed it."""

from __future__ import annotations

import torch

from alignment.data.samples import SamplingConfig
from alignment.rollout.engines.partial import PartialGeneration
from tests.scripted_engine import ScriptedEngine


def test_rows_grow_chunk_by_chunk_and_keep_each_chunks_updates_and_routing(smollm2_tokenizer):
    engine = ScriptedEngine(smollm2_tokenizer, lambda prompt, k: "abcdefg", routing=True)
    prompt = engine.char_ids("Say it.")
    gen = PartialGeneration([prompt], SamplingConfig(n=2, temperature=1.0, max_tokens=8), chunk_tokens=3)
    assert gen.step(engine, updates=0) == 6 and gen.step(engine, updates=1) == 6 and gen.step(engine, updates=1) == 4
    assert gen.live() == [] and gen.step(engine, updates=2) == 0 and gen.chunks == 3
    [[a, b]] = gen.samples(smollm2_tokenizer)
    letters = engine.char_ids("abcdefg")  # every call answers "abcdefg" + EOS, cut at the chunk's budget
    assert a.response_ids == letters[:3] * 2 + letters[:2] and not a.finished  # max_tokens reached, no EOS
    assert [p for p, _ in engine.calls] == [[prompt] * 2, [prompt + letters[:3]] * 2, [prompt + letters[:3] * 2] * 2]
    assert a.weight_updates == [0, 0, 0, 1, 1, 1, 1, 1] and a.logprobs == [-0.01, -0.02, -0.03] * 2 + [-0.01, -0.02]
    # each position keeps the routing of the chunk that first routed it: the prompt and the first chunk's
    # tokens but its last the first call's (0), then the second's (1) and third's (2); the last token unknown
    p = len(prompt)
    expected = torch.tensor([0] * (p + 2) + [1] * 3 + [2] * 2 + [-1], dtype=torch.int16)
    assert torch.equal(a.routed_experts[:, 0, 0], expected[: a.routed_experts.shape[0]])
    assert a.routed_experts.shape[0] == p + len(a.response_ids) and torch.equal(a.routed_experts, b.routed_experts)
