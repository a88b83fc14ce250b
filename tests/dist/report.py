"""The end of every torchrun test worker: rank 0 writes the results as JSON for the test to
read (:func:`tests.conftest.torchrun_json`), then every rank shuts the process groups down."""

from __future__ import annotations

import json

import torch.distributed as dist


def write_results_and_shutdown(path: str, results: dict) -> None:
    """Rank 0 writes ``results`` to ``path`` (JSON); all ranks then call
    :func:`parallel.state.shutdown`."""
    from parallel.state import shutdown

    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
    shutdown()
