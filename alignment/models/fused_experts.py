"""Checkpoints that store every expert of a mixture-of-experts layer in one tensor (Qwen3-VL-MoE:
``mlp.experts.gate_up_proj`` ``[experts, H, 2F]``, ``mlp.experts.down_proj`` ``[experts, F, H]``),
where a family's table names one tensor per expert (``mlp.experts.{e}.gate_proj.weight`` ``[F, H]``, as
Qwen3-MoE's checkpoints store them).

:class:`FusedExperts` is that difference, written once: :meth:`FusedExperts.view` reads per-expert
tensors out of a fused checkpoint (loading, the weight check) and :meth:`FusedExperts.fuse` writes a
per-expert state dict in the checkpoint's form (the HF export, vLLM's loaders). The table's rows, the
resharder and Megatron never see the fused form.

Two layouts of the fused tensors are about: the released checkpoints' ``[experts, in, out]`` (each expert's
``[out, in]`` weight transposed: ``gate_up_proj`` ``[E, H, 2F]``), which vLLM reads (it always transposes), and
transformers 5's in-memory ``[experts, out, in]``, which ``save_pretrained`` of transformers 5.19 writes as it
is. transformers reads either (it transposes when the shape is not its own); so does :meth:`FusedExperts.view`
(by where the hidden size sits; the released layout when both dims are the hidden size, as vLLM assumes).
:meth:`FusedExperts.fuse` writes the released layout, which both read.

Source: transformers 5.19 ``conversion_mapping.py`` (``qwen3_vl_moe``: ``Transpose(1, 2, check_dims=True)``) and
``models/qwen3_vl_moe/modeling_qwen3_vl_moe.py``; vLLM 0.32 ``RoutedExperts.load_weights``
(``is_fused_checkpoint_transposed``: ``transpose(-1, -2)``, then ``w1`` / ``w3`` the two halves of dim 1).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch

_PER_EXPERT = re.compile(r"^(?P<stem>.+\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")


@dataclass(frozen=True)
class Fused:
    """One fused tensor: the per-expert ``parts`` it holds, in order along each expert's output dimension, and
    whether the hidden size is the experts' input (``gate_up_proj``) or output (``down_proj``) dimension."""

    parts: tuple[str, ...]
    hidden_is_input: bool


QWEN_FUSED = (("gate_up_proj", Fused(("gate_proj", "up_proj"), True)), ("down_proj", Fused(("down_proj",), False)))


@dataclass(frozen=True)
class FusedExperts:
    """How a family's checkpoint fuses its experts: ``(fused tensor name (after <stem>.experts.), its
    :class:`Fused`)`` pairs (default Qwen3-VL-MoE's ``gate_up_proj`` and ``down_proj``)."""

    fused: tuple[tuple[str, Fused], ...] = QWEN_FUSED

    def _source(self, name: str) -> tuple[str, Fused, int, int] | None:
        """``(fused name, its Fused, expert, part index)`` of per-expert tensor ``name``; None for any other."""
        m = _PER_EXPERT.match(name)
        if not m:
            return None
        for fused, spec in self.fused:
            if m["part"] in spec.parts:
                return f"{m['stem']}.{fused}", spec, int(m["expert"]), spec.parts.index(m["part"])
        return None

    def view(self, checkpoint: Mapping[str, torch.Tensor], hidden_size: int) -> Mapping[str, torch.Tensor]:
        """``checkpoint`` (any mapping: a dict, :func:`alignment.models.weights.lazy_safetensors`) as the table
        names it, for a model of width ``hidden_size``: ``view["...experts.3.up_proj.weight"]`` ``[F, H]`` is
        expert 3's half of the fused ``"...experts.gate_up_proj"`` (either layout, see the module doc); every
        other name reads through. The last fused tensors read (one of each kind) are kept, so a layer's experts
        read them once. Raises KeyError for a name neither form has, ValueError for a fused tensor whose shape
        has the hidden size in neither place."""
        if isinstance(checkpoint, _View) and checkpoint.spec == self:
            return checkpoint
        return _View(self, checkpoint, hidden_size)

    def released(self, checkpoint: dict[str, torch.Tensor], hidden_size: int) -> dict[str, torch.Tensor]:
        """``checkpoint`` with its fused tensors in the released layout (as :meth:`fuse` writes them: a
        transformers-5-saved ``[experts, out, in]`` transposed), every other tensor as it is. Raises ValueError
        as :meth:`view`."""
        view, out = _View(self, checkpoint, hidden_size), {}
        for name, t in checkpoint.items():
            stem, _, leaf = name.rpartition(".")
            spec = dict(self.fused).get(leaf) if stem.endswith(".experts") else None
            out[name] = t if spec is None else view.experts(name, spec).transpose(1, 2).contiguous()
        return out

    def fuse(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (per-expert names, every expert of a layer present) in the checkpoint's form: each layer's
        experts stacked into its fused tensors in the released layout ``[experts, in, out]``; other tensors as
        they are. Raises ValueError for a layer whose experts are not all there."""
        out, groups = {}, {}
        for name, t in state.items():
            src = self._source(name)
            if src is None:
                out[name] = t
            else:
                fused, spec, e, k = src
                groups.setdefault(fused, (spec, {}))[1][(e, k)] = t
        for fused, (spec, pieces) in groups.items():
            experts = 1 + max(e for e, _ in pieces)
            missing = sorted({e for e in range(experts) for k in range(len(spec.parts)) if (e, k) not in pieces})
            if missing:
                raise ValueError(f"{fused}: experts {missing} missing; every expert of a layer is needed to write its "
                                 "fused checkpoint tensor")
            w = torch.stack([torch.cat([pieces[(e, k)] for k in range(len(spec.parts))]) for e in range(experts)])
            out[fused] = w.transpose(1, 2).contiguous()  # [E, out, in] -> [E, in, out]
        return out


class _View(Mapping):
    def __init__(self, spec: FusedExperts, checkpoint: Mapping[str, torch.Tensor], hidden_size: int):
        self.spec, self.checkpoint, self.hidden_size = spec, checkpoint, hidden_size
        self._kept = {}  # fused name -> [E, out, in], the latest few

    def experts(self, fused: str, spec: Fused) -> torch.Tensor:
        """The fused tensor as ``[experts, out, in]``."""
        if fused not in self._kept:
            w = self.checkpoint[fused]
            released = 1 if spec.hidden_is_input else 2  # where the released [E, in, out] has the hidden size
            if w.dim() != 3 or self.hidden_size not in w.shape[1:]:
                raise ValueError(f"{fused}: shape {tuple(w.shape)}, expected [experts, in, out] or [experts, out, in] "
                                 f"with the hidden size {self.hidden_size} as the experts' "
                                 f"{'input' if spec.hidden_is_input else 'output'}")
            if len(self._kept) >= len(self.spec.fused):
                self._kept.pop(next(iter(self._kept)))
            self._kept[fused] = w.transpose(1, 2) if w.shape[released] == self.hidden_size else w
        return self._kept[fused]

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.checkpoint:
            return self.checkpoint[name]
        src = self.spec._source(name)
        if src is None:
            raise KeyError(name)
        fused, spec, e, k = src
        return self.experts(fused, spec)[e].chunk(len(spec.parts), dim=0)[k].contiguous()

    def __contains__(self, name) -> bool:
        if name in self.checkpoint:
            return True
        src = self.spec._source(name)
        return src is not None and src[0] in self.checkpoint

    def __iter__(self):
        return iter(self.checkpoint)

    def __len__(self) -> int:
        return len(self.checkpoint)
