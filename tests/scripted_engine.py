"""A rollout engine that answers from a script (tests of episodes and of the agent server's sessions)."""

from __future__ import annotations

import torch

from alignment.data.samples import Sample, SamplingConfig, report_each
from tests.conftest import SMOLLM2_EOS as EOS


class ScriptedEngine:
    """Answers each prompt with ``script(prompt text, k-th call)``: the reply's tokens are its
    characters one token each where possible (never what the tokenizer would make of the text, so
    any re-tokenisation shows), then EOS unless the reply ends with a stop string. Logprobs:
    -0.01 * (position + 1) of each token in its reply, so every token's value is known."""

    def __init__(self, tokenizer, script, routing: bool = False):
        self.tokenizer, self.script, self.calls, self.routing = tokenizer, script, [], routing

    def char_ids(self, text: str) -> list[int]:
        out = []
        for ch in text:
            ids = self.tokenizer.encode(ch, add_special_tokens=False)
            out += ids
        return out

    def generate(self, prompts, sampling: SamplingConfig, on_done=None):
        self.calls.append((list(map(list, prompts)), sampling))
        result = []
        for p in prompts:
            samples = []
            for k in range(sampling.n):
                text = self.script(self.tokenizer.decode(p), k)
                ids = self.char_ids(text)
                stopped = any(text.endswith(s) for s in sampling.stop or [])
                ids = ids if stopped else ids + [EOS]
                finished = len(ids) <= sampling.max_tokens
                ids = ids[: sampling.max_tokens]
                lps = [-0.01 * (i + 1) for i in range(len(ids))]
                routed = None
                if self.routing:  # a MoE engine's routing (2 layers, top-1): the call's number, -1 on the last token
                    routed = torch.full((len(p) + len(ids), 2, 1), len(self.calls) - 1, dtype=torch.int16)
                    routed[-1] = -1
                samples.append(Sample(list(p), ids, lps, self.tokenizer.decode(ids, skip_special_tokens=True), finished,
                                      routed_experts=routed))
            result.append(samples)
        return report_each(result, on_done)
