"""Every parallel layout of a cluster for a model, its memory per GPU, and the one to use.

:func:`enumerate_layouts` lists each (TP, PP, CP, DP) with ``TP x PP x CP x DP`` = the number
of GPUs that :func:`parallel.layout.validate_layout` accepts, with tensor parallelism inside
a node (and, for a mixture-of-experts model, each expert-parallel size EP with whole experts per
rank, expert TP = 1, as Megatron-Bridge's MoE recipes use); :func:`plan` adds the estimate of
:mod:`parallel.memory` and whether it fits; :func:`recommend` picks one. Pure functions: no
process groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.layout import LayoutError, ParallelLayout, divisors, validate_model_layout
from parallel.memory import MemoryBreakdown, RolloutPlan, estimate_memory

RULE = ("the fitting layout with the smallest model-parallel size TP x PP x CP, i.e. the largest DP "
        "(model parallelism only as large as needed, then data parallelism: Narayanan et al. 2021, "
        "Megatron-LM on GPU clusters, Sec. 3); among equals the fewest pipeline stages (no bubble), "
        "then CP=1, then (MoE) the smallest EP (all-to-all traffic grows with it), then the least memory")


@dataclass(frozen=True)
class Refused:
    """A (TP, PP, CP, EP) that cannot run this model on this cluster, and why."""

    tp: int
    pp: int
    cp: int
    reason: str
    ep: int = 1


@dataclass(frozen=True)
class Candidate:
    """A valid layout, its per-GPU memory (largest stage) and whether it fits in the usable memory."""

    layout: ParallelLayout
    memory: MemoryBreakdown
    fits: bool


def enumerate_layouts(dims, *, nodes: int, gpus_per_node: int, seq_length: int, sequence_parallel: bool = True,
                      cp_comm_type: str = "p2p",
                      virtual_pipeline_size: int | None = None) -> tuple[list[ParallelLayout], list[Refused]]:
    """All ``(TP, PP, CP)`` whose product divides ``nodes * gpus_per_node`` (DP is the rest),
    split into valid layouts and refused ones with the reason.

    Refused: TP that does not divide ``gpus_per_node`` (tensor parallelism all-reduces in every
    layer, so Megatron users keep it on a node's NVLink), TP that does not divide the MLP size
    (``ColumnParallelLinear`` splits it), a sequence the context-parallel zig-zag split cannot
    halve (``seq_length % (2 * CP)``), layers that ``PP x virtual`` does not divide, and whatever
    :func:`parallel.layout.validate_layout` refuses (heads and KV heads per TP, Ulysses heads).
    ``sequence_parallel`` applies to layouts with TP > 1.
    """
    world, vpp = nodes * gpus_per_node, virtual_pipeline_size
    experts = getattr(dims, "num_experts", 0)
    valid, refused = [], []
    for tp in divisors(world):
        for pp in divisors(world // tp):
            for cp in divisors(world // (tp * pp)):
                # EP: whole experts per rank (expert TP 1); the expert grid EP x PP must divide the world
                for ep in [e for e in divisors(experts) if (world // pp) % e == 0] if experts else [1]:
                    layout = ParallelLayout(world_size=world, tensor_model_parallel_size=tp,
                                            pipeline_model_parallel_size=pp,
                                            sequence_parallel=sequence_parallel and tp > 1,
                                            context_parallel_size=cp, cp_comm_type=cp_comm_type,
                                            virtual_pipeline_model_parallel_size=vpp if pp > 1 else None,
                                            expert_model_parallel_size=ep,
                                            expert_tensor_parallel_size=1 if experts else None)
                    reason = _why_not(dims, layout, gpus_per_node, seq_length)
                    if reason:
                        refused.append(Refused(tp, pp, cp, reason, ep))
                        if ep == 1:  # the dense grid is refused: every EP would be, for the same reason
                            break
                    else:
                        valid.append(layout)
    return valid, refused


def _why_not(dims, layout: ParallelLayout, gpus_per_node: int, seq_length: int) -> str | None:
    tp, pp, cp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.context_parallel_size
    if gpus_per_node % tp:
        return f"TP={tp} spans nodes ({gpus_per_node} GPUs per node): keep tensor parallelism within a node"
    if dims.ffn_hidden_size % tp:
        return f"TP={tp} does not divide the MLP size {dims.ffn_hidden_size}"
    if cp > 1 and seq_length % (2 * cp):
        return f"CP={cp}: the sequence length {seq_length} is not a multiple of 2 x CP (zig-zag split)"
    vpp = layout.virtual_pipeline_model_parallel_size
    if vpp and dims.num_layers % (pp * vpp):
        return f"PP={pp} x virtual {vpp} does not divide the {dims.num_layers} layers"
    try:
        validate_model_layout(layout, dims, prefix="")
    except LayoutError as e:
        return str(e)
    return None


def plan(dims, *, nodes: int, gpus_per_node: int, gpu_memory_bytes: int, headroom: float = 0.1,
         dtype: str = "bfloat16", micro_batch_size: int = 1, seq_length: int = 4096,
         distributed_optimizer: bool = False, num_microbatches: int | None = None,
         rollout: RolloutPlan | None = None, sequence_parallel: bool = True, cp_comm_type: str = "p2p",
         virtual_pipeline_size: int | None = None, lora_rank: int = 0) -> tuple[list[Candidate], list[Refused]]:
    """Every valid layout with its :func:`parallel.memory.estimate_memory` (largest stage) and
    whether ``total <= (1 - headroom) * gpu_memory_bytes``; plus the refused layouts.

    ``headroom``: the fraction of each GPU kept for what the estimate leaves out (CUDA context,
    NCCL buffers, allocator fragmentation). Other arguments: see :func:`estimate_memory`.
    Candidates are sorted by model-parallel size, PP, CP.
    Raises ValueError for ``headroom`` outside [0, 1) and whatever ``estimate_memory`` raises.
    """
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom={headroom}: must be in [0, 1)")
    usable = (1 - headroom) * gpu_memory_bytes
    layouts, refused = enumerate_layouts(dims, nodes=nodes, gpus_per_node=gpus_per_node, seq_length=seq_length,
                                         sequence_parallel=sequence_parallel, cp_comm_type=cp_comm_type,
                                         virtual_pipeline_size=virtual_pipeline_size)
    out = []
    for layout in layouts:
        mem = estimate_memory(dims, layout, dtype=dtype, micro_batch_size=micro_batch_size, seq_length=seq_length,
                              distributed_optimizer=distributed_optimizer, num_microbatches=num_microbatches,
                              rollout=rollout, lora_rank=lora_rank)
        out.append(Candidate(layout, mem, mem.total <= usable))
    out.sort(key=_preference)
    return out, refused


def _preference(c: Candidate) -> tuple:
    lay = c.layout
    return (lay.model_parallel_size, lay.pipeline_model_parallel_size, lay.context_parallel_size,
            lay.expert_model_parallel_size, c.memory.total)


def recommend(candidates: list[Candidate]) -> Candidate | None:
    """The layout to use by :data:`RULE`, or ``None`` when none fits."""
    fitting = [c for c in candidates if c.fits]
    return min(fitting, key=_preference) if fitting else None
