"""The dimensions of a decoder-only transformer, as a model family's table reads them from an
HF config (:func:`alignment.models.families.model_dims`). One value type for every family:
dense (Llama, Qwen3) and mixture-of-experts (Qwen3-MoE) alike."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelDims:
    """Model dimensions (Megatron's names where Megatron has one).

    ``num_query_groups`` = KV heads; ``head_dim`` = Megatron's ``kv_channels`` (may differ from
    ``hidden_size / num_attention_heads``). Mixture of experts: ``num_experts`` experts of width
    ``moe_ffn_hidden_size`` per MoE layer, ``moe_router_topk`` of them per token, top-k weights
    renormalised when ``moe_norm_topk_prob``; ``moe_layer_pattern[i]`` is 1 for an MoE layer, 0
    for a dense one (Megatron's ``moe_layer_freq`` as a list); dense layers use
    ``ffn_hidden_size``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    make_vocab_size_divisible_by: int = 128
    qkv_bias: bool = False  # Qwen2: q/k/v projections have a bias
    qk_layernorm: bool = False  # Qwen3: RMSNorm over each query / key head before RoPE
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_router_topk: int = 0
    moe_norm_topk_prob: bool = True
    moe_layer_pattern: tuple[int, ...] = ()
    # vision-language models: the family's vision tower dims (e.g. :class:`alignment.models.qwen2_5_vl.VisionDims`),
    # the placeholder token id images fill, M-RoPE's split of the rotary channels over (time, height, width),
    # and DeepStack's: the first ``deepstack_layers`` decoder layers add more of the tower's features at the
    # image positions (Qwen3-VL)
    vision: object = None
    image_token_id: int = -1
    mrope_section: tuple[int, ...] = ()
    deepstack_layers: int = 0

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp_size``
        (Megatron-LM ``_vocab_size_with_padding``)."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple

    def is_moe_layer(self, layer: int) -> bool:
        """True when layer ``layer`` (0-based, global) is a mixture-of-experts layer."""
        return bool(self.num_experts) and bool(self.moe_layer_pattern[layer])

    @property
    def is_vision_language(self) -> bool:
        """True for a vision-language model (a vision tower feeds image features into the language model)."""
        return self.vision is not None

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layer_pattern) if self.num_experts else 0

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers
