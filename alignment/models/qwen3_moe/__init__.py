"""The Qwen3-MoE family (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, and in every sparse
layer a top-k router over ``num_experts`` SwiGLU experts (no shared expert).

HF checkpoints store each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` on its own
(``mlp.experts.{e}.*``; transformers 5 fuses them in memory only); Megatron's ``SequentialMLP``
holds this expert-parallel rank's experts as ``local_experts.{j}`` (global index in the table);
vLLM's fused MoE stacks all experts into ``w13`` ``[experts, 2F/t, H]`` and ``w2``
``[experts, H, F/t]``. Layers listed in ``mlp_only_layers`` or off the ``decoder_sparse_step``
grid are dense (Llama MLP of ``intermediate_size``)."""

from __future__ import annotations

import dataclasses

from alignment.models import llama, qwen3
from alignment.models.dims import ModelDims
from alignment.models.mapping import Family, GatedMLP, Mapping, Replicated, RowParallel

L = llama.L
E = L + "mlp.experts.{expert}."
VLLM_EXPERTS = L + "mlp.experts.routed_experts."  # vLLM 0.32: FusedMoE's MoERunner -> RoutedExperts

MOE = (
    Replicated("mlp.router.weight", (L + "mlp.gate.weight",), L + "mlp.gate.weight",
               shape=lambda d: (d.num_experts, d.hidden_size)),
    GatedMLP("mlp.experts.local_experts.{expert}.linear_fc1.weight", (E + "gate_proj.weight", E + "up_proj.weight"),
             VLLM_EXPERTS + "w13_weight", expert=True, ffn=lambda d: d.moe_ffn_hidden_size),
    RowParallel("mlp.experts.local_experts.{expert}.linear_fc2.weight", (E + "down_proj.weight",),
                VLLM_EXPERTS + "w2_weight", expert=True, shape=lambda d: (d.hidden_size, d.moe_ffn_hidden_size)),
)


def layer(d: ModelDims, i: int) -> tuple[Mapping, ...]:
    return qwen3.attention(d) + (MOE if d.is_moe_layer(i) else llama.MLP)


def dims(cfg) -> ModelDims:
    """:class:`ModelDims` of an HF ``Qwen3MoeConfig`` (or a config without ``norm_topk_prob``, whose router
    always renormalises its top-k weights: Qwen3-VL-MoE's text config). Raises ValueError for sliding-window
    attention or a shared expert (Qwen2-MoE style), which this table does not map."""
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        raise ValueError("shared_expert_intermediate_size > 0: shared experts are not mapped by the qwen3_moe family")
    sparse = [int(i not in (cfg.mlp_only_layers or []) and (i + 1) % cfg.decoder_sparse_step == 0)
              for i in range(cfg.num_hidden_layers)]
    return dataclasses.replace(qwen3.dims(cfg), num_experts=cfg.num_experts,
                               moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_topk=cfg.num_experts_per_tok,
                               moe_norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", True)), moe_layer_pattern=tuple(sparse))


FAMILY = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), dims, layer)
