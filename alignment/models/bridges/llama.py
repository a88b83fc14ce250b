"""Format mapping between Hugging Face Llama and Megatron-Core ``GPTModel`` tensors.

Pure functions, no communication: given HF tensors, produce the tensor-parallel
shard of one Megatron parameter; given the TP shards of one Megatron parameter,
produce the HF tensors. Which rank holds which shard, and how shards travel, is
the job of :mod:`alignment.models.weights` and :mod:`parallel`.

Layouts (``H`` hidden, ``hd`` head dim, ``nq``/``nkv`` query/KV heads, ``g = nq/nkv``):

* ``linear_qkv.weight``: ``[nkv * (g + 2) * hd, H]``, interleaved per query group
  ``[q_0 .. q_{g-1}, k, v]`` for each KV head, so that a contiguous split along dim 0
  gives each TP rank whole query groups (Megatron-LM ``tools/checkpoint``,
  Megatron-Bridge ``QKVMapping``).
* ``linear_fc1.weight``: gated MLP, each TP shard is ``[gate_r; up_r]``
  (Megatron-Bridge ``GatedMLPMapping``).
* ``word_embeddings`` / ``output_layer``: vocabulary-parallel, padded to a multiple
  of ``make_vocab_size_divisible_by * tp_size`` with zero rows (Megatron-LM
  ``_vocab_size_with_padding``).
* ``linear_proj`` / ``linear_fc2``: row-parallel (split along dim 1). Norms: replicated.

Source: Megatron-Bridge ``models/llama/llama_bridge.py`` and ``param_mapping.py``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

Tensor = torch.Tensor

# transformer-engine specs fuse the pre-norms into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class LlamaDims:
    """Model dimensions read from an HF ``LlamaConfig`` (or Qwen2/Mistral alike)."""

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

    @classmethod
    def from_hf_config(cls, cfg, make_vocab_size_divisible_by: int = 128) -> "LlamaDims":
        heads = cfg.num_attention_heads
        arch = (getattr(cfg, "architectures", None) or [""])[0]
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or getattr(cfg, "model_type", "") == "qwen2" \
            or arch.startswith("Qwen2")
        return cls(
            num_layers=cfg.num_hidden_layers,
            hidden_size=cfg.hidden_size,
            num_attention_heads=heads,
            num_query_groups=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            ffn_hidden_size=cfg.intermediate_size,
            vocab_size=cfg.vocab_size,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            qkv_bias=qkv_bias,
        )

    def padded_vocab_size(self, tp_size: int) -> int:
        """Vocabulary rounded up to a multiple of ``make_vocab_size_divisible_by * tp_size``."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return -(-self.vocab_size // multiple) * multiple


def split_layer_name(name: str) -> tuple[int | None, str]:
    """``"decoder.layers.7.mlp.linear_fc1.weight"`` -> ``(7, "mlp.linear_fc1.weight")``;
    non-layer names -> ``(None, name)``. TE fused-norm names map to the local-spec names."""
    m = _LAYER_RE.match(name)
    if not m:
        return None, name
    return int(m.group(1)), _TE_ALIASES.get(m.group(2), m.group(2))


class LlamaBridge:
    """Maps one Megatron parameter at a time between HF and Megatron TP-shard layout.

    Args:
        dims: the model's :class:`LlamaDims`.

    Megatron names use GLOBAL layer indices (``decoder.layers.{i}`` with ``i`` in
    ``[0, num_layers)``); translating a pipeline stage's local index is the caller's job.
    """

    def __init__(self, dims: LlamaDims, head: str = "lm"):
        if head not in ("lm", "score"):
            raise ValueError(f"head={head!r}: valid values are lm (LM head), score (scalar reward/value head)")
        self.dims = dims
        self.head = head

    @property
    def output_layer_tied(self) -> bool:
        """True when ``output_layer.weight`` is the embedding (tied LM head): not exported on its own."""
        return self.head == "lm" and self.dims.tie_word_embeddings

    # ---- names -------------------------------------------------------------------
    def megatron_names(self) -> list[str]:
        """All Megatron parameter names of the full (unsplit) model, global layer indices."""
        names = ["embedding.word_embeddings.weight"]
        for i in range(self.dims.num_layers):
            p = f"decoder.layers.{i}."
            names += [p + s for s in (
                "input_layernorm.weight", "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                "mlp.linear_fc1.weight", "mlp.linear_fc2.weight")]
            if self.dims.qkv_bias:
                names.append(p + "self_attention.linear_qkv.bias")
        names.append("decoder.final_layernorm.weight")
        if not self.output_layer_tied:
            names.append("output_layer.weight")
        return names

    def hf_names(self, mg_name: str) -> list[str]:
        """HF tensor names that one Megatron parameter is made of."""
        layer, rest = split_layer_name(mg_name)
        if layer is None:
            if rest == "embedding.word_embeddings.weight":
                return ["model.embed_tokens.weight"]
            if rest == "decoder.final_layernorm.weight":
                return ["model.norm.weight"]
            if rest == "output_layer.weight" and self.head == "score":
                return ["score.weight"]  # HF LlamaForSequenceClassification, num_labels=1
            if rest == "output_layer.weight":
                return ["model.embed_tokens.weight"] if self.dims.tie_word_embeddings else ["lm_head.weight"]
            raise KeyError(f"no HF mapping for Megatron parameter {mg_name!r}")
        p = f"model.layers.{layer}."
        table = {
            "input_layernorm.weight": [p + "input_layernorm.weight"],
            "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
            "self_attention.linear_qkv.weight": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                                 p + "self_attn.v_proj.weight"],
            "self_attention.linear_qkv.bias": [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                               p + "self_attn.v_proj.bias"],
            "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
            "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
            "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
        }
        if rest not in table:
            raise KeyError(f"no HF mapping for Megatron parameter {mg_name!r}")
        return table[rest]

    def hf_shape(self, hf_name: str) -> tuple[int, ...]:
        """Shape of an HF Llama tensor. Raises KeyError for an unknown name."""
        d = self.dims
        suffix_shapes = {
            "norm.weight": (d.hidden_size,),
            "q_proj.weight": (d.num_attention_heads * d.head_dim, d.hidden_size),
            "k_proj.weight": (d.num_query_groups * d.head_dim, d.hidden_size),
            "v_proj.weight": (d.num_query_groups * d.head_dim, d.hidden_size),
            "o_proj.weight": (d.hidden_size, d.num_attention_heads * d.head_dim),
            "gate_proj.weight": (d.ffn_hidden_size, d.hidden_size),
            "up_proj.weight": (d.ffn_hidden_size, d.hidden_size),
            "down_proj.weight": (d.hidden_size, d.ffn_hidden_size),
            "q_proj.bias": (d.num_attention_heads * d.head_dim,),
            "k_proj.bias": (d.num_query_groups * d.head_dim,),
            "v_proj.bias": (d.num_query_groups * d.head_dim,),
        }
        if hf_name == "score.weight":
            return (1, d.hidden_size)
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return (d.vocab_size, d.hidden_size)
        for suffix, shape in suffix_shapes.items():
            if hf_name.endswith(suffix):
                return shape
        raise KeyError(f"unknown HF Llama tensor {hf_name!r}")

    def _kind(self, mg_name: str) -> str:
        _, rest = split_layer_name(mg_name)
        if rest == "output_layer.weight" and self.head == "score":
            return "replicated"  # [1, hidden] on every TP rank
        if rest in ("embedding.word_embeddings.weight", "output_layer.weight"):
            return "vocab"
        if rest.endswith("linear_qkv.weight") or rest.endswith("linear_qkv.bias"):
            return "qkv"
        if rest.endswith("linear_fc1.weight"):
            return "gate_up"
        if rest.endswith("linear_proj.weight") or rest.endswith("linear_fc2.weight"):
            return "row"
        if rest.endswith("norm.weight"):
            return "replicated"
        raise KeyError(f"unknown Megatron parameter {mg_name!r}")

    # ---- HF -> Megatron ------------------------------------------------------------
    def to_megatron_shard(self, mg_name: str, hf: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> Tensor:
        """The ``tp_rank``-th of ``tp_size`` shards of Megatron parameter ``mg_name``.

        Args:
            hf: HF state dict (any mapping name -> tensor; only the needed names are read).
        Returns:
            e.g. ``linear_qkv.weight`` -> ``[nkv/tp * (g+2) * hd, H]``;
            ``word_embeddings.weight`` -> ``[padded_vocab/tp, H]``.
        Raises:
            KeyError: unknown name, or an HF tensor missing from ``hf``.
        """
        d = self.dims
        kind = self._kind(mg_name)
        srcs = [hf[n] for n in self.hf_names(mg_name)]
        if kind == "replicated":
            return srcs[0]
        if kind == "row":
            return srcs[0].chunk(tp_size, dim=1)[tp_rank]
        if kind == "vocab":
            w = srcs[0]
            pad = d.padded_vocab_size(tp_size) - w.shape[0]
            if pad:
                w = torch.cat([w, w.new_zeros(pad, w.shape[1])])
            return w.chunk(tp_size, dim=0)[tp_rank]
        if kind == "gate_up":
            gate, up = srcs
            return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
        # qkv (weight [rows, H] or bias [rows])
        q, k, v = srcs
        nkv, g, hd, rest = d.num_query_groups, d.num_attention_heads // d.num_query_groups, d.head_dim, q.shape[1:]
        fused = torch.cat([q.reshape(nkv, g * hd, *rest), k.reshape(nkv, hd, *rest), v.reshape(nkv, hd, *rest)], dim=1)
        return fused.chunk(tp_size, dim=0)[tp_rank].reshape(-1, *rest)

    # ---- Megatron -> HF ------------------------------------------------------------
    def to_hf(self, mg_name: str, shards: list[Tensor]) -> dict[str, Tensor]:
        """HF tensors of one Megatron parameter from all its TP shards (ordered by TP rank).

        Returns a dict HF name -> full tensor (vocabulary padding removed, QKV
        de-interleaved, gate/up separated). For a tied ``output_layer.weight`` it
        returns ``{}`` (HF stores only ``embed_tokens``).
        Raises:
            KeyError: unknown name. ValueError: a shard count that does not divide the dims.
        """
        d = self.dims
        kind = self._kind(mg_name)
        names = self.hf_names(mg_name)
        if mg_name == "output_layer.weight" and self.output_layer_tied:
            return {}
        if kind == "replicated":
            return {names[0]: shards[0]}
        if kind == "row":
            return {names[0]: torch.cat(shards, dim=1)}
        if kind == "vocab":
            return {names[0]: torch.cat(shards, dim=0)[: d.vocab_size]}
        if kind == "gate_up":
            halves = [s.chunk(2, dim=0) for s in shards]
            return {names[0]: torch.cat([a for a, _ in halves]), names[1]: torch.cat([b for _, b in halves])}
        nkv, g, hd, rest = d.num_query_groups, d.num_attention_heads // d.num_query_groups, d.head_dim, shards[0].shape[1:]
        fused = torch.cat(shards, dim=0).reshape(nkv, (g + 2) * hd, *rest)
        q, k, v = fused.split([g * hd, hd, hd], dim=1)
        return {names[0]: q.reshape(-1, *rest), names[1]: k.reshape(-1, *rest), names[2]: v.reshape(-1, *rest)}


BRIDGES: dict[str, Callable[[LlamaDims], LlamaBridge]] = {
    "LlamaForCausalLM": LlamaBridge,
    "MistralForCausalLM": LlamaBridge,
    "LlamaForSequenceClassification": LlamaBridge,
    "Qwen2ForCausalLM": LlamaBridge,  # Llama + QKV bias (LlamaDims.qkv_bias)
}


def get_bridge(hf_config, head: str = "lm") -> LlamaBridge:
    """Bridge for an HF config's architecture; ``head="score"`` for a reward model / critic
    (scalar head, HF ``score.weight``). Raises ValueError naming supported architectures."""
    arch = (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]
    if arch not in BRIDGES:
        raise ValueError(f"model architecture {arch!r} is not supported; supported: {sorted(BRIDGES)}")
    return BRIDGES[arch](LlamaDims.from_hf_config(hf_config), head=head)
