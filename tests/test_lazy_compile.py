"""parallel/lazy_compile.py: Megatron's torch.compile decorations compile at first call, not at import."""

from __future__ import annotations

import subprocess
import sys

from parallel.lazy_compile import deferred
from tests.conftest import ROOT


def test_deferred_compiles_once_at_the_first_call_with_the_decorators_arguments():
    calls = []

    def compile_fn(fn, **kwargs):
        calls.append((fn.__name__, kwargs))
        return lambda x: fn(x) * 10

    @deferred(compile_fn)
    def plain(x):
        return x + 1

    @deferred(compile_fn)(dynamic=True)
    def with_args(x):
        return x + 2

    assert calls == [] and plain.__name__ == "plain"  # nothing compiled by decorating
    assert plain(1) == 20 and plain(2) == 30 and with_args(1) == 30
    assert calls == [("plain", {}), ("with_args", {"dynamic": True})]  # once each


def test_megatron_imports_without_dynamo():
    code = (
        "import sys, parallel, torch\n"
        "from megatron.core import jit\n"
        "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl\n"
        "import megatron.core.models.gpt\n"
        "assert 'torch._dynamo' not in sys.modules and 'torch._inductor' not in sys.modules, 'imported at import'\n"
        "from megatron.core.fusions.fused_bias_swiglu import swiglu\n"
        "assert jit.jit_fuser is not torch.compile and swiglu.__wrapped__.__name__ == 'swiglu'\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
