"""What :func:`alignment.models.vlm_from_text.vision_language_from_text` needs to make a Qwen2.5-VL from
a Llama-family text model (Llama, Qwen2, SmolLM2)."""

from __future__ import annotations

from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

MODEL = Qwen2_5_VLForConditionalGeneration

# a small tower (Qwen2.5-VL's layout: 14-pixel patches over 2 frames, 2x2 merge, window attention but
# in the last block)
SMALL_VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_chans=3, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[3])


def mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary channels (16/24/24 of 64) for another head size.
    Raises ValueError when ``head_dim`` is not a multiple of 16."""
    if head_dim % 16:
        raise ValueError(f"head_dim={head_dim}: M-RoPE's (time, height, width) split needs a multiple of 16")
    return [head_dim // 8, 3 * head_dim // 16, 3 * head_dim // 16]


def vlm_config(text: dict, rope_theta: float, vision: dict, tokens: dict, text_dir) -> Qwen2_5_VLConfig:
    """The Qwen2.5-VL config of language model ``text`` (HF text-config fields), ``vision`` and the
    vision ``tokens`` (ids, ``tie_word_embeddings``).
    Raises ValueError when the head size is not ``hidden_size / heads`` (Qwen2.5-VL's attention)."""
    if text["head_dim"] * text["num_attention_heads"] != text["hidden_size"]:
        raise ValueError(f"{text_dir}: head_dim={text['head_dim']} x {text['num_attention_heads']} heads != "
                         f"hidden_size={text['hidden_size']}; Qwen2.5-VL's attention needs head_dim = hidden_size / heads")
    rope = {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": mrope_section(text["head_dim"])}
    return Qwen2_5_VLConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                            architectures=["Qwen2_5_VLForConditionalGeneration"], **tokens)


def language_model_name(name: str) -> str:
    """The checkpoint name of the text model's tensor ``name`` (the same: ``model.layers.*``)."""
    return name
