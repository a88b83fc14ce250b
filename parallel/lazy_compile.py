"""Megatron-Core's ``torch.compile`` decorations compiled at first call instead of at import.

Why: ``megatron/core/jit.py`` sets ``jit_fuser = torch.compile``, and about twenty functions
(``fusions/``, ``activations``, the MoE router and experts, ``torch_norm``) are decorated with it when
their modules load. ``torch.compile`` imports TorchDynamo and Inductor on every call, so
``import megatron.core`` took 6.6 s of which 2.9 s were those imports (AMD EPYC, 2 cores,
2026-11-26), in every rank of every launch, whether or not a fused kernel ever runs. Here each
decorated function is wrapped so that ``torch.compile`` is called, with the same arguments, the
first time the function is: what runs is unchanged.

:func:`install` adds a finder for the one module ``megatron.core.jit`` to ``sys.meta_path``;
``parallel/__init__.py`` calls it, so it is in place before any Megatron import in a process that
imports megalign first. It imports nothing heavy (the CLI imports this package).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

JIT_MODULE = "megatron.core.jit"


def deferred(compile_fn):
    """``compile_fn`` (``torch.compile``) as a decorator that compiles at the first call.

    ``deferred(torch.compile)(fn, **kwargs)`` and ``deferred(torch.compile)(**kwargs)(fn)`` return a
    function that calls ``compile_fn(fn, **kwargs)`` once, on its first call, and the compiled
    function from then on.
    """

    def decorate(model=None, **kwargs):
        if model is None:
            return lambda fn: decorate(fn, **kwargs)
        compiled = None

        @functools.wraps(model)
        def run(*args, **kw):
            nonlocal compiled
            if compiled is None:
                compiled = compile_fn(model, **kwargs)
            return compiled(*args, **kw)

        return run

    return decorate


class _JitLoader(importlib.abc.Loader):
    """Loads ``megatron.core.jit`` as usual, then defers its ``jit_fuser`` if it is ``torch.compile``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        torch = sys.modules["torch"]  # megatron/core/jit.py imports it
        if module.jit_fuser is torch.compile:
            module.jit_fuser = deferred(torch.compile)


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != JIT_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _JitLoader(spec.loader)
        return spec


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once). Has no effect on a ``megatron.core.jit``
    already imported."""
    if not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
