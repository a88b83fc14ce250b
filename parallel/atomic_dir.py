"""A directory that all ranks write and that appears complete or not at all: every rank writes
into ``<final>.tmp`` (:func:`fresh_tmp`), then rank 0 lists every file and its size in
``manifest.json`` and renames the directory into place (:func:`publish`; over an older one, in one
atomic swap). A crash before the rename leaves only ``*.tmp``, which no reader takes for a finished
directory; a file cut short later (a copy, a full disk) is found by comparing it with the manifest."""

from __future__ import annotations

import ctypes
import errno
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


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``, 3.15+,
    glibc 2.28+): at every moment each name holds one complete directory. False where the C library
    or the filesystem cannot (some network filesystems), nothing changed.

    Raises:
        OSError: the exchange failed for another reason (a path missing, permissions).
    """
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def publish(tmp: Path, final: Path) -> None:
    """After every rank has written into ``tmp``: rank 0 writes its manifest and puts it at
    ``final``; all ranks wait before and after. An older ``final`` (a step written again) is
    swapped with ``tmp`` in one atomic step (:func:`exchange`) and then removed, so a kill at any
    moment leaves ``final`` whole, old or new (the old one left as ``<final>.tmp`` is ignored by
    readers and cleared by the next :func:`fresh_tmp`). Where the filesystem cannot swap, the old one
    is moved aside to ``<final>.old`` first, with a moment between the two renames where a kill
    leaves no ``final``."""
    dist.barrier()
    if dist.get_rank() == 0:
        write_manifest(tmp)
        if not final.exists():
            os.replace(tmp, final)
        elif exchange(tmp, final):
            shutil.rmtree(tmp, ignore_errors=True)  # now the old directory
        else:
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>
