"""LoRA adapters on Megatron-Core's tensor-parallel linears (Hu et al. 2021, "LoRA: Low-Rank
Adaptation of Large Language Models", eq. 3: ``h = W x + (alpha / r) B A x``).

A linear ``W [out, in]`` gains ``A [r, in]`` and ``B [out, r]``; its output becomes
``x W^T + scale * dropout(x) A^T B^T`` with ``scale = alpha / r``. ``A`` starts as PEFT's
``LoraLayer.reset_lora_parameters`` draws it (Kaiming-uniform, a = sqrt(5)) and ``B`` at zero,
so the adapted model starts exactly equal to the base. Under tensor parallelism (TP) the
adapters are split the way the base weight is, so that no rank holds more than its share of
``W``'s rows or columns and the base linear's own communication is untouched:

- column-parallel ``W`` (rows split, ``linear_qkv`` / ``linear_fc1``): ``A`` replicated, ``B``
  split by rows like ``W`` (same stride: the fused ``[gate; up]`` rows of a gated MLP). Each
  rank computes ``h = x A^T [.., r]`` from the full input and its rows ``h B_i^T``. Without
  sequence parallelism (SP) ``h`` enters the TP region with ``copy_to_tensor_model_parallel_region``
  (backward: all-reduce of ``dh`` over TP, so every rank's ``dA = dh^T x`` is the full gradient and
  ``dx`` through the adapter is complete). With SP the rank holds a sequence chunk ``x_j``: ``h_j =
  x_j A^T`` is all-gathered along the sequence (``r`` channels instead of the base's ``in``;
  backward: reduce-scatter), and ``dA = dh_j^T x_j`` is a partial sum over sequence chunks,
  all-reduced over TP like the norms (``param.sequence_parallel``).
- row-parallel ``W`` (columns split, ``linear_proj`` / ``linear_fc2``): ``A`` split by columns
  like ``W``, ``B`` replicated: ``h = sum_i x_i A_i^T`` is reduced over TP
  (``reduce_from_tensor_model_parallel_region``; with SP ``reduce_scatter_to_sequence_parallel_region``
  into the sequence chunk), then every rank applies all of ``B``. ``dB`` is complete on every rank
  without SP and a partial sum over sequence chunks with it (all-reduced over TP).

Experts of a mixture-of-experts layer (Megatron's ``SequentialMLP``: ``linear_fc1`` / ``linear_fc2``
of each local expert, split over the expert-tensor-parallel group, ETP) are split the same way,
but their linears communicate nothing themselves (``explicit_expert_comm``: the token dispatcher
all-gathers the tokens over ETP before them and reduce-scatters the partial outputs after). The
adapter follows suit: no activation communication; the column adapter's replicated ``A`` sees a
partial ``dA`` (each rank's rows of ``B``) and the row adapter's replicated ``B`` a partial ``dB``
(each rank's partial ``h``), so that parameter enters the forward through
``copy_to_tensor_model_parallel_region`` over ETP (identity forward, all-reduce of its gradient),
while the input gradient stays partial like the base linear's. Expert adapters carry the
weight's ``allreduce`` attribute (Megatron's DDP reduces them over the expert-data-parallel group).

A module that every TP rank runs whole (a vision-language model's vision tower, replicated, plain
``torch.nn.Linear`` s; ``LoRASpec.replicated_modules``) gets replicated adapters: ``A`` and ``B`` whole on
every rank, no communication (each rank computes the same output and receives the full gradient, as the
module's own weights do).

The adapter lives in the linear as a child module ``lora`` (parameters ``<linear>.lora.A`` and
``<linear>.lora.B``, with the ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride``
attributes Megatron gives split weights), so the base weight keeps its name for every loader,
exporter and the resharder. The linear's class becomes a subclass whose ``forward`` adds the
adapter and whose ``sharded_state_dict`` shards it like the weight.
"""

from __future__ import annotations

import math
import re
import zlib
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from parallel.names import global_param_names

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "mlp.linear_fc1", "mlp.linear_fc2",
           "experts.linear_fc1", "experts.linear_fc2")
DEFAULT_TARGETS = TARGETS[:4]  # every attention, dense MLP and expert linear


def is_target(name: str, targets) -> bool:
    """True when the module named ``name`` (local or global Megatron name) is among ``targets``
    (:data:`TARGETS`), each a suffix of the name in Megatron's grouped-MLP naming (an expert's
    ``mlp.experts.local_experts.<j>.linear_fc1`` read as ``mlp.experts.linear_fc1``): ``linear_fc1``
    adapts the dense MLPs' and the experts' (as Megatron-Bridge's LoRA does), ``mlp.linear_fc1`` the
    dense MLPs' only, ``experts.linear_fc1`` the experts' only."""
    name = re.sub(r"\.local_experts\.\d+\.", ".", name)
    return any(name == t or name.endswith("." + t) for t in targets)


@dataclass(frozen=True)
class LoRASpec:
    """``rank`` r (> 0), ``alpha`` (scale = alpha / r), ``dropout`` on the adapter's input,
    ``target_modules`` among :data:`TARGETS` (Megatron's names of the attention, dense MLP and
    expert linears, matched by :func:`is_target`), ``seed`` for ``A``'s initialisation (a function
    of the seed and the linear's global name: the same on every parallel layout);
    ``replicated_modules``: names of modules every TP rank runs whole (e.g. ``vision_model``) whose
    ``torch.nn.Linear`` s all get replicated adapters."""

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    seed: int = 0
    replicated_modules: tuple[str, ...] = ()

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class LoRAAdapter(nn.Module):
    """The low-rank branch of one TP linear; see the module docstring for the split.

    ``kind``: ``"column"``, ``"row"`` or ``"replicated"`` (a plain linear every TP rank runs whole:
    ``A`` and ``B`` whole, no communication); ``in_features`` / ``out_features``: the base linear's
    global sizes; ``tp_size`` / ``tp_rank``: its TP group; ``stride``: the base weight's partition
    stride (2 for a gated ``linear_fc1``); ``init_a``: the full ``A [r, in_features]`` to start
    from (this rank keeps its columns when ``kind == "row"``). ``B`` starts at zero. ``expert``:
    the base is an expert's linear (no communication of its own; ``tp_*`` are then its ETP group's).
    """

    def __init__(self, kind: str, in_features: int, out_features: int, spec: LoRASpec, *, tp_size: int,
                 tp_rank: int, stride: int, init_a: torch.Tensor, dtype: torch.dtype, device, sequence_parallel: bool,
                 tp_group=None, expert: bool = False):
        super().__init__()
        if kind not in ("column", "row", "replicated"):
            raise ValueError(f"kind={kind!r}: 'column', 'row' or 'replicated'")
        self.kind, self.scale, self.tp_group, self.enabled = kind, spec.scale, tp_group, True
        self.sequence_parallel, self.tp_size, self.expert = sequence_parallel and not expert, tp_size, expert
        self.dropout = nn.Dropout(spec.dropout) if spec.dropout > 0 else None
        r = spec.rank
        if kind == "replicated":
            tp_size = self.tp_size = 1
        if kind != "row":
            a = init_a
            b = torch.zeros(out_features // tp_size, r)
        else:
            a = init_a.narrow(1, tp_rank * (in_features // tp_size), in_features // tp_size)
            b = torch.zeros(out_features, r)
        self.A = nn.Parameter(a.to(device=device, dtype=dtype).contiguous())
        self.B = nn.Parameter(b.to(device=device, dtype=dtype))
        if kind == "replicated":
            self.A.tensor_model_parallel = self.B.tensor_model_parallel = False
            return
        split, replicated = (self.B, self.A) if kind == "column" else (self.A, self.B)
        split.tensor_model_parallel, split.partition_dim = True, 0 if kind == "column" else 1
        split.partition_stride = stride if kind == "column" else 1
        replicated.tensor_model_parallel = False
        if self.sequence_parallel:  # partial over sequence chunks: all-reduced over TP by finalize_model_grads
            replicated.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: the base linear's input ``[s, b, in]`` (its local part: ``s / TP`` rows with SP,
        ``in / TP`` channels for row-parallel); returns the adapter's share of the base linear's
        output, ``[.., out / TP]`` (column) or ``[s(/TP), b, out]`` (row), in ``x``'s dtype.
        Dropout applies only to passes that build a graph (training), so the old logprobs, values
        and evaluations of a run in train mode are deterministic."""
        from megatron.core.tensor_parallel import mappings

        if self.dropout is not None and self.training and torch.is_grad_enabled():
            x = self._dropout(x)  # not in no-grad passes (old / reference logprobs, values, evaluation)
        if self.kind == "replicated":
            return ((x @ self.A.t()) @ self.B.t()) * self.scale
        if self.expert:  # the dispatcher communicates; the replicated parameter's gradient is all-reduced
            a, b = self.A, self.B
            if self.tp_size > 1:
                if self.kind == "column":
                    a = mappings.copy_to_tensor_model_parallel_region(a, group=self.tp_group)
                else:
                    b = mappings.copy_to_tensor_model_parallel_region(b, group=self.tp_group)
            return ((x @ a.t()) @ b.t()) * self.scale
        h = x @ self.A.t()
        if self.kind == "column":
            if self.sequence_parallel:
                h = mappings.gather_from_sequence_parallel_region(h, group=self.tp_group)
            else:
                h = mappings.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif self.sequence_parallel:
            h = mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        else:
            h = mappings.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return (h @ self.B.t()) * self.scale

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout with Megatron's RNG discipline: the default generator where ``x`` is the same on
        every TP rank, the tracker's model-parallel generator where each rank holds a different part."""
        split_input = self.kind == "row" or self.sequence_parallel
        if split_input and self.tp_size > 1:
            from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

            with get_cuda_rng_tracker().fork(*([get_expert_parallel_rng_tracker_name()] if self.expert else [])):
                return self.dropout(x)
        return self.dropout(x)

    def delta_narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """``scale * B A`` of this rank (the same shape as its shard of ``W``), narrowed like
        ``W.narrow(dim, start, length)``, computed in fp32 from that slice only and returned in
        the adapter's dtype: what the weight sync adds to ``W`` without a merged copy of it."""
        a, b = self.A.detach().float(), self.B.detach().float()
        if dim == 0:
            b = b.narrow(0, start, length)
        else:
            a = a.narrow(1, start, length)
        return ((b @ a) * self.scale).to(self.A.dtype)


class _LoRALinear:
    """Mixed into a Megatron TP linear's class by :func:`apply_lora`."""

    def forward(self, input_, *args, **kwargs):
        out, bias = super().forward(input_, *args, **kwargs)
        if self.lora.enabled:
            out = out + self.lora(input_).to(out.dtype)
        return out, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base linear's sharded tensors with the adapter's sharded like the weight (the
        base's own method would take every child tensor for a replicated one)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        axis = {"B": 0} if self.lora.kind == "column" else {"A": 1}
        out.update(make_sharded_tensors_for_checkpoint(
            self.lora.state_dict(prefix="", keep_vars=True), f"{prefix}lora.", axis, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=(metadata or {}).get("dp_cp_group")))
        if self.lora.kind == "column" and getattr(self.weight, "partition_stride", 1) == 2:
            # a gated linear_fc1: B's local rows are [gate_i; up_i] like the weight's, saved as two
            # tensors the way Megatron's MLP saves the weight, so a checkpoint loads at any TP
            from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

            key = f"{prefix}lora.B"
            out[key] = apply_swiglu_sharded_factory(out[key], sharded_offsets,
                                                    (metadata or {}).get("singleton_local_shards", False))
        return out


class _LoRAPlainLinear:
    """Mixed into a ``torch.nn.Linear``'s class (a replicated module's) by :func:`apply_lora`."""

    def forward(self, input_):
        out = super().forward(input_)
        if self.lora.enabled:
            out = out + self.lora(input_).to(out.dtype)
        return out


_CLASSES: dict[type, type] = {}


def _lora_class(base: type, mixin: type = _LoRALinear) -> type:
    if base not in _CLASSES:
        _CLASSES[base] = type(f"LoRA{base.__name__}", (mixin, base), {})
    return _CLASSES[base]


def kaiming_uniform_a(spec: LoRASpec, name: str, in_features: int) -> torch.Tensor:
    """The full ``A [r, in]`` of the linear whose global name is ``name``: Kaiming-uniform with
    a = sqrt(5) as ``nn.Linear`` and PEFT draw it (bound ``1 / sqrt(in)``), from a generator
    seeded by ``spec.seed`` and ``name``, so every layout starts from the same adapters."""
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / math.sqrt(in_features)
    return torch.empty(spec.rank, in_features).uniform_(-bound, bound, generator=gen)


def apply_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Add LoRA adapters to ``model``'s linears named in ``spec.target_modules`` (a Megatron
    GPTModel shard or any module holding Megatron TP linears; not DDP-wrapped yet) and freeze
    every other parameter (``requires_grad=False``: Megatron's DDP gives them no gradient buffer
    and its optimizer no state). Call before wrapping the model in DDP. The experts of MoE layers
    are adapted like dense linears (see the module docstring); every ``torch.nn.Linear`` under
    ``spec.replicated_modules`` gets a replicated adapter. Returns the global names of the adapted
    linears.

    Raises:
        ValueError: ``spec.rank < 1``, an unknown target, no linear adapted, or a target that is not a Megatron
            ``ColumnParallelLinear`` / ``RowParallelLinear`` (transformer-engine's fused
            layernorm-linear included: its input is not the normalised activation).
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if spec.rank < 1:
        raise ValueError(f"model.lora.rank={spec.rank}: give a rank >= 1 (or leave model.lora unset for none)")
    unknown = set(spec.target_modules) - set(TARGETS)
    if unknown or not spec.target_modules:
        raise ValueError(f"model.lora.target_modules={list(spec.target_modules)}: choose among {list(TARGETS)}")
    model.requires_grad_(False)
    weight_names = {id(p): g for _, g, p in global_param_names(model)}
    adapted = []
    for name, module in list(model.named_modules()):
        if not is_target(name, spec.target_modules) or isinstance(module, nn.Linear):
            continue  # (a plain linear of the same name, e.g. in a vision tower: replicated_modules adapts those)
        if isinstance(module, ColumnParallelLinear) and not module.gather_output:
            kind = "column"
        elif isinstance(module, RowParallelLinear) and module.input_is_parallel:
            kind = "row"
        else:
            raise ValueError(f"{name} is a {type(module).__name__}: LoRA adapts Megatron's ColumnParallelLinear "
                             "(gather_output=False) / RowParallelLinear (input_is_parallel=True) of the local layer "
                             "spec; drop it from model.lora.target_modules")
        gname = weight_names[id(module.weight)]
        tp_group = module.tp_group
        tp_size, tp_rank = (tp_group.size(), tp_group.rank()) if tp_group is not None else (1, 0)
        module.lora = LoRAAdapter(
            kind, module.input_size, module.output_size, spec, tp_size=tp_size, tp_rank=tp_rank,
            stride=getattr(module.weight, "partition_stride", 1),
            init_a=kaiming_uniform_a(spec, gname.removesuffix(".weight"), module.input_size),
            dtype=module.weight.dtype, device=module.weight.device, sequence_parallel=module.sequence_parallel,
            tp_group=tp_group, expert=module.is_expert)
        for p in (module.lora.A, module.lora.B):  # experts: reduced over expert-DP, as the weight
            p.allreduce = getattr(module.weight, "allreduce", True)
        module.weight.lora_adapter = module.lora  # for merged_narrow (the weight sync)
        module.__class__ = _lora_class(type(module))
        adapted.append(gname.removesuffix(".weight"))
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and name.startswith(tuple(m + "." for m in spec.replicated_modules)):
            gname = weight_names[id(module.weight)].removesuffix(".weight")
            module.lora = LoRAAdapter("replicated", module.in_features, module.out_features, spec, tp_size=1,
                                      tp_rank=0, stride=1, init_a=kaiming_uniform_a(spec, gname, module.in_features),
                                      dtype=module.weight.dtype, device=module.weight.device, sequence_parallel=False)
            module.weight.lora_adapter = module.lora
            module.__class__ = _lora_class(type(module), _LoRAPlainLinear)
            adapted.append(gname)
    if not adapted:
        raise ValueError(f"model.lora.target_modules={list(spec.target_modules)} adapts no linear of this model shard "
                         f"(its stage has no such linears): choose among {list(TARGETS)}")
    return adapted


def adapters(model: nn.Module) -> list[LoRAAdapter]:
    """Every :class:`LoRAAdapter` in ``model`` (DDP-wrapped or not)."""
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


def signature(model: nn.Module) -> dict | None:
    """What a checkpoint of ``model``'s adapters must match to resume: ``{"rank", "scale",
    "targets"}`` (the adapted linears' names, ``experts.<name>`` for experts), or None without adapters."""
    found = [(("experts." if m.expert else "") + name.rsplit(".", 2)[-2], m) for name, m in model.named_modules()
             if isinstance(m, LoRAAdapter)]
    if not found:
        return None
    return {"rank": int(found[0][1].A.shape[0]), "scale": float(found[0][1].scale),
            "targets": sorted({leaf for leaf, _ in found})}


@contextmanager
def adapters_disabled(model: nn.Module):
    """``with adapters_disabled(model):`` runs ``model`` as its frozen base (every adapter's
    branch skipped): the reference policy of a LoRA job without a second copy of the weights."""
    found = adapters(model)
    for a in found:
        a.enabled = False
    try:
        yield model
    finally:
        for a in found:
            a.enabled = True


class FrozenBase:
    """The reference model of a LoRA job: the adapted ``model`` (DDP-wrapped or not) with every
    adapter off, so the reference logprobs come from the same base weights as the policy and no
    second copy of the model exists. ``alignment.training.megatron_step.forward_backward`` runs
    ``model`` under :func:`adapters_disabled` when given one (forward only)."""

    def __init__(self, model: nn.Module):
        if not adapters(model):
            raise ValueError("FrozenBase needs a model with LoRA adapters (parallel.lora.apply_lora)")
        self.model = model


def merged_narrow(weight: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``W + scale * B A`` of this rank's shard ``weight`` of an adapted linear, narrowed like
    ``weight.narrow(dim, start, length)`` (only that slice is computed), or that narrow of
    ``weight`` itself when its linear has no adapter."""
    piece = weight.detach()
    piece = piece if dim == 0 and start == 0 and length == weight.shape[0] else piece.narrow(dim, start, length)
    lora = getattr(weight, "lora_adapter", None)
    return piece if lora is None else piece + lora.delta_narrow(dim, start, length)
