"""Host (CPU) memory handed back to the OS: glibc ``mallopt`` thresholds, ``malloc_trim`` between
the phases of a step, and a bounded oneDNN primitive cache.

Why: on CPU the trainer, the reference model and the vLLM engine share one process heap, and
glibc keeps freed memory mapped:

- glibc raises its mmap threshold every time a large block is freed (up to 32 MiB), after which
  blocks below it come from the heap and stay mapped once freed. A job that frees and re-creates
  activations, logits and optimizer temporaries of a few MiB to tens of MiB every step then grows
  its resident set step after step (measured: +0.68 GiB between the first and second GRPO step
  of SmolLM2-135M, +0.12 GiB with the thresholds fixed). Fixing both thresholds (``man 3
  mallopt``: setting ``M_MMAP_THRESHOLD`` disables the dynamic adjustment) makes every block of
  1 MiB or more its own mapping, unmapped when freed (:func:`return_freed_memory_to_os`).
- Blocks below the threshold (per-layer weight gradients, key/value projections, norms of a
  packed micro-batch) still fragment the heap: after a GRPO training phase of the main job
  0.4-0.7 GiB of freed heap stayed resident, and the next phases' peaks came on top of it.
  ``malloc_trim(0)`` at each phase boundary hands those pages back in 10-80 ms
  (:func:`release_free_heap`), as ``torch.cuda.empty_cache()`` does for the CUDA caching
  allocator between phases: a step then starts from 3.3-3.4 GiB live.
- The bf16 matmuls on CPU are cached per shape twice: by oneDNN (its primitive cache) and by
  PyTorch's ideep layer above it (an LRU cache of ideep's computations), each up to 1024 entries
  by default. Packed micro-batches and prompt trees have a new token count at almost every
  step, so the caches grew by ~30 MB per step for the whole run (measured: 600 distinct shapes
  of one linear layer add 414 MiB; 373 with only ideep's capped at 64, 265 with only oneDNN's,
  66 with both; the main job's step-start RSS then stays flat instead of +20 MB per step).
  :func:`bound_onednn_primitive_cache` caps both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
THRESHOLD_BYTES = 1 << 20
ONEDNN_CACHE_ENTRIES = 64


def _libc():
    """glibc's handle, or None where the C library is not glibc (or has no ``mallopt``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    return libc


def return_freed_memory_to_os(threshold_bytes: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold_bytes`` for this process.

    Returns True when applied; False where the C library is not glibc (nothing changes)."""
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes)) and bool(libc.mallopt(M_TRIM_THRESHOLD, threshold_bytes))


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the OS (glibc ``malloc_trim(0)``, every arena).

    Returns True when some memory was released; False when none was, or the C library is not glibc."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


def bound_onednn_primitive_cache(entries: int = ONEDNN_CACHE_ENTRIES) -> None:
    """Cap oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and PyTorch's ideep
    computation cache (``LRU_CACHE_CAPACITY``) at ``entries`` each, unless a variable is already
    set. Both are read when the first primitive is created, so call this before the first CPU
    matmul of the process."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))
