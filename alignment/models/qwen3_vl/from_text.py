"""What :func:`alignment.models.vlm_from_text.vision_language_from_text` needs to make a Qwen3-VL from
a Qwen3 text model (the same language model: QK-norm, no QKV bias)."""

from __future__ import annotations

from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

MODEL = Qwen3VLForConditionalGeneration

# a small tower (Qwen3-VL's layout: 16-pixel patches over 2 frames, 2x2 merge, a learned 32x32 position
# table, DeepStack from three blocks)
SMALL_VISION = dict(depth=4, hidden_size=128, intermediate_size=256, num_heads=4, in_channels=3, patch_size=16,
                    spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=1024,
                    deepstack_visual_indexes=[0, 1, 2])


def mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's split of the rotary channels (24/20/20 of 64) for another head size.
    Raises ValueError when ``head_dim`` is not a multiple of 32."""
    if head_dim % 32:
        raise ValueError(f"head_dim={head_dim}: Qwen3-VL's (time, height, width) split needs a multiple of 32")
    return [3 * head_dim // 16, 5 * head_dim // 32, 5 * head_dim // 32]


def vlm_config(text: dict, rope_theta: float, vision: dict, tokens: dict, text_dir) -> Qwen3VLConfig:
    """The Qwen3-VL config of language model ``text`` (HF text-config fields), ``vision`` and the vision
    ``tokens`` (ids, ``tie_word_embeddings``). Raises ValueError for a head size :func:`mrope_section` cannot split."""
    rope = {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": mrope_section(text["head_dim"]),
            "mrope_interleaved": True}
    return Qwen3VLConfig(text_config={**text, "rope_parameters": rope}, vision_config=vision,
                         architectures=["Qwen3VLForConditionalGeneration"], **tokens)


def language_model_name(name: str) -> str:
    """The checkpoint name of the text model's tensor ``name`` (``model.X`` -> ``model.language_model.X``)."""
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name
