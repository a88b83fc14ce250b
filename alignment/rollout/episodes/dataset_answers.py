"""A dataset's answers in place of sampled ones (``algorithm.distill_samples=dataset``: off-policy
knowledge distillation on a dataset, as TRL's ``GKDTrainer`` at ``lmbda=0`` trains on the dataset's
completions): :class:`DatasetAnswers` answers each prompt with its record's text, tokenised as a
sampler that stops at the end of the turn would have produced it, so the samples go through the
same batch, packing and losses as generated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from alignment.data.samples import OnDone, Sample, SamplingConfig, report_each
from alignment.rollout.engines.image_prompts import images_of
from alignment.rollout.episodes.turn_tokens import TurnTokens

__all__ = ["DatasetAnswers", "answer_ids"]


def answer_ids(turns: TurnTokens, text: str, max_tokens: int) -> tuple[list[int], bool]:
    """The token ids of the assistant turn ``text`` as the chat template closes it (``turns.closing``,
    e.g. ``<|im_end|>\\n`` for ChatML), cut after the first end-of-turn id (``turns.eos``: where an
    engine stops), then to ``max_tokens``.

    Returns:
        ``(ids, finished)``: ``finished`` when the turn's end-of-turn id is kept (not cut by ``max_tokens``).
    Raises:
        ValueError: ``text`` is empty or ``max_tokens`` < 1.
    """
    if not text:
        raise ValueError("an empty answer: the dataset's response column must hold text for every prompt")
    if max_tokens < 1:
        raise ValueError(f"rollout.max_tokens={max_tokens}: must be >= 1")
    ids = [int(i) for i in turns.tokenizer.encode(text + turns.closing, add_special_tokens=False)]
    end = next((k for k, i in enumerate(ids) if i in turns.eos), None)
    if end is not None:
        ids = ids[: end + 1]
    ids = ids[:max_tokens]
    return ids, bool(ids) and ids[-1] in turns.eos


class DatasetAnswers:
    """The ``generate`` of a rollout engine that answers the ``i``-th prompt of a call with
    ``answers[i]`` (:func:`answer_ids`; ``sampling.n`` copies, ``logprobs`` 0: no engine sampled
    them). Local to each rank: every rank of a model replica builds the same samples.

    Args:
        turns: the chat template's tokens (``Models.episodes.turns``).
        answers: one text per prompt of the next call, in prompt order.
    """

    def __init__(self, turns: TurnTokens, answers: Sequence[str]):
        self.turns, self.answers = turns, list(answers)

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, on_done: OnDone | None = None
                 ) -> list[list[Sample]]:
        """``[len(prompts)][sampling.n]`` samples (copies); ``on_done`` as the engines'.

        Raises:
            ValueError: ``prompts`` and the answers differ in number.
        """
        if len(prompts) != len(self.answers):
            raise ValueError(f"{len(prompts)} prompts but {len(self.answers)} dataset answers")
        out = []
        for prompt, text in zip(prompts, self.answers):
            ids, finished = answer_ids(self.turns, text, sampling.max_tokens)
            shown = self.turns.tokenizer.decode(ids, skip_special_tokens=True)
            sample = Sample(list(prompt), ids, [0.0] * len(ids), shown, finished, images=images_of(prompt))
            out.append([sample] + [replace(sample) for _ in range(sampling.n - 1)])
        return report_each(out, on_done)
