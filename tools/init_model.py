"""A randomly initialised HF model from an architecture config, with a real tokenizer: to try a
model family, a layout or the RL loop on a model the hub cannot provide here.

    python tools/init_model.py qwen3-moe-tiny outputs/qwen3_moe_tiny      # a shipped config
    python tools/init_model.py path/to/config.json OUT --tokenizer smollm2 --seed 0

``CONFIG``: a name in ``tools/model_configs/`` or a ``config.json``; its ``vocab_size`` must hold
the tokenizer (``--tokenizer``: an HF directory or ``smollm2``, default). Weights follow the HF
model's own initialisation (``initializer_range``), in float32; the directory (config,
safetensors, tokenizer) loads with ``transformers`` and vLLM and trains with every megalign job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

from alignment.models.families import family_of  # noqa: E402
from alignment.models.hf_assets import prepare_hf_dir  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent / "model_configs"


def init_model(config: str, out: str | os.PathLike, tokenizer: str = "smollm2", seed: int = 0) -> Path:
    """Write a random model of ``config`` with ``tokenizer``'s files to ``out``; returns ``out``.

    Raises:
        ValueError: an unknown config name, an architecture megalign does not train, or a
            vocabulary smaller than the tokenizer (naming the fields).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = CONFIG_DIR / f"{config}.json" if (CONFIG_DIR / f"{config}.json").is_file() else Path(config)
    if not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))
        raise ValueError(f"config {config!r}: not found; give a config.json or a shipped config ({shipped})")
    fields = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    family_of(cfg)
    tok = AutoTokenizer.from_pretrained(prepare_hf_dir(tokenizer))
    if len(tok) > cfg.vocab_size:
        raise ValueError(f"config {config}: vocab_size={cfg.vocab_size} is smaller than the tokenizer's {len(tok)} "
                         f"tokens; set vocab_size >= {len(tok)}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description="A randomly initialised HF model from an architecture config")
    ap.add_argument("config", help="a shipped config name (tools/model_configs/) or a config.json")
    ap.add_argument("out", help="output HF directory")
    ap.add_argument("--tokenizer", default="smollm2", help="an HF directory or smollm2 (default)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        out = init_model(args.config, args.out, args.tokenizer, args.seed)
    except ValueError as e:
        ap.error(str(e))
    print(out)
    return out


if __name__ == "__main__":
    main()
