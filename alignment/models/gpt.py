"""Build Megatron-Core ``GPTModel`` shards for an HF config of any supported family.

The family's :class:`alignment.models.dims.ModelDims` decide the layer: RMSNorm + SwiGLU +
RoPE + GQA always, QKV bias (Qwen2), QK layernorm (Qwen3), and Megatron's ``MoELayer`` (top-k
router, ``SequentialMLP`` experts, ``alltoall`` token dispatcher) for mixture-of-experts layers.
The transformer-engine layer spec is used when transformer-engine is installed, else Megatron's
local spec (torch modules), which is what the CPU path runs.
Call after :func:`parallel.state.init_distributed`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignment.models.families import family_of, model_dims, text_config


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def moe_config(d, moe_aux_loss_coeff: float = 0.0) -> dict:
    """Megatron's MoE settings for a model's dims (empty for a dense model).

    Routing as HF Qwen3-MoE (``Qwen3MoeTopKRouter``): softmax over the router logits in fp32,
    top-k; ``norm_topk_prob`` renormalises the k weights, which is Megatron's top-k-then-softmax
    (``moe_router_pre_softmax=False``), else softmax-then-top-k (``pre_softmax=True``). Experts
    are ``SequentialMLP`` (no grouped GEMM: it needs transformer-engine or grouped_gemm), tokens
    move with the ``alltoall`` dispatcher. ``moe_aux_loss_coeff``: the switch load-balancing loss
    (Fedus et al. 2021, eq. 4) weight, 0 = off."""
    if not d.num_experts:
        return {}
    return dict(num_moe_experts=d.num_experts, moe_ffn_hidden_size=d.moe_ffn_hidden_size,
                moe_router_topk=d.moe_router_topk, moe_router_pre_softmax=not d.moe_norm_topk_prob,
                moe_router_score_function="softmax", moe_router_dtype="fp32",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=moe_aux_loss_coeff,
                moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                moe_layer_freq=list(d.moe_layer_pattern))


def transformer_config(hf_config, *, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                       sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                       virtual_pipeline_model_parallel_size: int | None = None,
                       context_parallel_size: int = 1, cp_comm_type: str = "p2p",
                       expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None,
                       moe_aux_loss_coeff: float = 0.0, initialize: bool = True):
    """Megatron ``TransformerConfig`` equal to an HF config of a supported family (RMSNorm,
    SwiGLU, RoPE, GQA; QKV bias, QK layernorm and MoE layers when the model has them).

    ``calculate_per_token_loss=True``: megalign's loss functions are already divided by
    the global token count, so Megatron must sum micro-batch losses and DP gradients
    rather than average them (see :mod:`alignment.training.megatron_step`).
    ``context_parallel_size``/``cp_comm_type``/``expert_*``: see :class:`parallel.layout.ParallelLayout`;
    ``moe_aux_loss_coeff``: see :func:`moe_config`. ``initialize=False`` skips Megatron's random
    initialisation (``perform_initialization``; ~1.1 s per SmolLM2 copy on one CPU thread) for
    models whose every weight is loaded next (:func:`build_gpt_model` then marks the
    tensor-parallel weights itself).
    """
    from megatron.core.transformer import TransformerConfig

    d = model_dims(hf_config)
    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=text_config(hf_config).rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        qk_layernorm=d.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel_size,
        cp_comm_type=cp_comm_type,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialize,
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        mrope_section=list(d.mrope_section) or None,
        **moe_config(d, moe_aux_loss_coeff),
    )


def rope_theta(hf_config) -> float:
    """RoPE base from an HF config (``rope_theta`` or transformers 5's ``rope_parameters``; a
    vision-language model's from its ``text_config``)."""
    hf_config = text_config(hf_config)
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def layer_spec(config, core_attention: str = "megalign", vp_stage: int | None = None):
    """The transformer layer spec (or, with MoE layers, the decoder block spec of this stage):
    transformer-engine's on GPU when installed (its attention does context parallelism and
    packed input itself), else Megatron's local spec with
    :class:`parallel.attention.ContextParallelAttention` as core attention
    (``core_attention="megatron"`` keeps Megatron's ``DotProductAttention``: the reference the
    parity tests compare against; it has no CP or packing). Raises ValueError for another
    ``core_attention``."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if core_attention not in ("megalign", "megatron"):
        raise ValueError(f"core_attention={core_attention!r}: expected 'megalign' or 'megatron'")
    te = _have_transformer_engine()
    if config.num_moe_experts:  # per-layer specs (dense or MoE, moe_layer_freq) for this stage
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                          vp_stage=vp_stage)
        layers = spec.layer_specs
    elif te:
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        layers = [spec]
    if not te and core_attention == "megalign":
        from parallel.attention import ContextParallelAttention

        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    return spec


def build_gpt_model(hf_config, config, *, vp_stage: int | None = None, share_embeddings: bool | None = None,
                    core_attention: str = "megalign"):
    """This rank's ``GPTModel`` shard (its TP slice of its PP stage's layers, its EP rank's
    experts), uninitialised weights. ``share_embeddings`` defaults to the HF config's
    ``tie_word_embeddings``; ``core_attention``: see :func:`layer_spec`.
    Raises ValueError for RoPE scaling types Megatron's local path cannot match."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    text = text_config(hf_config)
    scaling = (getattr(text, "rope_parameters", None) or {}).get("rope_type", "default")
    if scaling not in (None, "default"):
        raise ValueError(f"model.rope_scaling type {scaling!r} is not supported yet (only default RoPE)")
    d = model_dims(hf_config)
    kwargs = dict(
        config=config,
        transformer_layer_spec=layer_spec(config, core_attention, vp_stage),
        vocab_size=d.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=text.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=d.tie_word_embeddings if share_embeddings is None else share_embeddings,
        position_embedding_type="mrope" if d.is_vision_language else "rope",
        rotary_base=rope_theta(hf_config),
        vp_stage=vp_stage,
    )
    if d.is_vision_language:  # a vision tower on the first stage, M-RoPE (alignment/models/vlm_model.py)
        from alignment.models.vlm_model import VisionLanguageModel

        model = VisionLanguageModel(family_of(hf_config).vision, hf_config, d, **kwargs)
    else:
        model = GPTModel(**kwargs)
    if config.num_moe_experts:
        from megatron.core.transformer.moe.router import Router

        for module in model.modules():  # the aux loss is scaled by megatron_step.forward_backward instead
            if isinstance(module, Router):
                module.calculate_per_token_loss = False
    if not config.perform_initialization:
        mark_tensor_parallel_weights(model)
    return place_shard(model)


def mark_tensor_parallel_weights(model: torch.nn.Module) -> None:
    """Give the weights of ``model``'s column-/row-parallel linears and vocabulary-parallel
    embedding the ``tensor_model_parallel``/``partition_dim``/``partition_stride`` attributes that
    Megatron's initialisation sets (``_initialize_affine_weight_cpu``/``_gpu``).

    Why: megatron-core 0.16.1 sets them only while it initialises a weight, so a model built with
    ``perform_initialization=False`` would have TP-split weights that every consumer (gradient
    clipping's duplicate filter, megalign's HF export gather) takes for replicated ones. Strides
    as Megatron's: 2 for the fused ``[gate, up]`` ``linear_fc1`` of gated MLPs, else 1."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if weight is None or hasattr(weight, "tensor_model_parallel"):
            continue
        if isinstance(module, ColumnParallelLinear):
            gated = name.endswith("linear_fc1") and module.config.gated_linear_unit
            set_tensor_model_parallel_attributes(weight, True, 0, 2 if gated else 1)
        elif isinstance(module, RowParallelLinear):
            set_tensor_model_parallel_attributes(weight, True, 1, 1)
        elif isinstance(module, VocabParallelEmbedding):
            set_tensor_model_parallel_attributes(weight, True, 0, 1)


def place_shard(model: torch.nn.Module) -> torch.nn.Module:
    """Put a freshly built shard where Megatron-LM's ``get_model`` puts it: every parameter in
    ``params_dtype`` when bf16 (``Float16Module`` casts the norms too; the local spec builds
    them in fp32) and, on GPU, on this rank's device (the local spec builds norms on the CPU
    even without ``use_cpu_initialization``). Returns ``model``."""
    if model.config.bf16:
        model.bfloat16()
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model
