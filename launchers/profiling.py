"""Profiling of a running job (``profile.*`` in the config): ``torch.profiler`` traces of chosen
steps on chosen ranks, phase timers, and a memory report.

Traces are Chrome-trace JSON written by ``torch.profiler.tensorboard_trace_handler``: open them
in Perfetto / ``chrome://tracing``, or point TensorBoard's profiler plugin at ``profile.dir``.
On GPU the traced steps also record CUDA allocator history and dump a snapshot
(``rank<r>_step<s>.memory.pickle``, viewable at https://pytorch.org/memory_viz).
``tools/profile_step.py`` runs a job with profiling on and prints the report.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM`` of ``/proc/self/status``), bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def memory_report(rank: int) -> dict:
    """This rank's peak memory: ``peak_rss_gib`` always; ``cuda_max_allocated_gib`` and
    ``cuda_max_reserved_gib`` (PyTorch caching allocator, since the process started) on GPU."""
    report = {"rank": rank, "peak_rss_gib": peak_rss_bytes() / 2**30}
    if torch.cuda.is_available():
        report["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    return report


class PhaseTimers:
    """Wall-clock seconds per named phase, summed over the run (e.g. ``checkpoint``), with counts."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0
            self.counts[name] += 1

    def as_dict(self) -> dict:
        return {k: {"seconds": v, "count": self.counts[k]} for k, v in self.seconds.items()}


class StepProfiler:
    """Starts ``torch.profiler`` before each chosen step and stops it after, on chosen ranks.

    ``begin(step)``/``end(step)`` take the 0-based loop index; ``profile.steps`` are 1-based
    optimizer steps (the step that ends with optimizer step ``s`` is loop index ``s - 1``).
    A no-op unless ``profile.enabled`` and this rank is in ``profile.ranks``.
    """

    def __init__(self, profile_cfg, rank: int):
        self.cfg = profile_cfg
        self.rank = rank
        self.active = bool(profile_cfg.enabled) and rank in list(profile_cfg.ranks)
        self.dir = Path(profile_cfg.dir)
        self.written: list[str] = []
        self._prof = None

    def _wanted(self, step: int) -> bool:
        return self.active and (step + 1) in list(self.cfg.steps)

    def begin(self, step: int) -> None:
        """Start tracing loop index ``step`` if it is one of ``profile.steps``."""
        if not self._wanted(step):
            return
        from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

        self.dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self._prof = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                             profile_memory=self.cfg.profile_memory, with_stack=self.cfg.with_stack,
                             on_trace_ready=tensorboard_trace_handler(
                                 str(self.dir), worker_name=f"rank{self.rank}_step{step + 1}"))
        if torch.cuda.is_available() and self.cfg.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        self._prof.start()

    def end(self, step: int) -> None:
        """Stop tracing loop index ``step`` and write its trace (and CUDA memory snapshot)."""
        if self._prof is None or not self._wanted(step):
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._prof.stop()  # on_trace_ready writes the trace
        self._prof = None
        if torch.cuda.is_available() and self.cfg.memory_snapshot:
            path = self.dir / f"rank{self.rank}_step{step + 1}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(path))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.written.append(str(path))
        self.written.extend(sorted(str(p) for p in self.dir.glob(f"rank{self.rank}_step{step + 1}.*.pt.trace.json")))
