"""torchrun worker: rank 1 alone gets SIGUSR1 during step 2 (or the stop file appears); every rank
must stop at the same step boundary, save that step and exit 75 (launchers/preemption.py).

    torchrun --nproc-per-node 2 tests/dist/preemption_worker.py signal|file OUT_DIR
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from types import SimpleNamespace

import torch.distributed as dist

from launchers import preemption
from tests.dist.report import exit_now


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    preemption.install()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job = SimpleNamespace(rank=rank, out=out, writer=None, close_loggers=lambda: None)  # a Run without loggers
    seen = []
    for step in range(10):
        if step == 2 and rank == 1:
            if mode == "signal":
                os.kill(os.getpid(), signal.SIGUSR1)
            else:
                Path(os.environ[preemption.STOP_FILE_ENV]).touch()
        seen.append(step)
        if preemption.stop_requested():
            def checkpoint(s: int) -> None:
                (out / f"rank{rank}.json").write_text(json.dumps({"saved": s, "steps": seen,
                                                                  "why": preemption.local_request()}))
            preemption.save_and_exit(job, step + 1, checkpoint)
    (out / f"rank{rank}.json").write_text(json.dumps({"saved": None, "steps": seen}))


if __name__ == "__main__":
    main()
    exit_now()
