"""The rollout interface: what a trainer needs from an inference engine.

Modelled on NeMo-RL's ``GenerationInterface`` and verl's rollout worker: generate
``n`` samples per prompt with per-token logprobs, and take new weights in memory. The records it
takes and gives (:class:`alignment.data.samples.SamplingConfig`, :class:`alignment.data.samples.Sample`)
live in :mod:`alignment.data.samples`.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Protocol

import torch

from alignment.data.samples import OnDone, Sample, SamplingConfig


def step_seed(seed: int, step: int) -> int:
    """The seed of an engine's sampling stream at RL step ``step`` (:meth:`RolloutEngine.reseed`),
    for an engine seeded ``seed``: the first 63 bits of ``sha256("seed:step")``, so streams of
    different engines and steps do not overlap in any pattern."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") >> 1


class RolloutEngine(Protocol):
    """What trainers need from an inference engine. Implemented by
    :class:`alignment.rollout.engines.vllm_engine.VLLMEngine` (``rollout.backend=vllm``: its own copy of the
    weights in vLLM's layout, fed by the resharder) and
    :class:`alignment.rollout.engines.megatron_engine.MegatronEngine` (``rollout.backend=megatron``: the
    trainer's own model, nothing to sync); :func:`alignment.rollout.engines.factory.build_engine` picks one.
    """

    #: the HF tokenizer (decodes ``Sample.text``; the trainers build prompts with it)
    tokenizer: object
    #: True when the engine runs the trainer's parameters themselves: no weight sync, and the
    #: policy must stay on the device while it generates
    shares_trainer_weights: bool
    #: True when every rank of a model replica (TP x CP x PP) must generate the same prompts
    #: together (the engine runs the replica's own shards); False: each rank's engine takes its
    #: own share (:func:`alignment.trainers.rl_phases.generate_for_group`)
    generates_per_replica: bool

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """For each prompt (token ids), ``sampling.n`` samples, in prompt order; ``on_done(i, samples)``
        as soon as prompt ``i``'s are finished (:data:`OnDone`)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load new weights (HF names, full tensors) into the running engine, in memory."""

    def load_resharded(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> dict:
        """Load this rank's shards in the engine's layout (:class:`parallel.reshard.Resharder`'s
        buckets); returns ``{"load_s": seconds, "names": loaded HF names}``."""

    def reseed(self, step: int) -> None:
        """Sample from now on with a stream drawn from the engine's seed and ``step``
        (:func:`step_seed`), whatever was generated before; the RL loop calls it before each step's
        generation with that step, so a run resumed at ``step`` samples it as the uninterrupted run
        did (the trainer's random state is not touched)."""

    def sleep(self) -> None:
        """Free what generation alone needs (the KV cache) while the trainer works."""

    def wake(self) -> None:
        """Undo :meth:`sleep` before the next generation."""

    def close(self) -> None:
        """Release the engine (before the trainer's process groups are destroyed)."""
