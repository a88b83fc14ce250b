"""The code sandbox: each limit enforced and each attack costing only its own run (a failed
result), and the pool running several at once."""

from __future__ import annotations

import os
import socket
import time
import uuid

import pytest

from alignment.sandbox.bwrap import probe
from alignment.sandbox.runner import ISOLATIONS, SandboxLimits, SandboxPool, network_isolation, run_python

FAST = SandboxLimits(wall_seconds=3, cpu_seconds=2)


@pytest.fixture(params=ISOLATIONS)
def run(request):
    """``run_python`` in the bubblewrap container, then in the fallback (the tests hold for both)."""
    if request.param == "bwrap" and probe() is not None:
        pytest.skip(f"no bubblewrap container here: {probe()}")

    def run(code, limits=SandboxLimits(), stdin=""):
        r = run_python(code, limits, stdin, isolation=request.param)
        assert r.isolation == request.param
        return r

    return run


def last_error(result) -> str:
    lines = result.stderr.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_program_runs_with_its_input_and_exit_status(run):
    r = run("import sys\nprint(input()[::-1])\nprint('err', file=sys.stderr)", FAST, stdin="abc\n")
    assert r.ok and r.returncode == 0 and r.stdout == "cba\n" and r.stderr == "err\n" and not r.truncated
    r = run("raise SystemExit(3)", FAST)
    assert r.returncode == 3 and not r.ok
    r = run("1 / 0", FAST)
    assert r.returncode == 1 and last_error(r) == "ZeroDivisionError: division by zero"
    r = run("import os; os.abort()", FAST)  # a crash: killed by SIGABRT (6)
    assert r.returncode == 128 + 6 and not r.ok


def test_time_limits(run):
    t = time.perf_counter()
    r = run("import time; time.sleep(60)", SandboxLimits(wall_seconds=1.5))
    assert r.timed_out and r.returncode is None and not r.ok and time.perf_counter() - t < 10
    # CPU time: SIGXCPU (24) at the soft limit, long before the wall clock
    r = run("while True: pass", SandboxLimits(wall_seconds=60, cpu_seconds=1))
    assert not r.timed_out and r.returncode == 128 + 24 and r.seconds < 30, r


def test_memory_and_output_limits(run):
    r = run("x = bytearray(2 * 1024 ** 3)", SandboxLimits(memory_mb=256))
    assert r.returncode == 1 and last_error(r) == "MemoryError"
    r = run("import sys\nwhile True: sys.stdout.write('x' * 65536)", SandboxLimits(file_bytes=1 << 20,
                                                                                          output_bytes=1000))
    assert r.truncated and r.stdout == "x" * 1000 and not r.ok  # stopped at 1 MiB, 1,000 bytes read back
    assert last_error(r) == "OSError: [Errno 27] File too large"


def test_no_writes_outside_its_directory(run):
    target = f"/tmp/megalign_escape_{uuid.uuid4().hex}"
    for code in (f"open({target!r}, 'w').write('x')", f"import os; os.open({target!r}, os.O_CREAT | os.O_WRONLY)",
                 f"import os; os.mkdir({target!r})", "import os; os.remove('/etc/hostname')",
                 f"import shutil; shutil.copy('main.py', {target!r})"):
        r = run(code, FAST)
        assert r.returncode == 1 and "outside the sandbox directory is not allowed" in last_error(r), (code, r)
        assert not os.path.exists(target)
    assert os.path.exists("/etc/hostname")
    r = run("import os\nos.mkdir('d')\nopen('d/f', 'w').write('ok')\nprint(open('d/f').read())", FAST)
    assert r.ok and r.stdout == "ok\n"  # its own directory is writable
    r = run("import os; print(open(os.__file__).read() != '')", FAST)
    assert r.ok and r.stdout == "True\n"  # reading the system is allowed


def test_no_network(run):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        r = run(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)", FAST)
        assert r.returncode == 1 and last_error(r) == "PermissionError: sandbox: socket.__new__ is not allowed"
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever connected
    finally:
        server.close()
    if r.isolation == "namespaces" and not network_isolation():
        pytest.skip("no network namespace on this kernel: only the audit hook refuses sockets")
    # below the audit hook: the sandbox's own network namespace holds only a loopback interface
    r = run("print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))", FAST)
    assert r.ok and r.stdout == "['lo']\n", r
    # and its own PID namespace: the code runs as process 2, under the namespace's init
    r = run("import os; print(os.getpid())", FAST)
    assert r.ok and r.stdout == "2\n"


@pytest.mark.parametrize("code", [
    "import os\nwhile True: os.fork()",  # fork bomb
    "import subprocess; subprocess.run(['sh', '-c', ':(){ :|:& };:'])",
    "import os; os.system('sleep 100 &')",
    "import ctypes; ctypes.CDLL(None).fork()",  # around the hook through libc
    "import os, signal; os.kill(1, signal.SIGKILL)",
])
def test_attacks_cost_only_their_own_run(code, run):
    r = run(code, FAST)
    assert r.returncode == 1 and "is not allowed" in last_error(r) and r.seconds < 3, (code, r)


def test_pool_runs_several_at_once_and_bad_limits_are_refused():
    codes = ["import time; time.sleep(1); print(%d)" % i for i in range(4)]
    t = time.perf_counter()
    with SandboxPool(workers=4, limits=FAST) as pool:
        futures = [pool.submit(c) for c in codes]  # returns at once: the runs go on meanwhile
        results = [f.result() for f in futures]
        overlapped = time.perf_counter() - t
        late = pool.map(["print(7)", "import time; time.sleep(60)"])
        assert [(r.stdout, r.timed_out) for r in late] == [("7\n", False), ("", True)]
    assert [r.stdout for r in results] == ["0\n", "1\n", "2\n", "3\n"] and all(r.ok for r in results)
    assert overlapped < 3.5  # four 1-second sleeps side by side (one after another: > 4 s)
    with pytest.raises(ValueError, match="sandbox limit memory_mb=0 must be > 0"):
        run_python("print(1)", SandboxLimits(memory_mb=0))
    with pytest.raises(ValueError, match="sandbox workers=0 must be >= 1"):
        SandboxPool(workers=0)
