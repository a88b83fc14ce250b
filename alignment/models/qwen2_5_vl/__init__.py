"""The Qwen2.5-VL family (``Qwen2_5_VLForConditionalGeneration``): a ViT vision tower (3-D patch
embedding, 2-D RoPE, window attention in every block but ``fullatt_block_indexes``, SwiGLU MLPs
with bias, RMSNorm) whose 2x2-merged patches (the merger MLP) fill the ``<|image_pad|>``
placeholders of a Qwen2 language model (QKV bias) that runs multimodal RoPE (M-RoPE: the rotary
channels split over time, height and width positions, :mod:`alignment.models.qwen2_5_vl.positions`).

The language model's rows are Llama's (Qwen2: QKV bias), under the checkpoint names HF and vLLM
load (``model.layers.*``; transformers 5 renames them to ``model.language_model.*`` in memory and
back on save). The vision tower is transformers' own module (as Megatron-Bridge and ms-swift run
it), replicated on every tensor-parallel rank of the first pipeline stage; its rows map each HF
tensor ``visual.X`` to the Megatron parameter ``vision_model.X`` unchanged.

Source: transformers ``models/qwen2_5_vl/modeling_qwen2_5_vl.py``; Bai et al. 2025, "Qwen2.5-VL
Technical Report" (arXiv:2502.13923), section 2.1.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from alignment.models import llama
from alignment.models.dims import ModelDims
from alignment.models.mapping import Family, Mapping, Replicated, VllmSplit
from alignment.models.qwen2_5_vl.positions import mrope_position_ids
from alignment.models.vlm import VisionSpec, checked_mrope_section

ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's dimensions (HF ``vision_config`` names): ``depth`` blocks of width
    ``hidden_size`` (``num_heads`` heads, MLP ``intermediate_size``), ``patch_size`` x ``patch_size``
    pixel patches over ``temporal_patch_size`` frames of ``in_chans`` channels, merged
    ``spatial_merge_size`` x ``spatial_merge_size`` into one language-model token of width ``out_hidden_size``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_chans: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int

    @property
    def merged_size(self) -> int:
        """Width of one merged token before the merger MLP (``hidden_size * merge**2``)."""
        return self.hidden_size * self.spatial_merge_size ** 2


def _row(name: str, shape, **split) -> Mapping:
    """Megatron ``vision_model.X`` <-> HF ``visual.X`` <-> vLLM ``visual.Y`` (``Y``: ``X``, or the merged
    ``gate_up_proj`` a gate / up half feeds); ``split``: how vLLM splits it over its TP ranks
    (:class:`VllmSplit`'s fields), nothing for a tensor whole on every vLLM rank."""
    vllm = "visual." + (re.sub(r"\.(gate|up)_proj\.", ".gate_up_proj.", name) if split.get("half") is not None else name)
    if split:
        return VllmSplit("vision_model." + name, ("visual." + name,), vllm, shape=lambda d: shape, **split)
    return Replicated("vision_model." + name, ("visual." + name,), vllm, shape=lambda d: shape)


def vision_rows(d: ModelDims) -> tuple[Mapping, ...]:
    """One row per vision-tower tensor (Megatron ``vision_model.X`` <-> HF ``visual.X``), replicated on the
    Megatron side; vLLM splits the tower's linear layers as its ``Qwen2_5_VisionTransformer`` does (fused
    QKV, merged gate / up, row-parallel projections whose biases stay whole, the merger's column / row pair)."""
    v: VisionDims = d.vision
    h, f, m = v.hidden_size, v.intermediate_size, v.merged_size
    rows = [_row("patch_embed.proj.weight", (h, v.in_chans, v.temporal_patch_size, v.patch_size, v.patch_size))]
    for i in range(v.depth):
        b = f"blocks.{i}."
        rows += [_row(b + "norm1.weight", (h,)), _row(b + "norm2.weight", (h,)),
                 _row(b + "attn.qkv.weight", (3 * h, h), parts=3), _row(b + "attn.qkv.bias", (3 * h,), parts=3),
                 _row(b + "attn.proj.weight", (h, h), dim=1), _row(b + "attn.proj.bias", (h,))]
        for half, proj in enumerate(("gate_proj", "up_proj")):
            rows += [_row(f"{b}mlp.{proj}.weight", (f, h), half=half), _row(f"{b}mlp.{proj}.bias", (f,), half=half)]
        rows += [_row(b + "mlp.down_proj.weight", (h, f), dim=1), _row(b + "mlp.down_proj.bias", (h,))]
    rows += [_row("merger.ln_q.weight", (h,)), _row("merger.mlp.0.weight", (m, m), dim=0),
             _row("merger.mlp.0.bias", (m,), dim=0), _row("merger.mlp.2.weight", (v.out_hidden_size, m), dim=1),
             _row("merger.mlp.2.bias", (v.out_hidden_size,))]
    return tuple(rows)


def dims(cfg) -> ModelDims:
    """:class:`ModelDims` of an HF ``Qwen2_5_VLConfig``: the language model's (Qwen2: QKV bias) with
    the vision tower's :class:`VisionDims`, the image placeholder id and M-RoPE's section.
    Raises ValueError for sliding-window attention, a head size other than ``hidden_size / heads``, a
    vision output width other than the language model's, or an M-RoPE section that does not cover half
    the head dimension."""
    text, vc = cfg.get_text_config(), cfg.vision_config
    lm = llama.dims(text)
    if lm.head_dim * lm.num_attention_heads != lm.hidden_size:
        raise ValueError(f"{cfg.model_type}: text_config.head_dim={lm.head_dim} must be hidden_size / num_attention_heads "
                         f"= {lm.hidden_size // lm.num_attention_heads} (Qwen2.5-VL's attention has no other head size)")
    section = checked_mrope_section(cfg, lm, (16, 24, 24))
    vision = VisionDims(depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_heads=vc.num_heads, in_chans=vc.in_chans, patch_size=vc.patch_size,
                        temporal_patch_size=vc.temporal_patch_size, spatial_merge_size=vc.spatial_merge_size,
                        out_hidden_size=vc.out_hidden_size)
    return dataclasses.replace(lm, qkv_bias=True, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                               vision=vision, image_token_id=int(cfg.image_token_id), mrope_section=section)


def vision_tower(cfg):
    """transformers' Qwen2.5-VL vision tower for an HF ``Qwen2_5_VLConfig`` (uninitialised weights)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg.vision_config)


VISION = VisionSpec(tower=vision_tower, positions=mrope_position_ids)
FAMILY = Family("qwen2_5_vl", (ARCHITECTURE,), dims, llama.layer, extra=vision_rows, causal_lm=False, vision=VISION,
                vllm_language_model="language_model.")
