"""Partial rollouts (``rollout.partial=true``): a batch generated chunk by chunk, so that the engine can
take new weights between two chunks while the batch is still being generated.

Every row (one sample of a prompt) grows by at most ``chunk_tokens`` tokens per chunk: the engine
continues ``prompt + the row's tokens so far`` (a prefix of a sample is a prompt whose continuation is
the rest of the sample), with the weights it holds at that chunk. A row ends at its end-of-sequence
token or at ``max_tokens``. Each token keeps the logprob the engine gave it and the number of weight
updates the engine had taken since the batch began (``Sample.weight_updates``), so the trainer knows
which policy sampled which token: the rollout-correction weights ``pi_old / pi_rollout`` are per token
already (decoupled PPO, Hilton et al. 2021), and ``rollout/token_staleness`` counts updates per token.
This is the continuation scheme of slime's ``--partial-rollout`` and AReaL's interruptible generation,
at chunk granularity (vLLM's offline ``LLM`` has no mid-request weight swap). With routing replay R3 each
position keeps the experts of the chunk that first routed it (the one that sampled the token after it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from alignment.data.samples import Sample, SamplingConfig
from alignment.rollout.engines.routed_experts import earliest_routes


@dataclass
class PartialRow:
    """One sample being generated: ``ids`` / ``logprobs`` / ``updates`` per response token so far."""

    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    updates: list[int] = field(default_factory=list)
    finished: bool = False
    routed: torch.Tensor | None = None  # [positions, layers, k] (R3): each position's first chunk's routing


class PartialGeneration:
    """``sampling.n`` rows for each of ``prompts``, generated ``chunk_tokens`` at a time by :meth:`step`.

    Raises:
        ValueError: ``chunk_tokens < 1``.
    """

    def __init__(self, prompts: list[list[int]], sampling: SamplingConfig, chunk_tokens: int):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens={chunk_tokens}: must be >= 1")
        self.sampling, self.chunk_tokens, self.n = sampling, chunk_tokens, sampling.n
        self.rows = [PartialRow(list(p)) for p in prompts for _ in range(sampling.n)]
        self.chunks = 0

    def live(self) -> list[int]:
        """Indices of the rows still growing (no end-of-sequence token, fewer than ``max_tokens``)."""
        return [i for i, r in enumerate(self.rows) if not r.finished and len(r.ids) < self.sampling.max_tokens]

    def step(self, engine, updates: int) -> int:
        """One chunk for every live row by ``engine`` (a :class:`alignment.rollout.base.RolloutEngine`),
        whose weights have taken ``updates`` updates since the batch began; returns the tokens added."""
        live = self.live()
        if not live:
            return 0
        budget = min(self.chunk_tokens, *(self.sampling.max_tokens - len(self.rows[i].ids) for i in live))
        chunk = replace(self.sampling, n=1, max_tokens=budget)
        out = engine.generate([self.rows[i].prompt + self.rows[i].ids for i in live], chunk)
        added = 0
        for i, [s] in zip(live, out):
            row = self.rows[i]
            row.ids += s.response_ids
            row.logprobs += s.logprobs
            row.updates += [updates] * len(s.response_ids)
            row.finished = s.finished
            row.routed = earliest_routes(row.routed, s.routed_experts)
            added += len(s.response_ids)
        self.chunks += 1
        return added

    def samples(self, tokenizer) -> list[list[Sample]]:
        """The rows as ``[prompts][n]`` samples (``finished``: ended by end-of-sequence), text decoded
        with ``tokenizer``; ``weight_updates`` None for a row that no update interrupted."""
        out = []
        for k in range(0, len(self.rows), self.n):
            group = []
            for r in self.rows[k:k + self.n]:
                text = tokenizer.decode(r.ids, skip_special_tokens=True) if tokenizer is not None else ""
                group.append(Sample(r.prompt, list(r.ids), list(r.logprobs), text, r.finished,
                                    weight_updates=list(r.updates) if any(r.updates) else None,
                                    routed_experts=r.routed))
            out.append(group)
        return out
