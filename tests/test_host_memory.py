"""Host memory handed back to the OS (alignment/trainers/host_memory.py), in a fresh process each
so that the allocator settings of the test process stay as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FRAGMENT = r"""
import re, sys
sys.path.insert(0, sys.argv[1])
from alignment.trainers.host_memory import release_free_heap, return_freed_memory_to_os
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
    from alignment.trainers.host_memory import ONEDNN_CACHE_ENTRIES, bound_onednn_primitive_cache

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_onednn_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_CACHE_ENTRIES) == "64"
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")  # the user's choice wins
    bound_onednn_primitive_cache()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"
