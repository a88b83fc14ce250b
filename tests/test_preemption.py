"""launchers/preemption.py across 2 processes: a stop request that reaches one rank only (a
signal, or the stop file slurm/launch.sh touches) stops every rank at the same step boundary,
each saves that step and the processes exit with PREEMPTED_EXIT_CODE (75)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launchers.preemption import PREEMPTED_EXIT_CODE
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # launches processes: the full suite only (CONTRIBUTING.md, test tiers)


@pytest.mark.parametrize("mode", ["signal", "file"])
def test_all_ranks_stop_at_the_same_step_and_exit_75(mode, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "MEGALIGN_STOP_FILE": str(tmp_path / "stop")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(ROOT / "tests" / "dist" / "preemption_worker.py"), mode, str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert f"exitcode: {PREEMPTED_EXIT_CODE}" in out, out[-3000:]  # torchrun reports the workers' code
    assert f"checkpoint at step 3 saved in {tmp_path / 'checkpoints'}, exiting with code 75" in out
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # rank 1 was asked during step 2; rank 0 learns it from the all-reduce at the same boundary
    assert r0["saved"] == r1["saved"] == 3 and r0["steps"] == r1["steps"] == [0, 1, 2]
    assert r1["why"] == ("SIGUSR1" if mode == "signal" else "stop file")
    assert r0["why"] == (None if mode == "signal" else "stop file")  # the file is shared, the signal is not


def test_first_sigterm_sets_the_flag_a_second_one_kills(tmp_path):
    code = ("import os, signal, time\n"
            "from launchers import preemption\n"
            "preemption.install()\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('flag:', preemption.local_request(), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "time.sleep(5)\n"
            "print('survived', flush=True)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=60)
    assert p.stdout == "flag: SIGTERM\n" and p.returncode == -15, (p.returncode, p.stdout, p.stderr)
