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


def grow_rows(engine, rows: list[PartialRow], sampling: SamplingConfig, chunk_tokens: int, version: int) -> int:
    """One chunk of at most ``chunk_tokens`` tokens (and what is left of ``sampling.max_tokens``) for each of
    ``rows`` by ``engine``, which continues each row's prompt + its tokens so far; each new token tagged with
    ``version`` (``PartialRow.updates``), each position keeping the routing of the call that first routed it.
    Returns the tokens added (0 for no rows)."""
    if not rows:
        return 0
    budget = min(chunk_tokens, *(sampling.max_tokens - len(r.ids) for r in rows))
    out = engine.generate([r.prompt + r.ids for r in rows], replace(sampling, n=1, max_tokens=budget))
    added = 0
    for row, [s] in zip(rows, out):
        row.ids += s.response_ids
        row.logprobs += s.logprobs
        row.updates += [version] * len(s.response_ids)
        row.finished = s.finished
        row.routed = earliest_routes(row.routed, s.routed_experts)
        added += len(s.response_ids)
    return added


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
        added = grow_rows(engine, [self.rows[i] for i in self.live()], self.sampling, self.chunk_tokens, updates)
        self.chunks += bool(added)
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
