"""What Megatron-Core's static inference engine feeds a vision-language model at each forward
(:class:`alignment.rollout.engines.megatron_engine.MegatronEngine`).

Megatron-Core's static KV cache stores keys before the rotary embedding and rotates every cached key
again at each step with the first ``context_end`` rows of the position table, so each forward gets
the M-RoPE positions of the whole context so far (``[3, rows, context_end]``), not only of its
window. A row's prompt has the family's positions (its images' patches on a 2-D grid,
:attr:`alignment.models.vlm.VisionSpec.positions`); the tokens after it count on from one past the
prompt's largest position in all three sections (transformers' ``rope_deltas``).

The vision tower runs once per distinct prompt of the batch, before the first forward; each window
then gets the features of the placeholders it holds (``image_mask``, ``image_features``, DeepStack's
included: :meth:`alignment.models.vlm_model.VisionLanguageModel.image_features`): the whole
prefill takes those of the shortest prompt, and a longer prompt's later placeholders come with the
decode steps that feed its remaining prompt tokens. Tokens the model samples are text, whatever they
are (transformers' ``generate`` feeds images at the prompt only).
"""

from __future__ import annotations

import torch

from alignment.rollout.engines.image_prompts import images_of

__all__ = ["GenerationImages"]


class GenerationImages:
    """Positions and image features of one batch of ``rows`` (prompts, each a ``list[int]`` or an
    :class:`alignment.rollout.engines.image_prompts.ImagePrompt`; rows of one prompt may be the same object,
    whose images are then encoded once) generated up to ``max_tokens`` tokens past the longest, by the
    vision-language model ``model`` (:class:`alignment.models.vlm_model.VisionLanguageModel`, first
    pipeline stage).

    Raises:
        ValueError: a prompt whose placeholders and images differ (as the family's positions).
    """

    def __init__(self, model, rows: list[list[int]], max_tokens: int):
        device = next(model.parameters()).device
        longest = max(map(len, rows))
        self.device = device
        self.positions = torch.empty(3, len(rows), longest + max_tokens, dtype=torch.long)
        self.index = torch.full((len(rows), longest), -1, dtype=torch.long)  # -> row of self.features
        features, seen, offset = [], {}, 0
        for i, row in enumerate(rows):
            if id(row) not in seen:
                images = images_of(row)
                grid = None if images is None else images.image_grid_thw
                prompt = model.spec.positions(torch.tensor([list(row)]), None, grid, model.dims)[:, 0]  # [3, L]
                first = None
                if images is not None:
                    with torch.no_grad():
                        features.append(model.image_features(images.pixel_values.to(device), grid.to(device)))
                    first, offset = offset, offset + features[-1].shape[0]
                seen[id(row)] = (prompt, first)
            prompt, first = seen[id(row)]
            n = len(row)
            self.positions[:, i, :n] = prompt
            self.positions[:, i, n:] = prompt.max() + 1 + torch.arange(self.positions.shape[2] - n)
            if first is not None:
                spots = torch.tensor([j for j, t in enumerate(row) if t == model.dims.image_token_id])
                self.index[i, spots] = first + torch.arange(len(spots))
        self.features = torch.cat(features) if features else None

    def window(self, start: int, end: int) -> dict:
        """The model's keyword inputs for the context window ``[start, end)``: ``position_ids``
        ``[3, rows, end]`` (from position 0, see the module docstring) and, when the window holds
        prompt placeholders, ``image_mask`` ``[rows, end - start]`` and their ``image_features``."""
        out = {"position_ids": self.positions[:, :, :end].to(self.device)}
        index = self.index[:, start:end]
        mask = index >= 0
        if bool(mask.any()):
            if index.shape[1] < end - start:  # past every prompt: sampled tokens show no image
                mask = torch.nn.functional.pad(mask, (0, end - start - index.shape[1]))
            out.update(image_mask=mask.to(self.device), image_features=self.features[index[index >= 0]])
        return out
