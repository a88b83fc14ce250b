"""Process groups: start ``torch.distributed`` from the launcher's environment and
build Megatron-Core's tensor/pipeline/data-parallel groups for a :class:`ParallelLayout`.

Works under ``torchrun`` (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``), under ``srun``
(``SLURM_PROCID``/``SLURM_NTASKS``/``SLURM_LOCALID``) and as a plain single process.
Uses NCCL when a GPU is present, else gloo plus :mod:`parallel.cpu_compat`.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as dist

from parallel import cpu_compat
from parallel.layout import ParallelLayout
from parallel.stateless_group import StatelessGroup


def on_gpu() -> bool:
    """True when CUDA is available (NCCL + GPU kernels); False selects gloo + :mod:`parallel.cpu_compat`."""
    return torch.cuda.is_available()


def comm_device() -> torch.device:
    """Where host-made tensors go before a collective: this rank's GPU under NCCL (which has no
    CPU tensors), the CPU under gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if on_gpu() else torch.device("cpu")


def env_world() -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from torchrun or Slurm variables; ``(0, 1, 0)`` alone."""
    if "RANK" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    if "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), int(os.environ.get("SLURM_LOCALID", 0))
    return 0, 1, 0


#: the subgroups :func:`init_distributed` made on this rank (Megatron's and the replica groups)
_GROUPS: list = []


@contextlib.contextmanager
def _recording_groups():
    """Record every group ``torch.distributed.new_group`` makes in the block into :data:`_GROUPS`.

    Why: Megatron-Core's ``destroy_model_parallel`` only forgets its groups (it sets its globals to
    ``None``), so each re-initialisation leaves the previous layout's groups alive. Under gloo every
    live group keeps threads polling its sockets: after 15 re-initialisations on 4 ranks an
    all-reduce on the default group ran 16x slower (2 cores). :func:`_destroy_groups` ends them.
    """
    real = dist.new_group

    def new_group(*args, **kwargs):
        group = real(*args, **kwargs)
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            _GROUPS.append(group)
        return group

    dist.new_group = new_group
    try:
        yield
    finally:
        dist.new_group = real


def _destroy_groups() -> None:
    """Destroy the subgroups of the previous :func:`init_distributed` (the default group stays)."""
    while _GROUPS:
        dist.destroy_process_group(_GROUPS.pop())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(layout: ParallelLayout, seed: int = 1234, timeout_minutes: float = 60,
                     rollout_ranks: int = 0) -> None:
    """Start the default process group and Megatron's model-parallel groups.

    ``timeout_minutes``: how long any collective of these groups waits for the other ranks before
    it raises. Call only after :func:`parallel.layout.validate_layout` passed. Idempotent for the
    default group; (re)builds Megatron's groups for ``layout`` each call, so tests can
    try several layouts in one launch.

    ``rollout_ranks`` = R > 0 (``rollout.placement=disaggregated``): the launcher started
    ``layout.world_size + R`` processes; the first ``layout.world_size`` train (their default group
    and Megatron's groups span only them) and the last R only generate (a default group of
    their own, for the engines' tensor parallelism, and no Megatron groups; see
    :func:`is_rollout_rank`). A :class:`parallel.stateless_group.StatelessGroup` over all of them
    (:func:`trainer_rollout_group`) carries prompts, samples and weights between the two.

    Raises:
        ValueError: the launcher started a different number of processes.
        RuntimeError: several processes but no ``MASTER_PORT`` (not started by torchrun or srun).
    """
    global _OWN_DEFAULT_GROUP
    rank, world_size, local_rank = env_world()
    if world_size != layout.world_size + rollout_ranks:
        split = f" + rollout.rollout_ranks={rollout_ranks}" if rollout_ranks else ""
        raise ValueError(f"layout.world_size={layout.world_size}{split} but the launcher started {world_size} "
                         "processes")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if world_size > 1:
                raise RuntimeError("MASTER_PORT is not set: launch with torchrun or srun (docs/guides/clusters.md)")
            os.environ["MASTER_PORT"] = str(_free_port())
        if on_gpu():
            torch.cuda.set_device(local_rank)
        timeout = datetime.timedelta(minutes=timeout_minutes)
        backend = "nccl" if on_gpu() else "gloo"
        if rollout_ranks:
            _init_split_worlds(rank, world_size, layout.world_size, backend, timeout)
        else:
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size, timeout=timeout)
        _OWN_DEFAULT_GROUP = True
    if is_rollout_rank():
        return

    cpu_compat.apply_without_transformer_engine()
    cpu_compat.checkpoint_writer_dies_with_rank()
    if not on_gpu():
        cpu_compat.apply()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    _destroy_groups()  # first: Megatron's destroy skips its gloo groups already destroyed
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    with _recording_groups():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor_model_parallel_size,
            pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
            context_parallel_size=layout.context_parallel_size,
            expert_model_parallel_size=layout.expert_model_parallel_size,
            expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
            distributed_timeout_minutes=timeout_minutes,
        )
        _build_replica_group(datetime.timedelta(minutes=timeout_minutes))
    if on_gpu():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        cpu_compat.model_parallel_manual_seed(seed)


_REPLICA_GROUP = None
_TRAINER_ROLLOUT_GROUP = None  # StatelessGroup joining trainer and rollout ranks (disaggregated placement)
_ROLLOUT_RANK = False
_STORE = None  # the TCPStore of the split worlds (rank 0 may serve it: keep it alive)
_OWN_DEFAULT_GROUP = False  # init_distributed started the default group (shutdown() then ends it)


def _init_split_worlds(rank: int, world_size: int, trainers: int, backend: str, timeout) -> None:
    """Trainers (ranks < ``trainers``) and rollout ranks each get a default group of their own
    over the launcher's store (key prefixes ``trainers`` / ``rollout``), and a stateless group
    joins all ``world_size`` ranks (prefix ``bridge``)."""
    global _TRAINER_ROLLOUT_GROUP, _ROLLOUT_RANK, _STORE

    _STORE, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=timeout))
    _ROLLOUT_RANK = rank >= trainers
    if _ROLLOUT_RANK:
        dist.init_process_group(backend=backend, store=dist.PrefixStore("rollout", _STORE), rank=rank - trainers,
                                world_size=world_size - trainers, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.PrefixStore("trainers", _STORE), rank=rank,
                                world_size=trainers, timeout=timeout)
    _TRAINER_ROLLOUT_GROUP = StatelessGroup(_STORE, rank, world_size, prefix="bridge",
                             timeout_minutes=timeout.total_seconds() / 60)


def is_rollout_rank() -> bool:
    """True on a rank that only generates (``rollout.placement=disaggregated``; set by :func:`init_distributed`)."""
    return _ROLLOUT_RANK


def trainer_rollout_group():
    """The :class:`parallel.stateless_group.StatelessGroup` of every rank of a disaggregated job
    (trainers first, then the rollout ranks); ``None`` in a colocated job."""
    return _TRAINER_ROLLOUT_GROUP


def _build_replica_group(timeout: datetime.timedelta) -> None:
    """One group per data-parallel index: the TP x CP x PP ranks of one model replica (collectives
    time out after ``timeout``)."""
    global _REPLICA_GROUP
    from megatron.core import parallel_state as ps

    dp_ranks = [None] * dist.get_world_size()
    dist.all_gather_object(dp_ranks, ps.get_data_parallel_rank())
    mine = ps.get_data_parallel_rank()
    for d in sorted(set(dp_ranks)):  # every rank creates every group, in the same order
        group = dist.new_group([r for r, x in enumerate(dp_ranks) if x == d], timeout=timeout)
        if d == mine:
            _REPLICA_GROUP = group


def replica_group() -> dist.ProcessGroup:
    """The ranks that hold one model replica and the same data: tensor x context x pipeline
    parallel (Megatron's model-parallel group is TP x PP only). Set by :func:`init_distributed`."""
    if _REPLICA_GROUP is None:
        raise RuntimeError("replica_group() before init_distributed()")
    return _REPLICA_GROUP


def shutdown() -> None:
    """Destroy Megatron's groups and the default process group, when :func:`init_distributed`
    started it. A default group the caller started stays (its subgroups end): a process that
    runs several jobs in turn, e.g. the tests' workers, starts it once per job over a store prefix
    of the job's own, since a second start over torchrun's store with the same keys would wait on
    the first one's forever. (vLLM's engine teardown may have ended the default group already.)"""
    from megatron.core import parallel_state as ps

    global _REPLICA_GROUP, _TRAINER_ROLLOUT_GROUP, _ROLLOUT_RANK, _STORE, _OWN_DEFAULT_GROUP
    _REPLICA_GROUP, _TRAINER_ROLLOUT_GROUP, _ROLLOUT_RANK, _STORE = None, None, False, None
    if not dist.is_initialized() or _OWN_DEFAULT_GROUP:
        _GROUPS.clear()  # ended with the default group (now, or by vLLM's teardown)
    _destroy_groups()  # first: Megatron's destroy skips its gloo groups already destroyed
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWN_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_DEFAULT_GROUP = False
