"""What :func:`alignment.models.vlm_from_text.vision_language_from_text` needs to make a Qwen3-VL-MoE from
a Qwen3-MoE text model (the same language model: QK-norm, top-k routed experts, no shared expert)."""

from __future__ import annotations

from transformers import AutoConfig, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

from alignment.models.qwen3_vl import from_text as qwen3_vl

MODEL = Qwen3VLMoeForConditionalGeneration
SMALL_VISION = qwen3_vl.SMALL_VISION  # Qwen3-VL's tower
language_model_name = qwen3_vl.language_model_name  # the checkpoint's names: model.language_model.*
MOE_FIELDS = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers",
              "router_aux_loss_coef")


def vlm_config(text: dict, rope_theta: float, vision: dict, tokens: dict, text_dir) -> Qwen3VLMoeConfig:
    """The Qwen3-VL-MoE config of language model ``text`` (HF text-config fields) with the experts of the
    Qwen3-MoE in ``text_dir``, ``vision`` and the vision ``tokens``. Raises ValueError for a text model whose
    router does not renormalise its top-k weights (``norm_topk_prob=false``: Qwen3-VL-MoE's always does) or a
    head size :func:`alignment.models.qwen3_vl.from_text.mrope_section` cannot split."""
    moe = AutoConfig.from_pretrained(text_dir)
    if not getattr(moe, "norm_topk_prob", True):
        raise ValueError(f"{text_dir}: norm_topk_prob=false; Qwen3-VL-MoE's router always renormalises its top-k "
                         "weights, so its logits would differ from the text model's")
    rope = {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": qwen3_vl.mrope_section(text["head_dim"]),
            "mrope_interleaved": True}
    fields = {k: getattr(moe, k) for k in MOE_FIELDS}
    return Qwen3VLMoeConfig(text_config={**text, **fields, "rope_parameters": rope}, vision_config=vision,
                            architectures=["Qwen3VLMoeForConditionalGeneration"], **tokens)
