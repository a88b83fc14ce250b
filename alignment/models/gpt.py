"""Build Megatron-Core ``GPTModel`` shards for an HF Llama-family config.

The transformer-engine layer spec is used when transformer-engine is installed,
else Megatron's local spec (torch modules), which is what the CPU path runs.
Call after :func:`parallel.state.init_distributed`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignment.models.bridges.llama import LlamaDims


def _have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def transformer_config(hf_config, *, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                       sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                       virtual_pipeline_model_parallel_size: int | None = None,
                       context_parallel_size: int = 1, cp_comm_type: str = "p2p"):
    """Megatron ``TransformerConfig`` equal to an HF Llama config (RMSNorm, SwiGLU, RoPE, GQA, no bias).

    ``calculate_per_token_loss=True``: megalign's loss functions are already divided by
    the global token count, so Megatron must sum micro-batch losses and DP gradients
    rather than average them (see :mod:`alignment.trainers.megatron_step`).
    ``context_parallel_size``/``cp_comm_type``: see :class:`parallel.layout.ParallelLayout`.
    """
    from megatron.core.transformer import TransformerConfig

    d = LlamaDims.from_hf_config(hf_config)
    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=d.num_layers,
        hidden_size=d.hidden_size,
        num_attention_heads=d.num_attention_heads,
        num_query_groups=d.num_query_groups,
        kv_channels=d.head_dim,
        ffn_hidden_size=d.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=d.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        sequence_parallel=sequence_parallel,
        context_parallel_size=context_parallel_size,
        cp_comm_type=cp_comm_type,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=bf16,
        use_cpu_initialization=not torch.cuda.is_available(),
        calculate_per_token_loss=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
    )


def rope_theta(hf_config) -> float:
    """RoPE base from an HF config (``rope_theta`` or transformers 5's ``rope_parameters``)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))


def layer_spec(core_attention: str = "megalign"):
    """The transformer layer spec: transformer-engine's on GPU when installed (its attention
    does context parallelism and packed input itself), else Megatron's local spec with
    :class:`parallel.attention.ContextParallelAttention` as core attention
    (``core_attention="megatron"`` keeps Megatron's ``DotProductAttention``: the reference the
    parity tests compare against; it has no CP or packing)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if _have_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec()
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    if core_attention == "megalign":
        from parallel.attention import ContextParallelAttention

        spec.submodules.self_attention.submodules.core_attention = ContextParallelAttention
    elif core_attention != "megatron":
        raise ValueError(f"core_attention={core_attention!r}: expected 'megalign' or 'megatron'")
    return spec


def build_gpt_model(hf_config, config, *, vp_stage: int | None = None, share_embeddings: bool | None = None,
                    core_attention: str = "megalign"):
    """This rank's ``GPTModel`` shard (its TP slice of its PP stage's layers), uninitialised
    weights. ``share_embeddings`` defaults to the HF config's ``tie_word_embeddings``;
    ``core_attention``: see :func:`layer_spec`.
    Raises ValueError for RoPE scaling types Megatron's local path cannot match."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    scaling = (getattr(hf_config, "rope_parameters", None) or {}).get("rope_type", "default")
    if scaling not in (None, "default"):
        raise ValueError(f"model.rope_scaling type {scaling!r} is not supported yet (only default RoPE)")
    d = LlamaDims.from_hf_config(hf_config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(core_attention),
        vocab_size=d.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        share_embeddings_and_output_weights=d.tie_word_embeddings if share_embeddings is None else share_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        vp_stage=vp_stage,
    )
    return place_shard(model)


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
