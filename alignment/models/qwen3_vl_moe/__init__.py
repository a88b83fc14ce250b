"""The Qwen3-VL-MoE family (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B, Qwen3-VL-235B-A22B):
Qwen3-VL's vision tower, DeepStack and interleaved M-RoPE (:mod:`alignment.models.qwen3_vl`) over a
Qwen3-MoE language model (:mod:`alignment.models.qwen3_moe`: a top-k router over SwiGLU experts, no
shared expert; its router always renormalises the top-k weights).

Its checkpoints store each layer's experts fused (``model.language_model.layers.{i}.mlp.experts.gate_up_proj``
``[experts, H, 2F]``, ``...down_proj`` ``[experts, F, H]``: :class:`alignment.models.fused_experts.FusedExperts`),
where Qwen3-MoE's store them per expert; the table's rows are Qwen3-MoE's, per expert, and the bridge reads and
writes the fused form. Megatron holds each expert-parallel rank's experts as ``local_experts.{j}``; vLLM's
fused MoE stacks them as for Qwen3-MoE, under ``language_model.``.

Source: transformers ``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py`` (``Qwen3VLMoeTextExperts``,
``Qwen3VLMoeTextTopKRouter``); vLLM ``models/qwen3_vl_moe.py`` (``is_fused_checkpoint_transposed=True``).
"""

from __future__ import annotations

from alignment.models import qwen3_moe, qwen3_vl
from alignment.models.dims import ModelDims
from alignment.models.fused_experts import FusedExperts
from alignment.models.mapping import Family
from alignment.models.vlm import VisionSpec

ARCHITECTURE = "Qwen3VLMoeForConditionalGeneration"


def dims(cfg) -> ModelDims:
    """:class:`ModelDims` of an HF ``Qwen3VLMoeConfig``: Qwen3-VL's (:func:`alignment.models.qwen3_vl.dims`) with
    the Qwen3-MoE language model's experts. Raises ValueError as those two do."""
    return qwen3_vl.dims(cfg, language_model=qwen3_moe.dims)


def vision_tower(cfg):
    """transformers' Qwen3-VL-MoE vision tower (Qwen3-VL's) for an HF ``Qwen3VLMoeConfig`` (uninitialised weights)."""
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeVisionModel

    return Qwen3VLMoeVisionModel._from_config(cfg.vision_config)


# vllm 0.32's Qwen3-MoE layers read text_config.norm_topk_prob, which transformers 5.19's Qwen3-VL-MoE config no
# longer has (its router always renormalises)
VLLM_HF_OVERRIDES = {"text_config": {"norm_topk_prob": True}}
VISION = VisionSpec(tower=vision_tower, positions=qwen3_vl.VISION.positions, rotary=qwen3_vl.VISION.rotary)
FAMILY = Family("qwen3_vl_moe", (ARCHITECTURE,), dims, qwen3_moe.layer, extra=qwen3_vl.vision_rows, causal_lm=False,
                vision=VISION, hf_language_model="model.language_model.", vllm_language_model="language_model.",
                fused_experts=FusedExperts(), vllm_hf_overrides=VLLM_HF_OVERRIDES)
