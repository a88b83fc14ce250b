"""An HF model directory's files, checked before anything loads them, so a damaged or incomplete
download ends in one message naming the field, the file and the fix, instead of a library's error
that names neither (safetensors' ``Error while deserializing header: incomplete metadata``,
transformers' "Couldn't instantiate the backend tokenizer").

Checked: ``config.json`` is JSON; every ``*.safetensors`` file's header reads and covers the whole
file (``safetensors.safe_open``: a file cut short or a garbled header fails); the shards an
``model.safetensors.index.json`` names exist; and, for a model whose tokenizer the job loads, the
tokenizer's files are there. A tensor's bytes changed in place keep the header valid and are not
caught here (safetensors has no checksum).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from alignment.schema import ConfigError

#: the file sets a fast tokenizer is built from (any one suffices): tokenizers' own file, a BPE
#: vocabulary with its merges, or a SentencePiece model
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",))
WEIGHT_INDEX = "model.safetensors.index.json"


def check_hf_dir(path: str | Path, field: str, *, tokenizer: bool = False) -> None:
    """Check the HF directory ``path``, given as the config field ``field`` (e.g. ``model.path``),
    before it is loaded; ``tokenizer``: the job loads its tokenizer too.

    Raises:
        FileNotFoundError: no ``config.json``, no weight files, a shard the index names, or (with
            ``tokenizer``) no tokenizer files.
        ConfigError: ``config.json`` is not JSON, or a weight file is damaged (named, with its size).
    """
    p = Path(path).expanduser()
    config = p / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{field}={path}: no config.json there; give an HF model directory")
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else e.reason
        raise ConfigError(f"{field}={path}: config.json is not JSON ({where}); download or export the model "
                          "again") from e
    weights = sorted(p.glob("*.safetensors"))
    if (p / WEIGHT_INDEX).is_file():
        try:
            shards = sorted(set(json.loads((p / WEIGHT_INDEX).read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ConfigError(f"{field}={path}: {WEIGHT_INDEX} is not an index of shards ({e}); download or export "
                              "the model again") from e
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{field}={path}: {', '.join(missing[:3])} named by {WEIGHT_INDEX} "
                                    f"{'is' if len(missing) == 1 else 'are'} missing; download or export the "
                                    "model again")
    if not weights and not any(p.glob("*.bin")):
        raise FileNotFoundError(f"{field}={path}: no weight files (*.safetensors) there; download or export the "
                                "model again")
    for w in weights:
        try:
            with safe_open(str(w), framework="numpy"):
                pass
        except SafetensorError as e:
            raise ConfigError(f"{field}={path}: {w.name} is damaged ({e}; the file has {w.stat().st_size:,} "
                              "bytes): a download or copy cut short; download or export the model again") from e
    if tokenizer and not any(all((p / f).is_file() for f in group) for group in TOKENIZER_FILES):
        raise FileNotFoundError(f"{field}={path}: no tokenizer files (tokenizer.json, vocab.json + merges.txt, or "
                                "tokenizer.model); copy them from the model the weights came from")
