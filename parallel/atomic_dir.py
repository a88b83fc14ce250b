"""A directory that all ranks write and that appears complete or not at all: every rank writes
into ``<final>.tmp`` (:func:`fresh_tmp`), then rank 0 lists every file and its size in
``manifest.json`` and renames the directory into place (:func:`publish`). A crash before the
rename leaves only ``*.tmp``, which no reader takes for a finished directory; a file cut short
later (a copy, a full disk) is found by comparing it with the manifest."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist

MANIFEST = "manifest.json"


def write_manifest(directory: Path) -> None:
    """Write ``directory/manifest.json``: ``{"files": {relative path: size in bytes}}`` of every
    file below ``directory`` (the manifest itself excluded)."""
    files = {str(p.relative_to(directory)): p.stat().st_size for p in sorted(directory.rglob("*"))
             if p.is_file() and p.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=0))


def fresh_tmp(final: Path) -> Path:
    """``<final>.tmp``, emptied and created by rank 0 (what a crashed write left there is removed);
    all ranks wait for it. Needs an initialised process group."""
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    return tmp


def publish(tmp: Path, final: Path) -> None:
    """After every rank has written into ``tmp``: rank 0 writes its manifest and swaps it into
    ``final`` (an older ``final`` is moved aside first and removed after the rename); all ranks
    wait before and after."""
    dist.barrier()
    if dist.get_rank() == 0:
        write_manifest(tmp)
        if final.exists():
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    dist.barrier()
