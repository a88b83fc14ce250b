"""What every HF export of megalign must be for the tools that read it (transformers, PEFT, vLLM): a
``config.json`` whose ``dtype`` is its tensors', and the model's own tokenizer files, with a tokenizer class
that transformers ships (never a wrapper's, such as vLLM's cached tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path


def check_export(hf: Path, base: Path) -> None:
    """``hf`` (an export) against ``base`` (the model it was trained from): the dtype in ``config.json`` is the
    safetensors tensors'; the tokenizer files are the base's, byte for byte, their class one of transformers';
    transformers loads the tokenizer and the config, vLLM's loaders read the config, the tokenizer and every
    tensor. Raises AssertionError naming what differs."""
    import torch
    import transformers
    from safetensors import safe_open

    config = json.loads((hf / "config.json").read_text())
    dtypes = set()
    for f in sorted(hf.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            dtypes |= {st.get_slice(k).get_dtype() for k in st.keys()}
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    assert {names[d] for d in dtypes} == {config.get("dtype") or config.get("torch_dtype")}, (dtypes, config.get("dtype"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (base / name).is_file():
            assert (hf / name).read_bytes() == (base / name).read_bytes(), f"{name} is not the base model's"
    cls = json.loads((hf / "tokenizer_config.json").read_text()).get("tokenizer_class")
    assert cls is None or hasattr(transformers, cls), f"tokenizer_class {cls} is not one transformers ships"
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    assert tok.get_vocab() == transformers.AutoTokenizer.from_pretrained(base).get_vocab()
    assert getattr(transformers.AutoConfig.from_pretrained(hf), "dtype", None) == getattr(torch, config["dtype"])
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.tokenizers import get_tokenizer
    from vllm.transformers_utils.config import get_config

    assert get_config(str(hf), trust_remote_code=False).vocab_size == config.get("vocab_size",
                                                                                   config.get("text_config", {}).get("vocab_size"))
    assert get_tokenizer(str(hf)).get_vocab() == tok.get_vocab()
    loaded = dict(safetensors_weights_iterator([str(f) for f in sorted(hf.glob("*.safetensors"))], False))
    assert loaded and {t.dtype for t in loaded.values()} == {getattr(torch, config["dtype"])}
