"""Shared test helpers: launching torchrun workers on CPU (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what a gloo worker process prints when a C++ thread is still joinable as it exits (SIGABRT, seen
#: about once in 500 torchrun launches here, after the results were written)
TEARDOWN_ABORT = "terminate called without an active exception"


def run_torchrun(worker: str, *args: str, nproc: int = 2, timeout: int = 900, env: dict | None = None,
                 expect_failure: bool = False) -> str:
    """Run ``tests/dist/<worker>`` under torchrun with ``nproc`` CPU processes; return its output.
    Fails the test with the tail of the log when the workers fail (``expect_failure``: when they
    succeed); a run that failed only by a worker aborting at exit (:data:`TEARDOWN_ABORT`) is run
    once more first."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "tests" / "dist" / worker), *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and TEARDOWN_ABORT in out:  # docs/troubleshooting.md: run it once more
        print(f"{worker}: a worker aborted at exit ({TEARDOWN_ABORT!r}); running it once more", file=sys.stderr)
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
    if expect_failure and proc.returncode == 0:
        pytest.fail(f"{worker} succeeded where it should have failed:\n{out[-3000:]}")
    if proc.returncode != 0 and not expect_failure:
        pytest.fail(f"{worker} failed (exit {proc.returncode}):\n{out[-6000:]}")
    return out


@dataclass
class Job:
    """One job of a :func:`run_jobs` launch: ``configs/<config>.yaml`` on the model in ``model``
    (fp32), writing to ``out``, with ``overrides``; ``reward`` as tests/dist/e2e_worker.py takes it,
    ``env`` set for this job alone. Its summary lands in ``result`` (default ``<out>.json``)."""

    config: str
    model: Path
    out: Path
    overrides: list[str] = field(default_factory=list)
    reward: str = "task"
    env: dict = field(default_factory=dict)
    result: Path | None = None

    def __post_init__(self):
        if self.result is None:
            self.result = self.out.with_name(self.out.name + ".json")

    def summary(self) -> dict:
        """The job's summary (``summary.json``'s content), as rank 0 wrote it."""
        return json.loads(Path(self.result).read_text())


def run_jobs(*jobs: Job, nproc: int = 2, timeout: int = 900) -> list[dict]:
    """Run ``jobs`` in turn in one torchrun launch (tests/dist/jobs_worker.py) and return their
    summaries: the interpreters and imports (~10-15 s a launch on 2 cores) are paid once. Each job
    builds, trains, checkpoints and exports as a launch of its own would; use it for jobs that do
    not depend on each other's outcome (a resume in a fresh process stays a launch of its own)."""
    spec = [{"config": j.config, "model": str(j.model), "out": str(j.out), "overrides": list(j.overrides),
             "result": str(j.result), "reward": j.reward, "env": j.env} for j in jobs]
    path = Path(jobs[0].out).parent / f"jobs-{Path(jobs[0].out).name}.json"
    path.write_text(json.dumps(spec, indent=1))
    run_torchrun("jobs_worker.py", str(path), nproc=nproc, timeout=timeout * len(jobs))
    return [j.summary() for j in jobs]


def run_vllm_worker(worker: str, workdir: Path, timeout: int = 600) -> dict:
    """Run ``tests/dist/<worker> <workdir> <result>`` in a Python process of its own (vLLM's in-process engine,
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, its KV cache 1 GiB) and return the JSON it wrote to ``result``."""
    result = Path(workdir) / f"{Path(worker).stem}.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "dist" / worker), str(workdir), str(result)],
                          env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return json.loads(result.read_text())


def run_torchrun_killed(worker: str, *args: str, log: Path, nproc: int = 2, timeout: int = 900) -> int:
    """Run ``tests/dist/<worker>`` as :func:`run_torchrun` does, for a worker that kills itself
    (SIGKILL of its process group): output to ``log`` (a file, not a pipe: the killed ranks' helper
    processes, e.g. vLLM's, outlive them and would hold a pipe open), and whatever outlives the run
    killed with it. Returns torchrun's exit status."""
    import contextlib
    import signal

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "tests" / "dist" / worker), *args]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                             stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return p.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)


#: fixtures of a machine-wide resource: a test that uses one is marked ``serial`` and runs alone, after the slow
#: tier's parallel part (scripts/test.sh). The local Slurm cluster is one per session and worker.
SERIAL_FIXTURES = ("slurm_cluster",)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The tiers (CONTRIBUTING.md): a ``heavy`` test is also ``slow``, so ``-m "not slow"`` (the
    developer's loop) runs no torchrun, vLLM, Slurm or nemo-run job; every machine runs every test
    (none is skipped for the CPU's speed). A test using a :data:`SERIAL_FIXTURES` fixture is marked
    ``serial``. On an xdist worker the files with ``heavy`` tests come first (most first), so that with
    ``--dist loadfile`` the two workers do not end with one long file on one of them while the other idles."""
    for item in items:
        if "heavy" in item.keywords and "slow" not in item.keywords:
            item.add_marker(pytest.mark.slow)
        if any(f in getattr(item, "fixturenames", ()) for f in SERIAL_FIXTURES):
            item.add_marker(pytest.mark.serial)
    if not hasattr(config, "workerinput"):
        return
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    heavy: dict[str, int] = {}
    for item in items:
        heavy[file(item)] = heavy.get(file(item), 0) + ("heavy" in item.keywords)
    first = {name: i for i, name in enumerate(dict.fromkeys(map(file, items)))}
    items.sort(key=lambda item: (-heavy[file(item)], first[file(item)]))  # stable within a file


#: The skips CI accepts (``CI=true``, which ``.ci/run`` sets): no GPU, and the check of a cache that exists only
#: where the CPU has it (oneDNN's bf16 matmul primitives, on AVX-512; elsewhere bf16 matmuls take PyTorch's
#: reference GEMM, which caches nothing). Any other skip (no bubblewrap, no tmpfs, no Slurm, no nemo-run, no
#: vLLM) fails the run: CI never passes a test it did not run.
ALLOWED_CI_SKIPS = ("needs a CUDA GPU", "bf16 matmuls go through oneDNN (and its caches) only on AVX-512")


def skip_reason(report) -> str:
    """The reason of a skipped test or module report (pytest keeps ``(path, line, "Skipped: why")``)."""
    longrepr = report.longrepr
    return str(longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else longrepr)


def pytest_sessionfinish(session, exitstatus):
    """Under ``CI=true``: the number of skipped tests and their reasons printed, and the run failed
    (exit status 1) when a reason is not in :data:`ALLOWED_CI_SKIPS`."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if os.environ.get("CI") != "true" or hasattr(session.config, "workerinput") or reporter is None:
        return
    skipped = [r for r in reporter.stats.get("skipped", []) if not getattr(r, "wasxfail", None)]
    refused = [r for r in skipped if not any(ok in skip_reason(r) for ok in ALLOWED_CI_SKIPS)]
    reporter.write_line(f"\nCI: {len(skipped)} skipped, {len(refused)} of them for a reason CI does not accept")
    for r in refused:
        reporter.write_line(f"CI: skipped and not allowed: {r.nodeid}: {skip_reason(r)}", red=True)
    if refused and session.exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Each test its own megalign cache (``$MEGALIGN_CACHE``): held-out accuracies and evaluation
    results are never read from the user's cache or from another test; jobs it launches inherit
    it. What is derived once and never differs, the converted models (``hf/``) and the demo data
    (``data/``), is shared through links to the real cache."""
    from alignment.cache import CACHE_ENV, cache_root

    shared, private = cache_root(), tmp_path / "megalign_cache"
    private.mkdir()
    for sub in ("hf", "data"):
        (shared / sub).mkdir(parents=True, exist_ok=True)
        (private / sub).symlink_to(shared / sub, target_is_directory=True)
    monkeypatch.setenv(CACHE_ENV, str(private))


@pytest.fixture
def torchrun_json(tmp_path):
    """Run a worker that writes a JSON result file as its last argument; return the parsed JSON."""

    def _run(worker: str, *args: str, nproc: int = 2, **kw):
        path = tmp_path / f"{Path(worker).stem}.json"
        run_torchrun(worker, *args, str(path), nproc=nproc, **kw)
        return json.loads(path.read_text())

    return _run


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real 2-node Slurm cluster on this host (:mod:`tests.slurm_cluster`), started once per
    session; skips when Slurm is not installed or we are not root (slurmd launches the jobs)."""
    from tests.slurm_cluster import SlurmCluster, slurm_installed

    if not slurm_installed():
        pytest.skip("Slurm is not installed (apt-get install -y --no-install-recommends slurmctld slurmd "
                    "slurm-client munge; .ci/run does)")
    if os.geteuid() != 0:
        pytest.skip("the local Slurm test cluster needs root (slurmd starts the jobs)")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


#: SmolLM2's <|im_end|>: the end of a ChatML turn
SMOLLM2_EOS = 2


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's tokenizer and chat template (from the package that ships it)."""
    from transformers import AutoTokenizer

    from alignment.models.hf_assets import prepare_hf_dir

    return AutoTokenizer.from_pretrained(prepare_hf_dir("smollm2"))


@pytest.fixture(scope="session")
def chatml_turns(smollm2_tokenizer):
    """:class:`alignment.rollout.episodes.turn_tokens.TurnTokens` of SmolLM2's template, ending turns at <|im_end|>."""
    from alignment.rollout.episodes.turn_tokens import TurnTokens

    return TurnTokens(smollm2_tokenizer, [SMOLLM2_EOS])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """An HF directory with a tiny random Llama and SmolLM2's tokenizer (:mod:`tests.dist.tiny_llama`)."""
    from tests.dist.tiny_llama import save_tiny_hf_dir

    return save_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "model")
