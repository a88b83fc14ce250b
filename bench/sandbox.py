"""Sandbox throughput: runs per second of :func:`alignment.sandbox.runner.run_python` in the
bubblewrap container and in the fallback (the runner's own namespaces), one at a time and through a
:class:`SandboxPool` of ``--workers``, for a trivial program and for HumanEval's canonical solutions
checked against their tests (the reward's real work), measured side by side in one run.

    python bench/sandbox.py [--runs 40] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from alignment.data.code_tasks import CODE_LIMITS, check_program, load_humaneval  # noqa: E402
from alignment.sandbox.bwrap import probe  # noqa: E402
from alignment.sandbox.runner import ISOLATIONS, SandboxPool  # noqa: E402


def rate(programs: list[str], isolation: str, workers: int) -> tuple[float, int]:
    """Runs per second over ``programs`` and how many exited with status 0."""
    with SandboxPool(workers=workers, limits=CODE_LIMITS, isolation=isolation) as pool:
        pool.map(programs[:1])  # warm: the first run pays for imports and the probe
        t = time.perf_counter()
        results = pool.map(programs)
        return len(programs) / (time.perf_counter() - t), sum(r.ok for r in results)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    problems = load_humaneval("train", args.runs)
    workloads = {"print(i)": [f"print({i})" for i in range(args.runs)],  # distinct: a pool runs a program once per map
                 "HumanEval check (canonical solution)": [check_program(p, p["canonical_solution"]) for p in problems]}
    isolations = [i for i in ISOLATIONS if i != "bwrap" or probe() is None]
    if probe() is not None:
        print(f"bwrap left out: {probe()}")
    rows = ["| program | isolation | workers | runs/s | passed |", "|---|---|---|---|---|"]
    base: dict[tuple[str, int], float] = {}
    for name, programs in workloads.items():
        for workers in sorted({1, args.workers}):
            for isolation in isolations:
                r, ok = rate(programs, isolation, workers)
                base.setdefault((name, workers), r)
                rows.append(f"| {name} | {isolation} | {workers} | {r:.1f} ({r / base[(name, workers)]:.2f}x) | "
                            f"{ok}/{len(programs)} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
