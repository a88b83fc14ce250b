"""What a job prints: megalign's own lines (config errors, progress bar, per-step metrics,
evaluations, resume and summary) on the console; third-party chatter (vLLM's and
transformers' INFO/WARNING logs, Python warnings from libraries, and what C/C++ code writes
to file descriptor 2: torch's NUMA and thread notices, OpenMP) in ``<output_dir>/logs/rank<r>.log``.

Python-level ``sys.stderr`` stays the terminal, so tracebacks and the tqdm bar still show;
only writes to the process's file descriptor 2 and logging records go to the file.
``trainer.quiet=false`` leaves everything on the console.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path


_ROUTED: list[Path] = []


def route_third_party_output(log_file: Path) -> Path:
    """Send logging records, Python warnings and fd-2 writes of this process to ``log_file``
    (appended; created with its folder). Call before vLLM is imported (``VLLM_CONFIGURE_LOGGING=0``
    makes its loggers propagate to the root logger instead of printing). Idempotent: a second
    call returns the first call's file. Returns the file in use."""
    if _ROUTED:
        return _ROUTED[0]
    _ROUTED.append(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"
    sink = open(log_file, "a", buffering=1)  # noqa: SIM115 - lives as long as the process
    sys.stderr.flush()
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    os.dup2(sink.fileno(), 2)  # C/C++ writes to stderr
    sys.stderr = terminal  # Python's: tracebacks, tqdm
    handler = logging.StreamHandler(sink)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(handlers=[handler], level=logging.INFO, force=True)
    logging.captureWarnings(True)
    vllm_logger = logging.getLogger("vllm")  # imported already: it has its own console handler
    for h in list(vllm_logger.handlers):
        vllm_logger.removeHandler(h)
    vllm_logger.propagate = True
    return log_file
