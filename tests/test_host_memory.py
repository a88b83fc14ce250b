"""Host memory handed back to the OS (alignment/training/host_memory.py), in a fresh process each
so that the allocator settings of the test process stay as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FRAGMENT = r"""
import re, sys
sys.path.insert(0, sys.argv[1])
from alignment.training.host_memory import release_free_heap, return_freed_memory_to_os
def rss_mib():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
assert return_freed_memory_to_os()
big, pins = [], []
for _ in range(2000):  # 100 KiB blocks (below the 1 MiB mmap threshold: heap), each pinned in place
    big.append(bytearray(100 << 10))
    pins.append(bytearray(1024))  # above pymalloc's 512 bytes: from the same heap
before = rss_mib()
del big  # 195 MiB freed between live blocks: not at the heap's top, so glibc keeps it resident
freed = rss_mib()
released = release_free_heap()
print(before, freed, rss_mib(), released)
"""


def test_release_free_heap_returns_a_fragmented_heap_to_the_os():
    out = subprocess.run([sys.executable, "-c", FRAGMENT, str(ROOT)], capture_output=True, text=True, check=True)
    before, freed, after, released = out.stdout.split()
    before, freed, after = float(before), float(freed), float(after)
    assert released == "True"
    assert freed > before - 40, (before, freed)  # free() alone kept (nearly) all of it
    assert after < freed - 150, (freed, after)  # malloc_trim handed >= 150 of the 195 MiB back


def test_onednn_primitive_cache_bound_unless_set(monkeypatch):
    from alignment.training.host_memory import ONEDNN_CACHE_ENTRIES, bound_onednn_primitive_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    bound_onednn_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == os.environ["LRU_CACHE_CAPACITY"] == "64"
    assert ONEDNN_CACHE_ENTRIES == 64
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")  # the user's choice wins
    bound_onednn_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


SHAPES = r"""
import os, re, sys
sys.path.insert(0, sys.argv[1])
if sys.argv[2] == "bounded":
    from alignment.training.host_memory import bound_onednn_primitive_cache
    bound_onednn_primitive_cache()
import torch
torch.set_num_threads(1)
def rss_mib():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) / 1024
w, x = torch.randn(1536, 576, dtype=torch.bfloat16), torch.randn(700, 576, dtype=torch.bfloat16)
for n in range(1, 100):  # warm-up: libraries loaded, caches full when bounded
    torch.nn.functional.linear(x[:n], w)
before = rss_mib()
for n in range(100, 700):  # 600 new token counts, as packed micro-batches bring
    torch.nn.functional.linear(x[:n], w)
print(rss_mib() - before)
"""


def _cpu_capability() -> str:
    import torch

    return torch.backends.cpu.get_cpu_capability()


@pytest.mark.skipif(not _cpu_capability().startswith("AVX512"),
                    reason="bf16 matmuls go through oneDNN (and its caches) only on AVX-512 CPUs; on this one "
                           "(no AVX-512) they take PyTorch's reference GEMM, which caches nothing")
def test_bounded_matmul_caches_stop_growing_with_new_shapes():
    """bf16 matmuls of 600 new shapes: unbounded, oneDNN's and ideep's caches keep every one
    (~400 MiB measured); bounded, the resident set grows by a fraction of that (~66 MiB)."""
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    grow = {how: float(subprocess.run([sys.executable, "-c", SHAPES, str(ROOT), how], capture_output=True, text=True,
                                      check=True, env=env).stdout) for how in ("unbounded", "bounded")}
    assert grow["unbounded"] > 200, grow
    assert grow["bounded"] < grow["unbounded"] / 3, grow
