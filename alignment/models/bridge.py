"""The bridge of one model: a family's table (:mod:`alignment.models.mapping` rows) applied to
that model's dimensions. Everything format-related megalign does goes through it:

* HF <-> Megatron, one parameter at a time (:meth:`Bridge.to_megatron_shard`,
  :meth:`Bridge.to_hf`), for checkpoint import/export and loading;
* the vLLM target layout the resharder fills (:meth:`Bridge.vllm_layout`);
* which vLLM loader cuts each vLLM parameter from the HF tensors (:meth:`Bridge.vllm_reference`),
  for the weight check.

Pure functions of tensors and names, no communication. Megatron names use GLOBAL layer and
expert indices (:func:`parallel.names.global_param_names`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping as MappingType

import torch

from alignment.models.dims import ModelDims
from alignment.models.mapping import (
    EMBEDDING,
    FINAL_NORM,
    LM_HEAD,
    SCORE_HEAD,
    Family,
    Mapping,
    VllmSplit,
    vllm_padded_vocab,
)
from parallel.pieces import TargetLayout, TargetTensor

Tensor = torch.Tensor

# transformer-engine specs fuse the pre-norms into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# HF class-name suffix of each head (``LlamaForCausalLM`` / ``LlamaForSequenceClassification``)
HEAD_SUFFIX = {"lm": "ForCausalLM", "score": "ForSequenceClassification"}


def split_layer_name(name: str) -> tuple[int | None, str]:
    """``"decoder.layers.7.mlp.linear_fc1.weight"`` -> ``(7, "mlp.linear_fc1.weight")``;
    non-layer names -> ``(None, name)``. TE fused-norm names map to the local-spec names."""
    m = _LAYER_RE.match(name)
    if not m:
        return None, name
    return int(m.group(1)), _TE_ALIASES.get(m.group(2), m.group(2))


class Bridge:
    """Maps one Megatron parameter at a time between HF, Megatron TP shards and vLLM's layout.

    Args:
        family: the model family's :class:`alignment.models.mapping.Family` (its table).
        dims: the model's :class:`ModelDims`.
        head: ``"lm"`` (LM head) or ``"score"`` (scalar reward/value head, HF ``score.weight``).
        architecture: the HF architecture the model came as (either head's); default the
            family's first.
    Raises:
        ValueError: an unknown ``head``.
    """

    def __init__(self, family: Family, dims: ModelDims, head: str = "lm", architecture: str | None = None):
        if head not in ("lm", "score"):
            raise ValueError(f"head={head!r}: valid values are lm (LM head), score (scalar reward/value head)")
        self.family, self.dims, self.head = family, dims, head
        self._causal = (architecture or family.architectures[0]).replace(HEAD_SUFFIX["score"], HEAD_SUFFIX["lm"])
        self._vllm_index: dict[str, tuple[str, list[list[str]]]] | None = None
        # Megatron global name -> (row, name fields); in model order (vLLM order within a layer).
        self._rows: dict[str, tuple[Mapping, dict]] = {}
        if head == "score" and not family.causal_lm:
            raise ValueError(f"head='score': the {family.name} family has no sequence-classification (reward / "
                             "value head) form; reward models and critics need a causal LM family")
        for row in family.extra(dims):  # e.g. a vision tower, ahead of the language model as in vLLM
            self._add(row, {})
        self._extra = set(self._rows)  # named as the family's table says (no language-model prefix)
        self._add(EMBEDDING, {})
        for layer in range(dims.num_layers):
            for row in family.layer(dims, layer):
                for e in range(dims.num_experts) if row.expert else [None]:
                    fields = {"layer": layer, "expert": e}
                    self._add(row, fields, prefix=f"decoder.layers.{layer}.")
        self._add(FINAL_NORM, {})
        if head == "score":
            self._add(SCORE_HEAD, {})
        elif not dims.tie_word_embeddings:
            self._add(LM_HEAD, {})

    def _add(self, row: Mapping, fields: dict, prefix: str = "") -> None:
        self._rows[prefix + row.megatron.format(**fields)] = (row, fields)

    @property
    def output_layer_tied(self) -> bool:
        """True when ``output_layer.weight`` is the embedding (tied LM head): not exported on its own."""
        return self.head == "lm" and self.dims.tie_word_embeddings

    @property
    def hf_architecture(self) -> str:
        """The HF ``architectures`` entry of this model's export: the causal LM, or for
        ``head="score"`` its sequence classifier (e.g. ``Qwen3ForSequenceClassification``)."""
        return self._causal.replace(HEAD_SUFFIX["lm"], HEAD_SUFFIX[self.head])

    # ---- names -------------------------------------------------------------------
    def megatron_names(self) -> list[str]:
        """All Megatron parameter names of the full (unsplit) model, global indices."""
        return list(self._rows)

    def _row(self, mg_name: str) -> tuple[Mapping, dict]:
        layer, rest = split_layer_name(mg_name)
        key = rest if layer is None else f"decoder.layers.{layer}.{rest}"
        if key == "output_layer.weight" and self.output_layer_tied:
            return LM_HEAD, {}
        if key not in self._rows:
            raise KeyError(f"no HF mapping for Megatron parameter {mg_name!r} in the {self.family.name} family")
        return self._rows[key]

    def hf_names(self, mg_name: str) -> list[str]:
        """HF tensor names that one Megatron parameter is made of (a tied LM head: the embedding)."""
        row, fields = self._row(mg_name)
        names = list(EMBEDDING.hf) if row is LM_HEAD and self.output_layer_tied else [n.format(**fields) for n in row.hf]
        prefix = self.family.hf_language_model
        if prefix == "model." or mg_name in self._extra:
            return names
        return [prefix + n[len("model."):] if n.startswith("model.") else n for n in names]

    def is_expert(self, mg_name: str) -> bool:
        """True for an expert parameter (split over the expert-tensor-parallel group)."""
        return self._row(mg_name)[0].expert

    # ---- HF checkpoint form ------------------------------------------------------
    def checkpoint_view(self, hf: MappingType[str, Tensor]) -> MappingType[str, Tensor]:
        """An HF checkpoint state as the table names it: per-expert tensors read out of a family's fused
        expert tensors (:attr:`Family.fused_experts`); ``hf`` itself for every other family."""
        fused = self.family.fused_experts
        return hf if fused is None else fused.view(hf, self.dims.hidden_size)

    def released_checkpoint(self, checkpoint: dict[str, Tensor]) -> dict[str, Tensor]:
        """An HF checkpoint state in the form megalign's export writes (fused experts in their released layout,
        which vLLM reads, where transformers 5 saves its in-memory one); ``checkpoint`` itself for a family
        without fused experts."""
        fused = self.family.fused_experts
        return checkpoint if fused is None else fused.released(checkpoint, self.dims.hidden_size)

    def to_checkpoint(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A full HF state as the table names it (:meth:`to_hf` of every parameter) in the family's checkpoint
        form (experts fused where the family's checkpoints fuse them); ``state`` itself otherwise."""
        fused = self.family.fused_experts
        return state if fused is None else fused.fuse(state)

    # ---- HF <-> Megatron -----------------------------------------------------------
    def to_megatron_shard(self, mg_name: str, hf: MappingType[str, Tensor], tp_rank: int, tp_size: int) -> Tensor:
        """The ``tp_rank``-th of ``tp_size`` shards of Megatron parameter ``mg_name`` (for an
        expert parameter, rank and size in the expert-tensor-parallel group).

        Args:
            hf: HF checkpoint state dict (any mapping name -> tensor; only the needed names are read).
        Returns:
            e.g. ``linear_qkv.weight`` -> ``[nkv/tp * (g+2) * hd, H]``; ``word_embeddings.weight``
            -> ``[padded_vocab/tp, H]``.
        Raises:
            KeyError: unknown name, or an HF tensor missing from ``hf``.
        """
        row, _ = self._row(mg_name)
        return row.to_megatron([hf[n] for n in self.hf_names(mg_name)], tp_rank, tp_size, self.dims)

    def to_hf(self, mg_name: str, shards: list[Tensor]) -> dict[str, Tensor]:
        """HF tensors of one Megatron parameter from all its TP shards (ordered by TP rank):
        vocabulary padding removed, QKV de-interleaved, gate/up separated. A tied
        ``output_layer.weight`` gives ``{}`` (HF stores only ``embed_tokens``).
        Raises:
            KeyError: unknown name.
        """
        row, _ = self._row(mg_name)
        if row is LM_HEAD and self.output_layer_tied:
            return {}
        return dict(zip(self.hf_names(mg_name), row.to_hf(shards, self.dims)))

    # ---- Megatron -> vLLM ----------------------------------------------------------
    def check_tp_sizes(self, megatron_tp: int, vllm_tp: int, megatron_etp: int | None = None) -> None:
        """Raise ValueError, naming the field, for TP sizes either side cannot use
        (``megatron_etp``: expert-tensor-parallel size, default ``megatron_tp``)."""
        d, etp = self.dims, megatron_etp or megatron_tp
        nq, nkv, f, fe = d.num_attention_heads, d.num_query_groups, d.ffn_hidden_size, d.moe_ffn_hidden_size
        dense = d.num_dense_layers > 0
        if nq % megatron_tp or nkv % megatron_tp or (dense and f % megatron_tp):
            raise ValueError(f"parallel.tensor_model_parallel_size={megatron_tp} must divide the attention heads "
                             f"({nq}), KV heads ({nkv})" + (f" and MLP size ({f})" if dense else ""))
        if d.num_experts and fe % etp:
            raise ValueError(f"parallel.expert_tensor_parallel_size={etp} must divide the expert MLP size ({fe})")
        if nq % vllm_tp or (dense and f % vllm_tp) or (d.num_experts and fe % vllm_tp) \
                or (nkv % vllm_tp and vllm_tp % nkv) or vllm_padded_vocab(d.vocab_size) % vllm_tp:
            raise ValueError(f"rollout.tensor_parallel_size={vllm_tp} must divide the attention heads ({nq}), the MLP "
                             f"sizes ({f}{f', experts {fe}' if d.num_experts else ''}) and the padded vocabulary, "
                             f"and divide or be a multiple of the KV heads ({nkv})")
        tower = sorted({row.split_size(d) for row, _ in self._rows.values() if isinstance(row, VllmSplit)})
        heads = getattr(d.vision, "num_heads", 0)
        if any(n % vllm_tp for n in tower) or (heads and heads % vllm_tp):
            raise ValueError(f"rollout.tensor_parallel_size={vllm_tp} must divide the vision tower's attention heads "
                             f"({heads}) and split sizes {tower} (vLLM splits the tower over its TP ranks)")

    def vllm_tensors(self, megatron_tp: int, vllm_tp: int, vllm_rank: int,
                     megatron_etp: int | None = None) -> list[TargetTensor]:
        """Every vLLM parameter of vLLM TP rank ``vllm_rank`` (of ``vllm_tp``), grouped by vLLM
        module, with the Megatron pieces (global names) that fill it. Experts of one layer are
        stacked into one fused tensor (``dest_index = (expert,)``). A tied LM head is not listed
        (vLLM ties ``lm_head`` to ``embed_tokens``).
        Raises:
            ValueError: TP sizes that do not divide the model (:meth:`check_tp_sizes`).
        """
        self.check_tp_sizes(megatron_tp, vllm_tp, megatron_etp)
        etp = megatron_etp or megatron_tp
        out: dict[str, TargetTensor] = {}
        for mg_name, (row, fields) in self._rows.items():
            if row.vllm is None:
                continue
            name = self.vllm_name(mg_name)
            shape, pieces = row.vllm_pieces(mg_name, self.dims, etp if row.expert else megatron_tp, vllm_tp,
                                            vllm_rank)
            if row.expert:
                e = fields["expert"]
                shape = (self.dims.num_experts, *shape)
                pieces = [dataclasses.replace(p, dest_index=(e,)) for p in pieces]
            if name in out:  # several rows fill one vLLM tensor: experts, or a merged gate / up pair
                pieces = list(out[name].pieces) + list(pieces)
            out[name] = TargetTensor(name, tuple(shape), tuple(pieces))
        return list(out.values())

    def vllm_name(self, mg_name: str) -> str:
        """The vLLM parameter that Megatron parameter ``mg_name`` feeds (the family's
        ``vllm_language_model`` prefix on the language model's). Raises KeyError for an unknown name or
        one with no vLLM parameter."""
        row, fields = self._row(mg_name)
        if row.vllm is None:
            raise KeyError(f"Megatron parameter {mg_name!r} has no vLLM parameter in the {self.family.name} family")
        name = row.vllm.format(**fields)
        return name if mg_name in self._extra else self.family.vllm_language_model + name

    def vllm_layout(self, megatron_tp: int, vllm_tp: int, megatron_etp: int | None = None) -> TargetLayout:
        """The resharder's target layout: vLLM TP rank -> :meth:`vllm_tensors`.
        Raises ValueError at once for TP sizes that cannot split the model."""
        self.check_tp_sizes(megatron_tp, vllm_tp, megatron_etp)
        return lambda rank: self.vllm_tensors(megatron_tp, vllm_tp, rank, megatron_etp)

    def vllm_reference(self, vllm_name: str) -> tuple[str, list[list[str]]]:
        """How vLLM itself fills parameter ``vllm_name`` from an HF checkpoint: the loader kind
        (``replicated``, ``qkv``, ``qkv_fused``, ``column``, ``merged``, ``row``, ``vocab``, ``moe_w13``,
        ``moe_w2``) and the HF source names (one list per expert for fused MoE tensors, one per row for
        a merged pair filled by two rows, else one list).
        Raises KeyError for a name that is not a vLLM parameter of this model."""
        if self._vllm_index is None:
            self._vllm_index = {}
            for mg_name, (row, fields) in self._rows.items():
                if row.vllm is not None:
                    kind, sources = self._vllm_index.setdefault(self.vllm_name(mg_name), (row.vllm_loader, []))
                    sources.append(self.hf_names(mg_name))
        if vllm_name not in self._vllm_index:
            raise KeyError(f"{vllm_name!r} is not a vLLM parameter of this {self.family.name} model")
        return self._vllm_index[vllm_name]
