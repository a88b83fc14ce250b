"""Qwen3-VL's interleaved multimodal RoPE: the rotary channels take the time, height and width
positions in turn (channel ``c`` of ``head_dim / 2``: height when ``c % 3 == 1`` and
``c < 3 * mrope_section[1]``, width when ``c % 3 == 2`` and ``c < 3 * mrope_section[2]``, time
otherwise), where Qwen2-VL's M-RoPE gives each a contiguous section (Megatron's
``MultimodalRotaryEmbedding``). Text tokens have the same position in all three, so on text both
are plain RoPE.

Source: transformers ``Qwen3VLTextRotaryEmbedding.recomposition_frequencies``; vLLM
``MRotaryEmbedding`` with ``mrope_interleaved``; Bai et al. 2025, "Qwen3-VL Technical Report"
(arXiv:2511.21631), section 2 (interleaved MRoPE).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding


class InterleavedMultimodalRotaryEmbedding(MultimodalRotaryEmbedding):
    """Megatron's ``MultimodalRotaryEmbedding`` with Qwen3-VL's interleaved channel assignment. It never
    takes a context-parallel share: each CP rank's positions are already its own tokens' or, packed, the whole
    stream's (:func:`alignment.models.vlm.multimodal_inputs`)."""

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group=None) -> torch.Tensor:
        """Rotary angles ``[s, b, 1, head_dim]`` (radians; the two halves equal, Megatron's
        non-interleaved layout) of positions ``position_ids`` ``[3, b, s]`` (time, height, width);
        ``mrope_section`` sums to ``head_dim / 2`` (:func:`alignment.models.qwen3_vl.dims` checks it)."""
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # [3, b, s, half]
        out = freqs[0].clone()
        for axis in (1, 2):
            take = slice(axis, 3 * mrope_section[axis], 3)
            out[..., take] = freqs[axis][..., take]
        emb = torch.cat((out, out), dim=-1)  # [b, s, head_dim]
        return emb[..., None, :].transpose(0, 1).contiguous()


def interleaved_mrope(kv_channels: int, rotary_base: float) -> InterleavedMultimodalRotaryEmbedding:
    """The language model's rotary embedding (:attr:`alignment.models.vlm.VisionSpec.rotary`) for heads of
    ``kv_channels`` channels and RoPE base ``rotary_base`` (HF ``rope_theta``): ``forward(position_ids [3, b, s],
    mrope_section)`` -> angles ``[s, b, 1, kv_channels]`` in radians (see the module docstring for the source)."""
    return InterleavedMultimodalRotaryEmbedding(kv_channels=kv_channels, rotary_percent=1.0, rotary_base=rotary_base)
