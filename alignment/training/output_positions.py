"""The output layer on the positions a loss reads, not on every token.

A GRPO/PPO/DPO/SFT loss reads per-token log-probabilities only where its mask is 1 (the
response), yet ``GPTModel`` computes vocabulary logits for every position. For SmolLM2-135M the
output layer is a fifth of the model's FLOPs (576 x 49152 of 135M parameters), and the logits'
fp32 softmax passes over ``[tokens, V]`` cost as much again; with prompts longer than
responses most of both is thrown away. :class:`OutputPositions` selects the hidden states of
the masked positions before the output layer (a forward pre-hook on ``output_layer``, as
Megatron's own inference path selects the last token's hidden state in
``GPTModel._postprocess``), so the logits are ``[1, n, V / tp]`` for the ``n`` selected
positions, and puts the per-token results back in place (0 elsewhere).

Not used with sequence parallelism (the output layer's input is then split over the sequence
and gathered inside the layer).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class OutputPositions:
    """The selected positions of one micro-batch as this rank's model shard sees it.

    ``index``: ``[n]`` int64, flat positions in the ``[s_local, b]`` (sequence-major) order of
    Megatron's hidden states; ``shape``: ``(b, s_local)``.
    """

    index: torch.Tensor
    shape: tuple[int, int]

    @classmethod
    def from_mask(cls, local_mask: torch.Tensor) -> "OutputPositions":
        """Positions where ``local_mask`` ``[b, s_local]`` (this rank's tokens, any dtype) is
        non-zero; at least one position (the first) so that every layer still runs."""
        flat = local_mask.transpose(0, 1).reshape(-1) != 0
        index = flat.nonzero().squeeze(1)
        if index.numel() == 0:
            index = torch.zeros(1, dtype=torch.long, device=local_mask.device)
        return cls(index, tuple(local_mask.shape))

    def take(self, per_token: torch.Tensor) -> torch.Tensor:
        """``[b, s_local]`` -> ``[1, n]``: the selected entries, in the order of the logits."""
        return per_token.transpose(0, 1).reshape(-1)[self.index].unsqueeze(0)

    def put(self, selected: torch.Tensor) -> torch.Tensor:
        """``[1, n, ...]`` -> ``[b, s_local, ...]`` with zeros at the positions not selected;
        differentiable with respect to ``selected``."""
        b, s = self.shape
        rest = tuple(selected.shape[2:])
        flat = selected.new_zeros((s * b, *rest)).index_put((self.index,), selected.reshape(-1, *rest))
        return flat.view(s, b, *rest).transpose(0, 1)

    def select_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[s_local, b, h]`` -> ``[n, 1, h]`` (the output layer's input)."""
        return hidden.reshape(-1, hidden.shape[-1])[self.index].unsqueeze(1)


def _output_layer(model: torch.nn.Module):
    """``output_layer`` of the ``GPTModel`` inside ``model``'s wrappers (DDP, Float16Module),
    or None (a pipeline stage before the last, or no such layer)."""
    while model is not None:
        layer = getattr(model, "output_layer", None)
        if layer is not None:
            return layer
        model = getattr(model, "module", None)
    return None


@contextmanager
def output_on(model: torch.nn.Module, positions: OutputPositions | None):
    """Within the block, ``model``'s output layer runs on ``positions`` only (its output is
    ``[1, n, ...]`` after ``GPTModel``'s transpose). ``positions=None`` or no output layer on
    this stage: nothing changes."""
    layer = _output_layer(model) if positions is not None else None
    if layer is None:
        yield
        return

    def pre_hook(_module, args, kwargs):
        return (positions.select_hidden(args[0]), *args[1:]), kwargs

    handle = layer.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()
