"""A tiny random Llama used by the tests: GQA (4 heads, 2 KV heads), non-square
attention (4 x 24 = 96 != hidden 64), 4 layers (so PP=2 works), vocabulary 250
(not a multiple of 128: exercises Megatron's vocabulary padding)."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(tie_word_embeddings: bool = False, vocab_size: int = 250) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        attention_bias=False, mlp_bias=False, torch_dtype="float32",
    )


def tiny_llama(seed: int = 0, **kwargs) -> LlamaForCausalLM:
    """Same weights on every rank for the same seed. Weights have std 0.1 so logits
    are not all near zero (a weak parity test)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_llama_config(**kwargs)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
            else:
                p.uniform_(0.5, 1.5)
    return model
