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

from alignment.schema import ConfigError
from alignment.training.checkpoint import CheckpointError
from parallel.layout import LayoutError


_ROUTED: list[Path] = []
#: the file through which ranks report a bad input to ``megalign train`` (``tools/cli.py``)
ERROR_FILE_ENV = "MEGALIGN_ERROR_FILE"
#: the exit status of a bad input
BAD_INPUT_EXIT = 2
#: what megalign's start-up checks raise for a bad input (each message names the field or file and the fix)
BAD_INPUTS = (ConfigError, LayoutError, CheckpointError, FileNotFoundError)


def error_line(exc: BaseException) -> str:
    """``exc`` as the one line a bad input prints: ``megalign: error: <message>``, the message's
    lines joined. A type the checks do not raise for bad values (a bug, likely: ``KeyError``,
    ``TypeError``, ...) keeps its name."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or repr(exc)
    if not isinstance(exc, (ValueError, OSError)) \
            and type(exc).__module__.split(".")[0] not in ("hydra", "omegaconf"):
        text = f"{type(exc).__name__}: {text}"
    return f"megalign: error: {text}"


def report_bad_input(exc: BaseException) -> bool:
    """Under ``megalign train`` (``MEGALIGN_ERROR_FILE`` set; not with ``--debug``): append a
    rank's bad input (:class:`alignment.schema.ConfigError`, ``LayoutError``, ``CheckpointError``,
    a missing file) to that file as one line, for the command to print once. Returns whether it was
    reported (the rank then exits with :data:`BAD_INPUT_EXIT` and no traceback)."""
    path = os.environ.get(ERROR_FILE_ENV)
    if not path or not isinstance(exc, BAD_INPUTS):
        return False
    with open(path, "a") as f:
        f.write(error_line(exc) + "\n")
    return True


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
