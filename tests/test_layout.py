"""Layouts that cannot work are refused before any process group starts, with the
field name and the valid values in the message."""

from __future__ import annotations

import pytest

from parallel.layout import LayoutError, ParallelLayout, validate_layout

SMOLLM2 = dict(num_layers=30, num_attention_heads=9, num_query_groups=3)


def check(world, tp=1, pp=1, sp=False, **model):
    validate_layout(ParallelLayout(world, tp, pp, sp), **(model or SMOLLM2))


def test_valid_layouts_pass_and_data_parallel_is_the_rest():
    check(2)
    check(6, tp=3)
    check(6, tp=3, pp=2)
    check(4, pp=2)
    assert ParallelLayout(12, 3, 2).data_parallel_size == 2


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(LayoutError) as e:
        check(2, tp=2)
    msg = str(e.value)
    assert "parallel.tensor_model_parallel_size=2" in msg and "9 attention heads and 3 KV heads" in msg
    assert "valid values with world size 2: [1]" in msg
    with pytest.raises(LayoutError, match=r"valid values with world size 6: \[1, 3\]"):
        check(6, tp=2)


def test_tp_must_divide_world_size():
    with pytest.raises(LayoutError, match=r"tensor_model_parallel_size=3 does not divide the world size 2"):
        check(2, tp=3)


def test_pp_must_divide_layers():
    with pytest.raises(LayoutError) as e:
        check(4, pp=4)
    assert "pipeline_model_parallel_size=4 must divide the model's 30 layers" in str(e.value)
    assert "[1, 2]" in str(e.value)  # divisors of 30 that fit a world of 4


def test_world_size_must_be_divisible_by_tp_times_pp():
    with pytest.raises(LayoutError, match=r"world size 3 is not divisible by .* = 1 x 2"):
        check(3, pp=2)


def test_sequence_parallel_needs_tp():
    with pytest.raises(LayoutError, match="sequence_parallel=true needs tensor_model_parallel_size > 1"):
        check(2, sp=True)


def test_non_positive_sizes():
    with pytest.raises(LayoutError, match="must be a positive integer"):
        check(2, tp=0)


SHUTDOWN_SCRIPT = """
import os, sys
import torch.distributed as dist
from parallel.layout import ParallelLayout
from parallel.state import init_distributed, shutdown
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
own = sys.argv[1] == "own"
if not own:  # the caller starts the default group, as tests/dist/jobs_worker.py does for each job
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
for _ in range(2):  # two jobs in turn
    init_distributed(ParallelLayout(world_size=1))
    shutdown()
    print("initialized after shutdown:", dist.is_initialized())
    if own:
        os.environ.pop("MASTER_PORT", None)
"""


@pytest.mark.slow  # a subprocess importing Megatron
@pytest.mark.parametrize("who", ["own", "caller"])
def test_shutdown_ends_the_default_group_only_when_init_distributed_started_it(who):
    """``parallel.state.shutdown`` destroys the default group that ``init_distributed`` started
    (twice in one process), and leaves one its caller started, with its own subgroups ended."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    proc = subprocess.run([sys.executable, "-c", SHUTDOWN_SCRIPT, who], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = "False" if who == "own" else "True"
    assert proc.stdout.splitlines() == [f"initialized after shutdown: {expected}"] * 2, proc.stdout
