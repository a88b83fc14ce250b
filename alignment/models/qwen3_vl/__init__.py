"""The Qwen3-VL family (``Qwen3VLForConditionalGeneration``, dense): a ViT vision tower (3-D patch
embedding with bias, learned position embeddings interpolated to each image's grid, 2-D RoPE, full
attention, LayerNorm and GELU MLPs) whose 2x2-merged patches (the merger) fill the ``<|image_pad|>``
placeholders of a Qwen3 language model (QK-norm, no QKV bias) that runs interleaved M-RoPE
(:mod:`alignment.models.qwen3_vl.rope`); DeepStack: the patches after blocks
``deepstack_visual_indexes`` of the tower, each merged by its own merger, are added to the hidden
states of the first ``len(deepstack_visual_indexes)`` decoder layers at the image positions.

Images take Qwen2-VL's M-RoPE positions (:mod:`alignment.models.qwen2_5_vl.positions`; Qwen3-VL's
timestamps concern video only). The language model's rows are Qwen3's; its checkpoint tensors are
``model.language_model.*`` (:attr:`alignment.models.mapping.Family.hf_language_model`), the tower's
``model.visual.*`` (Megatron ``vision_model.*``, transformers' own module, replicated on every
tensor-parallel rank of the first pipeline stage).

Source: transformers ``models/qwen3_vl/modeling_qwen3_vl.py``; Bai et al. 2025, "Qwen3-VL Technical
Report" (arXiv:2511.21631), section 2; Meng et al. 2024, "DeepStack" (arXiv:2406.04334).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from alignment.models import qwen3
from alignment.models.dims import ModelDims
from alignment.models.mapping import Family, Mapping, Replicated, VllmSplit
from alignment.models.qwen2_5_vl.positions import mrope_position_ids
from alignment.models.vlm import VisionSpec, checked_mrope_section

ARCHITECTURE = "Qwen3VLForConditionalGeneration"
PREFIX = "model.visual."


@dataclass(frozen=True)
class VisionDims:
    """The vision tower's dimensions (HF ``vision_config`` names): ``depth`` blocks of width
    ``hidden_size`` (``num_heads`` heads, MLP ``intermediate_size``) over ``patch_size`` x ``patch_size``
    pixel patches of ``temporal_patch_size`` frames of ``in_channels`` channels, a learned position table of
    ``num_position_embeddings`` entries, ``spatial_merge_size`` x ``spatial_merge_size`` patches merged into
    one token of width ``out_hidden_size``, and a DeepStack merger after each block of
    ``deepstack_visual_indexes``."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]

    @property
    def merged_size(self) -> int:
        """Width of one merged token before a merger's MLP (``hidden_size * merge**2``)."""
        return self.hidden_size * self.spatial_merge_size ** 2


def _row(name: str, shape, **split) -> Mapping:
    """Megatron ``vision_model.X`` <-> HF ``model.visual.X`` <-> vLLM ``visual.X``; ``split``: how vLLM
    splits it over its TP ranks (:class:`VllmSplit`'s fields), nothing for a tensor whole on every rank."""
    if split:
        return VllmSplit("vision_model." + name, (PREFIX + name,), "visual." + name, shape=lambda d: shape, **split)
    return Replicated("vision_model." + name, (PREFIX + name,), "visual." + name, shape=lambda d: shape)


def _linear(name: str, out: int, inp: int, dim: int) -> list[Mapping]:
    """A linear layer vLLM splits as a column- (``dim=0``) or row-parallel one (``dim=1``, bias whole)."""
    return [_row(name + ".weight", (out, inp), dim=dim), _row(name + ".bias", (out,), **({"dim": 0} if dim == 0 else {}))]


def _merger(name: str, v: VisionDims, norm: int) -> list[Mapping]:
    m = v.merged_size
    return ([_row(name + ".norm.weight", (norm,)), _row(name + ".norm.bias", (norm,))]
            + _linear(name + ".linear_fc1", m, m, 0) + _linear(name + ".linear_fc2", v.out_hidden_size, m, 1))


def vision_rows(d: ModelDims) -> tuple[Mapping, ...]:
    """One row per vision-tower tensor (Megatron ``vision_model.X`` <-> HF ``model.visual.X``), replicated on
    the Megatron side; vLLM splits the linear layers as its ``Qwen3_VisionTransformer`` does (fused QKV,
    column / row pairs whose row biases stay whole)."""
    v: VisionDims = d.vision
    h, f = v.hidden_size, v.intermediate_size
    rows = [_row("patch_embed.proj.weight", (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)),
            _row("patch_embed.proj.bias", (h,)), _row("pos_embed.weight", (v.num_position_embeddings, h))]
    for i in range(v.depth):
        b = f"blocks.{i}."
        rows += [_row(b + "norm1.weight", (h,)), _row(b + "norm1.bias", (h,)), _row(b + "norm2.weight", (h,)),
                 _row(b + "norm2.bias", (h,))]
        rows += [_row(b + "attn.qkv.weight", (3 * h, h), parts=3), _row(b + "attn.qkv.bias", (3 * h,), parts=3)]
        rows += _linear(b + "attn.proj", h, h, 1)
        rows += _linear(b + "mlp.linear_fc1", f, h, 0) + _linear(b + "mlp.linear_fc2", h, f, 1)
    rows += _merger("merger", v, h)
    for j in range(len(v.deepstack_visual_indexes)):
        rows += _merger(f"deepstack_merger_list.{j}", v, v.merged_size)  # its norm after the 2x2 shuffle
    return tuple(rows)


def dims(cfg, language_model=qwen3.dims) -> ModelDims:
    """:class:`ModelDims` of an HF ``Qwen3VLConfig``: the language model's (``language_model(text_config)``;
    Qwen3: QK-norm) with the vision tower's :class:`VisionDims`, the image placeholder id, M-RoPE's section
    and DeepStack's layers. Raises ValueError for a vision output width other than the language model's, an
    M-RoPE section that does not cover half the head dimension, or more DeepStack features than decoder
    layers."""
    text, vc = cfg.get_text_config(), cfg.vision_config
    lm = language_model(text)
    section = checked_mrope_section(cfg, lm, (24, 20, 20))
    deep = tuple(int(i) for i in vc.deepstack_visual_indexes)
    if len(deep) > lm.num_layers or any(not 0 <= i < vc.depth for i in deep):
        raise ValueError(f"{cfg.model_type}: vision_config.deepstack_visual_indexes={list(deep)} must name at most "
                         f"{lm.num_layers} (the decoder's layers) of the tower's {vc.depth} blocks")
    vision = VisionDims(depth=vc.depth, hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_heads=vc.num_heads, in_channels=vc.in_channels, patch_size=vc.patch_size,
                        temporal_patch_size=vc.temporal_patch_size, spatial_merge_size=vc.spatial_merge_size,
                        out_hidden_size=vc.out_hidden_size, num_position_embeddings=vc.num_position_embeddings,
                        deepstack_visual_indexes=deep)
    return dataclasses.replace(lm, tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
                               vision=vision, image_token_id=int(cfg.image_token_id), mrope_section=section,
                               deepstack_layers=len(deep))


def vision_tower(cfg):
    """transformers' Qwen3-VL vision tower for an HF ``Qwen3VLConfig`` (uninitialised weights)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    return Qwen3VLVisionModel._from_config(cfg.vision_config)


def rotary(kv_channels: int, rotary_base: float):
    """The language model's interleaved M-RoPE (:func:`alignment.models.qwen3_vl.rope.interleaved_mrope`),
    imported when a model is built: it subclasses Megatron's rotary, and importing Megatron costs ~2 s that
    ``megalign train``'s config checks do not need."""
    from alignment.models.qwen3_vl.rope import interleaved_mrope

    return interleaved_mrope(kv_channels, rotary_base)


VISION = VisionSpec(tower=vision_tower, positions=mrope_position_ids, rotary=rotary)
FAMILY = Family("qwen3_vl", (ARCHITECTURE,), dims, qwen3.layer, extra=vision_rows, causal_lm=False, vision=VISION,
                hf_language_model="model.language_model.", vllm_language_model="language_model.")
