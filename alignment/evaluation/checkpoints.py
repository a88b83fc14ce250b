"""What ``tools/evaluate.py`` accepts as a checkpoint, made into an HF directory vLLM loads:
an HF directory, a ``.gguf`` file or ``smollm2`` (:func:`alignment.models.hf_assets.prepare_hf_dir`);
a converted Megatron checkpoint (``tools/convert_checkpoint.py import``'s ``hf_config/`` +
``megatron/``), a training checkpoint (``<output_dir>/checkpoints/step_N``, PPO's ``policy`` part)
or a run's output directory (its latest checkpoint, else its ``hf/`` export). Megatron checkpoints,
saved at any layout, are exported once (``convert_checkpoint.py export`` at TP = PP = 1) into the
cache, keyed by their files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alignment.cache import cache_root
from alignment.models.hf_assets import prepare_hf_dir
from alignment.trainers.eval_cache import cache_key
from alignment.training.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _is_hf_dir(p: Path) -> bool:
    return (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def megatron_source(path: Path) -> Path | None:
    """The Megatron checkpoint ``path`` names (a converted or training checkpoint, or a run's latest),
    or None when it names none.

    Raises:
        ValueError: an incomplete checkpoint (an interrupted save's ``*.tmp`` or ``*.parts``, or
            no ``metadata.json``), naming it and what to use instead.
    """

    if path.name.endswith((".tmp", ".parts", ".old")):
        raise ValueError(f"{path} is an incomplete checkpoint (an interrupted save); evaluate a complete "
                         f"step_N next to it (the latest: {latest_checkpoint(path.parent)})")
    if (path / "hf_config" / "config.json").is_file() and (path / "megatron").is_dir():
        return path
    if (path / "policy" / "config.yaml").is_file():  # PPO: policy and critic parts
        path = path / "policy"
    if (path / "config.yaml").is_file() and (path / "common.pt").is_file():
        if not (path / "metadata.json").is_file():
            raise ValueError(f"{path} has no metadata.json: an incomplete checkpoint; evaluate a complete one")
        return path
    if (path / "checkpoints").is_dir():
        latest = latest_checkpoint(path / "checkpoints")
        if latest is not None:
            return megatron_source(latest)
    return None


def _export(src: Path) -> Path:
    files = sorted((str(p.relative_to(src)), p.stat().st_size, p.stat().st_mtime_ns)
                   for p in src.rglob("*") if p.is_file())
    out = cache_root() / "evaluate" / "hf" / cache_key({"megatron": str(src.resolve()), "files": files})
    if _is_hf_dir(out):
        return out
    print(f"exporting {src} to an HF directory (once: {out})", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "tools" / "convert_checkpoint.py"), "export", str(src), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"exporting {src} failed:\n{done.stderr[-3000:]}")
    return out


def resolve(path: str) -> Path:
    """The HF directory to evaluate for ``path`` (see the module docstring).

    Raises:
        FileNotFoundError: nothing at ``path`` (and not a known model name).
        ValueError: an incomplete checkpoint.
        RuntimeError: the export of a Megatron checkpoint failed (with its error).
    """
    p = Path(path)
    if p.is_dir():
        if _is_hf_dir(p):
            return p
        src = megatron_source(p)
        if src is not None:
            return _export(src)
        if _is_hf_dir(p / "hf"):
            return p / "hf"
        raise FileNotFoundError(f"{p}: neither an HF directory (config.json + *.safetensors) nor a Megatron "
                                "checkpoint (hf_config/ + megatron/, or a training run's checkpoints/step_N)")
    if p.suffix == ".gguf" or not p.exists():

        try:
            return Path(prepare_hf_dir(path))
        except (FileNotFoundError, ValueError) as e:
            raise FileNotFoundError(f"checkpoint {path!r}: no such directory or known model ({e})") from e
    raise FileNotFoundError(f"checkpoint {path!r}: not a directory, .gguf file or known model")
