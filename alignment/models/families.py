"""Model families by HF ``architectures``: which table (``alignment/models/<family>/``) maps a
model. Adding a family is one folder with a ``FAMILY`` (:class:`alignment.models.mapping.Family`)
and one line here."""

from __future__ import annotations

from alignment.models import llama, qwen2_5_vl, qwen3, qwen3_moe, qwen3_vl, qwen3_vl_moe
from alignment.models.bridge import HEAD_SUFFIX, Bridge
from alignment.models.dims import ModelDims
from alignment.models.mapping import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY, qwen2_5_vl.FAMILY,
                                 qwen3_vl.FAMILY, qwen3_vl_moe.FAMILY)


def architecture(hf_config) -> str:
    """The model's HF architecture (``architectures[0]``; ``LlamaForCausalLM`` when absent)."""
    return (getattr(hf_config, "architectures", None) or ["LlamaForCausalLM"])[0]


def supported_architectures() -> list[str]:
    """Every HF architecture megalign can train: each family's causal LMs and their sequence classifiers,
    and the vision-language models."""
    return sorted({a.replace(HEAD_SUFFIX["lm"], s) if f.causal_lm else a for f in FAMILIES for a in f.architectures
                   for s in HEAD_SUFFIX.values()})


def family_of(hf_config) -> Family:
    """The family of an HF config. Raises ValueError naming the architecture and the supported ones."""
    arch = architecture(hf_config)
    causal = arch.replace(HEAD_SUFFIX["score"], HEAD_SUFFIX["lm"])
    for family in FAMILIES:
        if causal in family.architectures:
            return family
    raise ValueError(f"model architecture {arch!r} is not supported; supported: {', '.join(supported_architectures())}")


def text_config(hf_config):
    """The language model's part of an HF config: ``text_config`` of a vision-language model, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config


def vllm_hf_overrides(hf_config) -> dict | None:
    """vLLM's ``hf_overrides`` for a model of this HF config (:attr:`Family.vllm_hf_overrides`); None for a family
    that needs none or an architecture no family covers (vLLM then runs it as it is)."""
    causal = architecture(hf_config).replace(HEAD_SUFFIX["score"], HEAD_SUFFIX["lm"])
    return next((f.vllm_hf_overrides for f in FAMILIES if causal in f.architectures), None)


def model_dims(hf_config) -> ModelDims:
    """:class:`ModelDims` of an HF config. Raises ValueError for an unsupported architecture or setting."""
    return family_of(hf_config).dims(hf_config)


def get_bridge(hf_config, head: str = "lm") -> Bridge:
    """The bridge of an HF config's model; ``head="score"`` for a reward model / critic (scalar
    head, HF ``score.weight``). Raises ValueError naming the supported architectures."""
    return Bridge(family_of(hf_config), model_dims(hf_config), head=head, architecture=architecture(hf_config))
