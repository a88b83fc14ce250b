"""Offload of idle models between the phases of an RL step (weights, gradient buffers and
optimizer state to host memory, and back), as verl's ``param_offload`` / ``grad_offload`` /
``optimizer_offload`` and NeMo-RL's CPU offload do for colocated training and rollout.

Mechanism: every tensor of a unit shares a few device storages (Megatron DDP keeps parameters
and ``main_grad`` as views into contiguous buffers; the distributed optimizer's fp32 shards are
views too). Offloading copies each storage to (pinned) host memory and shrinks the device
storage to zero bytes with ``untyped_storage().resize_(0)``; reloading grows it back and copies
the bytes in. Views, ``main_grad`` attributes and the optimizer's references stay valid, so no
model or optimizer code needs to know (the same trick as PyTorch FSDP's unsharded parameters).
Gradient buffers are not copied: every trainer zeroes them before it accumulates, so they come
back as zeros.

On CPU the host is the device, so offloading saves nothing: the jobs disable it there
(:func:`offload_enabled`), except under ``MEGALIGN_OFFLOAD_ON_CPU=1`` which runs the same copies
on CPU so that the tests exercise this code in the real training loops.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from alignment.training.host_memory import release_free_heap
from parallel.lora import FrozenBase


def offload_enabled(requested: bool) -> bool:
    """Whether ``trainer.offload=requested`` does anything here: on a CUDA machine, or on CPU
    with ``MEGALIGN_OFFLOAD_ON_CPU=1`` (tests)."""
    return requested and (torch.cuda.is_available() or os.environ.get("MEGALIGN_OFFLOAD_ON_CPU") == "1")


def trainable(name: str) -> tuple[str, str, str]:
    """The three units of a trained model: ``(name, name.grads, name.optimizer)``."""
    return name, f"{name}.grads", f"{name}.optimizer"


@dataclass
class _Unit:
    source: Callable[[], list]  # the unit's tensors now (an optimizer creates its state lazily)
    keep_values: bool  # False for gradient buffers: they come back zeroed
    storages: list = field(default_factory=list)  # torch.UntypedStorage owned by this unit
    sizes: list[int] = field(default_factory=list)  # bytes of each storage when resident
    host: list = field(default_factory=list)  # host copies while offloaded
    resident: bool = True

    @property
    def keys(self) -> set[int]:
        return {s._cdata for s in self.storages}  # the StorageImpl, stable across resize_


def _whole(storage) -> torch.Tensor:
    """A flat uint8 tensor over all of ``storage``'s bytes."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DevicePlacement:
    """Which units (a model's weights, its gradient buffers, its optimizer state) are on the
    device. :meth:`keep` names the units a phase needs; every other unit goes to host memory.

    Units are registered with :meth:`add_model`; a storage shared by two units (fp32 parameters
    that are also the optimizer's main parameters) belongs to the one registered first. A
    unit's storages are collected again each time it is offloaded, so optimizer state created
    at the first step, or replaced by a checkpoint load, is followed.
    With ``enabled=False`` every method is a no-op, so the loops call :meth:`keep` unconditionally.

    Stats (``moved_bytes``, ``seconds``) accumulate until :meth:`pop_stats`.
    """

    def __init__(self, enabled: bool, pin_memory: bool | None = None):
        self.enabled = enabled
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.units: dict[str, _Unit] = {}
        self._absent: set[str] = set()  # names of models registered as None (e.g. no reference)
        self._aliases: dict[str, str] = {}  # a FrozenBase reference -> the unit of the model it runs
        self._model_units: dict[int, str] = {}  # id(model) -> its unit
        self._device_only = torch.cuda.is_available()  # on GPU, leave tensors already on host alone
        self.moved_bytes = 0
        self.seconds = 0.0

    # ---------------------------------------------------------------- registration
    def add_model(self, name: str, model: torch.nn.Module | None, optimizer=None) -> None:
        """Register ``model`` (a DDP-wrapped or plain Megatron module; None is skipped) as unit
        ``name`` (parameters and buffers), its ``main_grad`` buffers as ``name.grads`` and the
        tensors of ``optimizer`` (a Megatron optimizer, chained or not) as ``name.optimizer``.
        A LoRA job's :class:`parallel.lora.FrozenBase` reference holds no weights of its own:
        ``name`` then names the unit of the model it runs (register that model first).

        Raises:
            ValueError: ``name`` is already registered; a FrozenBase whose model is not.
        """
        if not self.enabled:
            return
        if name in self.units or name in self._absent or name in self._aliases:
            raise ValueError(f"offload unit {name!r} is registered twice")

        if model is None:
            self._absent.add(name)
            return
        if isinstance(model, FrozenBase):
            if id(model.model) not in self._model_units:
                raise ValueError(f"offload unit {name!r}: register the model this FrozenBase runs first")
            self._aliases[name] = self._model_units[id(model.model)]
            return
        self._model_units[id(model)] = name
        inner = getattr(model, "module", model)  # Megatron DDP's `buffers` is a list, not the method
        self.units[name] = _Unit(lambda: [*inner.parameters(), *inner.buffers()], keep_values=True)
        if any(getattr(p, "main_grad", None) is not None for p in inner.parameters()):
            self.units[f"{name}.grads"] = _Unit(
                lambda: [getattr(p, "main_grad", None) for p in inner.parameters()], keep_values=False)
        if optimizer is not None:
            self.units[f"{name}.optimizer"] = _Unit(lambda: _optimizer_tensors(optimizer), keep_values=True)

    def _refresh(self, name: str, unit: _Unit) -> None:
        """Collect a resident unit's storages: those of its tensors that no unit registered
        before it owns."""
        taken: set[int] = set()
        for other_name, other in self.units.items():
            if other_name == name:
                break
            if other.resident:
                self._refresh(other_name, other)
            taken |= other.keys
        unit.storages, seen = [], set()
        for t in unit.source():
            if t is None or t.numel() == 0 or (self._device_only and t.device.type != "cuda"):
                continue
            s = t.untyped_storage()
            if s._cdata not in taken and s._cdata not in seen and s.nbytes() > 0:
                seen.add(s._cdata)
                unit.storages.append(s)
        unit.sizes = [s.nbytes() for s in unit.storages]

    # ---------------------------------------------------------------- movement
    def keep(self, *names: str) -> None:
        """Make exactly the units ``names`` resident (reload them) and offload all others.

        Called at every phase boundary of a step. On CPU it first hands the freed heap back to the
        OS (:func:`alignment.training.host_memory.release_free_heap`), enabled or not, as
        ``torch.cuda.empty_cache()`` does below for the CUDA caching allocator.

        Names of models registered as None, and the ``.grads`` / ``.optimizer`` units of frozen
        models, are accepted and ignored.

        Raises:
            KeyError: a name that is not registered (when enabled).
        """
        if not torch.cuda.is_available():  # the phase's freed host heap, back to the OS
            release_free_heap()
        if not self.enabled:
            return
        names = tuple(self._aliases.get(n, n) for n in names)
        unknown = [n for n in names if n not in self.units and not self._optional(n)]
        if unknown:
            raise KeyError(f"offload units {unknown} are not registered (registered: {sorted(self.units)})")
        t0 = time.perf_counter()
        for name, unit in self.units.items():
            if name not in names and unit.resident:
                self._refresh(name, unit)
                self._offload(unit)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # hand the freed blocks back (to vLLM, the other model)
        for name in names:
            unit = self.units.get(name)
            if unit is not None and not unit.resident:
                self._reload(unit)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0

    def keep_all(self) -> None:
        """Reload every unit (before a checkpoint or an export)."""
        self.keep(*self.units)

    def _offload(self, unit: _Unit) -> None:
        unit.host = []
        for s in unit.storages:
            if unit.keep_values:
                whole = _whole(s)
                host = torch.empty(whole.shape, dtype=torch.uint8, pin_memory=self.pin_memory)
                host.copy_(whole, non_blocking=self.pin_memory)
                unit.host.append(host)
                self.moved_bytes += host.numel()
        if self.pin_memory:
            torch.cuda.synchronize()  # the copies must land before the device memory is released
        for s in unit.storages:
            s.resize_(0)
        unit.resident = False

    def _reload(self, unit: _Unit) -> None:
        for i, (s, size) in enumerate(zip(unit.storages, unit.sizes)):
            s.resize_(size)
            whole = _whole(s)
            if unit.keep_values:
                whole.copy_(unit.host[i], non_blocking=self.pin_memory)
                self.moved_bytes += size
            else:
                whole.zero_()
        unit.host = []
        unit.resident = True

    def _optional(self, name: str) -> bool:
        # a model registered as None, or the gradient buffer / optimizer of a frozen model
        base, _, part = name.partition(".")
        return base in self._absent or (base in self.units and part in ("grads", "optimizer"))

    # ---------------------------------------------------------------- reporting
    def resident_bytes(self) -> dict[str, int]:
        """``{unit: bytes of its storages on the device now}``."""
        for name, unit in self.units.items():
            if unit.resident:
                self._refresh(name, unit)
        return {n: sum(s.nbytes() for s in u.storages) for n, u in self.units.items()}

    def pop_stats(self) -> dict[str, float]:
        """``{"offload/gb_moved", "offload/seconds"}`` since the last call (empty when disabled)."""
        if not self.enabled:
            return {}
        out = {"offload/gb_moved": self.moved_bytes / 2**30, "offload/seconds": self.seconds}
        self.moved_bytes, self.seconds = 0, 0.0
        return out


def _optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """Every tensor a Megatron optimizer holds: Adam moments and step counters, and the main
    parameters it updates (fp32 copies under bf16, shards under the distributed optimizer)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", opt)
        for group in inner.param_groups:
            out += list(group["params"])
        for state in inner.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
    return out
