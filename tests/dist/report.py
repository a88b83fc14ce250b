"""The end of every torchrun test worker: rank 0 writes the results as JSON for the test to
read (:func:`tests.conftest.torchrun_json`), then every rank shuts the process groups down. What
rank 0 writes is every rank's: :func:`worst_over_ranks` / :func:`every_rank` first."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist


def write_results_and_shutdown(path: str, results: dict) -> None:
    """Rank 0 writes ``results`` to ``path`` (JSON); all ranks then call
    :func:`parallel.state.shutdown`."""
    from parallel.state import shutdown

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    shutdown()


def worst_over_ranks(diff: float) -> float:
    """The largest of every rank's ``diff`` (collective): a worker reports what every rank saw, not
    rank 0's share alone."""
    t = torch.tensor(float(diff), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def every_rank(result):
    """Every rank's ``result`` (any JSON-able value), in rank order (collective)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, result)
    return out


def exit_now(code: int = 0) -> None:
    """End this worker process at once, after its ``main`` returned: the job has closed its engine,
    writers and process groups, and Python's own teardown of vLLM, Megatron and torch objects took
    about 3.5 s a process on 2 cores (2026-12-02, one tiny GRPO job: 30.2 s -> 27.4 s a launch), paid
    by every launch of the suite. Multiprocessing children (Megatron's checkpoint writer starts a
    result-queue manager) are ended first, log handlers and standard streams flushed."""
    import logging
    import multiprocessing
    import os
    import sys

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
