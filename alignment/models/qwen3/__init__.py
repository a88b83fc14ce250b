"""The Qwen3 family (dense): Llama's layer plus an RMSNorm over every query and key head before
RoPE (QK-norm, HF ``q_norm`` / ``k_norm``, Megatron ``q_layernorm`` / ``k_layernorm``,
``[head_dim]`` each, replicated over TP); no QKV bias; tied or untied embeddings."""

from __future__ import annotations

import dataclasses

from alignment.models import llama
from alignment.models.dims import ModelDims
from alignment.models.mapping import Family, Mapping, Replicated, head_dim

L = llama.L

QK_NORM = (
    Replicated("self_attention.q_layernorm.weight", (L + "self_attn.q_norm.weight",), L + "self_attn.q_norm.weight",
               shape=head_dim),
    Replicated("self_attention.k_layernorm.weight", (L + "self_attn.k_norm.weight",), L + "self_attn.k_norm.weight",
               shape=head_dim),
)


def attention(d: ModelDims) -> tuple[Mapping, ...]:
    """Llama's attention rows plus the QK-norm weights."""
    return llama.attention(d) + QK_NORM


def layer(d: ModelDims, i: int) -> tuple[Mapping, ...]:
    return attention(d) + llama.MLP


def dims(cfg) -> ModelDims:
    """:class:`ModelDims` of an HF ``Qwen3Config`` (QK-norm on; QKV bias only if ``attention_bias``).
    Raises ValueError for sliding-window attention."""
    return dataclasses.replace(llama.dims(cfg), qk_layernorm=True,
                               qkv_bias=bool(getattr(cfg, "attention_bias", False)))


FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), dims, layer)
