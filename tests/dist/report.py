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
