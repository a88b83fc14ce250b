"""Disaggregated rollout (``rollout.placement=disaggregated``): the last ``rollout.rollout_ranks``
processes of a job only generate, with vLLM engines of ``rollout.tensor_parallel_size``
consecutive rollout ranks each; the others only train. Both sides speak over the stateless
group that joins them (:func:`parallel.state.trainer_rollout_group`, trainers first), in steps
the trainers lead: trainer rank 0 broadcasts a command, then every rank of the group takes part
in it.

- ``generate``: every trainer contributes its prompts (an all-gather); the prompts, in trainer
  rank order, are dealt round-robin over the engines; each engine's first rank contributes its
  samples (a second all-gather) and every trainer takes back its own, in its prompt order. The
  trainers may post a request and collect its samples later (:meth:`RemoteEngine.prefetch`):
  the engines then generate while the trainers train (``rollout.max_staleness >= 1``). The first
  request after :meth:`RemoteEngine.reseed` carries its step, and every engine reseeds with it
  before generating.
- ``sync``: the resharder moves the trainers' shards into the engines' layout
  (:class:`parallel.reshard.Resharder` with ``group``), bucket by bucket, straight into the
  running engines.
- ``stop``: the rollout ranks close their engines and exit.

The trainers see an ordinary :class:`alignment.rollout.base.RolloutEngine`
(:class:`RemoteEngine`); the rollout ranks run :func:`serve` until told to stop
(:func:`launchers.common.serve_as_rollout_rank` builds what it needs). This is the
layout of verl's and NeMo-RL's non-colocated generation and of slime's rollout engines.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from alignment.rollout.base import OnDone, Sample, SamplingConfig, report_each

GENERATE, SYNC, STOP = "generate", "sync", "stop"


def deal(prompt_lists: list[list[list[int]]], engines: int) -> list[list[tuple[int, int, list[int]]]]:
    """Every trainer's prompts (``prompt_lists[rank]``) dealt round-robin over ``engines`` engines:
    engine ``e`` gets ``[(trainer rank, index in its list, prompt ids)]``."""
    items = [(r, k, p) for r, prompts in enumerate(prompt_lists) for k, p in enumerate(prompts)]
    return [items[e::engines] for e in range(engines)]


class RemoteEngine:
    """A trainer's :class:`alignment.rollout.base.RolloutEngine` of a disaggregated job: generation
    and weights go to the rollout ranks over ``group`` (see the module docstring).

    Every trainer calls every method at the same point (each is collective over the group).
    ``tokenizer``: the policy's HF tokenizer; ``trainers``: the number of trainer ranks (the
    group's first ranks).
    """

    shares_trainer_weights = False
    generates_per_replica = False

    def __init__(self, group, tokenizer, trainers: int):
        self.group, self.tokenizer, self.trainers = group, tokenizer, trainers
        self.posted = None  # (prompts, sampling) the engines are working on
        self.reseeded = None  # the step of a reseed not yet sent: it goes with the next request

    def prefetch(self, prompts: list[list[int]], sampling: SamplingConfig) -> None:
        """Send the request and return at once: the engines generate while the trainers go on, and
        the next :meth:`generate` with the same arguments receives the samples. Nothing else may
        go to the rollout ranks in between (they wait to hand the samples over).

        Raises:
            RuntimeError: a request is already posted.
        """
        if self.posted is not None:
            raise RuntimeError("RemoteEngine.prefetch: a request is already posted; generate() receives it first")
        self.group.broadcast_object((GENERATE, sampling, self.reseeded), 0)
        self.group.all_gather_object(prompts)
        self.posted, self.reseeded = (prompts, sampling), None

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """``sampling.n`` samples for each of this trainer's prompts, from the rollout ranks (the
        posted request's, when it is this one); ``on_done`` for each prompt once they all arrived.

        Raises:
            RuntimeError: a different request was posted (the trainers' schedule is broken).
        """
        if self.posted is None:
            self.prefetch(prompts, sampling)
        posted, self.posted = self.posted, None
        if posted != (prompts, sampling):
            raise RuntimeError("RemoteEngine.generate: asked for other prompts or sampling than the posted request")
        out: list = [None] * len(prompts)
        for part in self.group.all_gather_object(None)[self.trainers:]:
            for rank, k, samples in part or ():
                if rank == self.group.rank:
                    out[k] = samples
        return report_each(out, on_done)

    def reseed(self, step: int) -> None:
        """Every engine reseeds with ``step`` (its own seed's stream,
        :meth:`alignment.rollout.vllm_engine.VLLMEngine.reseed`) before the next request it gets
        (sent with it: a posted request may be running now)."""
        self.reseeded = step

    def load_resharded(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict:
        """Send this trainer's shards to the engines (the buckets of a trainer hold no tensors of
        its own: it only sends). Returns ``{"load_s": seconds, "names": []}``."""
        t0 = time.perf_counter()
        self.group.broadcast_object((SYNC,), 0)
        for _ in buckets:
            pass
        return {"load_s": time.perf_counter() - t0, "names": []}

    def update_weights(self, named_tensors) -> None:
        """Not offered: a disaggregated job's engines take new weights from the resharder only."""
        raise NotImplementedError("rollout.placement=disaggregated: weights reach the engines through the "
                                  "resharder (load_resharded), not as full tensors")

    def sleep(self) -> None:
        """Nothing to free: the engines keep their KV cache on their own ranks."""

    def wake(self) -> None:
        """Nothing to restore (see :meth:`sleep`)."""

    def close(self) -> None:
        """Stop the rollout ranks (they close their engines and exit)."""
        self.group.broadcast_object((STOP,), 0)


def serve(engine, resharder, group, trainers: int, engine_tp: int) -> None:
    """A rollout rank's loop: run the trainers' commands (see the module docstring) on this rank's
    ``engine`` (a :class:`alignment.rollout.vllm_engine.VLLMEngine`, one per ``engine_tp``
    consecutive rollout ranks) until ``stop``. ``resharder``: the receiving side of the trainers'
    :class:`parallel.reshard.Resharder` (``model=None``)."""
    me = group.rank - trainers
    engines = (group.size - trainers) // engine_tp
    while True:
        command, *args = group.broadcast_object(None, 0)
        if command == GENERATE:
            sampling, step = args
            if step is not None:
                engine.reseed(step)
            share = deal(group.all_gather_object(None)[:trainers], engines)[me // engine_tp]
            samples = engine.generate([p for _, _, p in share], sampling)  # collective over the engine's ranks
            first = me % engine_tp == 0
            group.all_gather_object([(r, k, s) for (r, k, _), s in zip(share, samples)] if first else None)
        elif command == SYNC:
            engine.load_resharded(resharder.buckets())
        elif command == STOP:
            return
        else:
            raise RuntimeError(f"rollout rank {group.rank}: unknown command {command!r} from the trainers")

