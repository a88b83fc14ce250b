"""The Llama family: Llama, Mistral (full attention), Qwen2 (QKV bias), SmolLM2.

The table: one row per Megatron parameter of a layer, with its HF checkpoint tensors and its
vLLM parameter (see :mod:`alignment.models.mapping`). Rows are listed in vLLM module order, the
rows of one vLLM module next to each other (the engine repacks a module once all its tensors
are in). Other families reuse these rows (:mod:`alignment.models.qwen3`).
"""

from __future__ import annotations

from alignment.models.dims import ModelDims
from alignment.models.mapping import QKV, Family, GatedMLP, Mapping, Replicated, RowParallel, hidden

L = "model.layers.{layer}."

INPUT_NORM = Replicated("input_layernorm.weight", (L + "input_layernorm.weight",), L + "input_layernorm.weight",
                        shape=hidden)
QKV_WEIGHT = QKV("self_attention.linear_qkv.weight",
                 (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight", L + "self_attn.v_proj.weight"),
                 L + "self_attn.qkv_proj.weight")
QKV_BIAS = QKV("self_attention.linear_qkv.bias",
               (L + "self_attn.q_proj.bias", L + "self_attn.k_proj.bias", L + "self_attn.v_proj.bias"),
               L + "self_attn.qkv_proj.bias")
O_PROJ = RowParallel("self_attention.linear_proj.weight", (L + "self_attn.o_proj.weight",),
                     L + "self_attn.o_proj.weight", shape=lambda d: (d.hidden_size, d.num_attention_heads * d.head_dim))
POST_ATTENTION_NORM = Replicated("pre_mlp_layernorm.weight", (L + "post_attention_layernorm.weight",),
                                 L + "post_attention_layernorm.weight", shape=hidden)
GATE_UP = GatedMLP("mlp.linear_fc1.weight", (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
                   L + "mlp.gate_up_proj.weight")
DOWN = RowParallel("mlp.linear_fc2.weight", (L + "mlp.down_proj.weight",), L + "mlp.down_proj.weight",
                   shape=lambda d: (d.hidden_size, d.ffn_hidden_size))

MLP = (GATE_UP, DOWN)


def attention(d: ModelDims) -> tuple[Mapping, ...]:
    """Input norm and self-attention rows (with Qwen2's QKV bias when the model has one)."""
    return (INPUT_NORM, QKV_WEIGHT) + ((QKV_BIAS,) if d.qkv_bias else ()) + (O_PROJ, POST_ATTENTION_NORM)


def layer(d: ModelDims, i: int) -> tuple[Mapping, ...]:
    return attention(d) + MLP


def check_attention(cfg) -> None:
    """Refuse Qwen-style sliding-window attention (``use_sliding_window=true``), which megalign's
    attention does not reproduce. Raises ValueError naming the HF field."""
    if getattr(cfg, "use_sliding_window", False):
        raise ValueError(f"{cfg.model_type}: use_sliding_window=true (sliding_window={cfg.sliding_window}) is not "
                         "supported: megalign's attention is full causal attention; set use_sliding_window=false")


def dims(cfg, make_vocab_size_divisible_by: int = 128) -> ModelDims:
    """:class:`ModelDims` of an HF Llama / Mistral / Qwen2 config.
    Raises ValueError for sliding-window attention (:func:`check_attention`)."""
    check_attention(cfg)
    heads = cfg.num_attention_heads
    arch = (getattr(cfg, "architectures", None) or [""])[0]
    return ModelDims(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        ffn_hidden_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        qkv_bias=bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2"
        or arch.startswith("Qwen2"),
    )


FAMILY = Family("llama", ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), dims, layer)
