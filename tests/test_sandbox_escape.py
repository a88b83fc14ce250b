"""The adversarial suite: programs that try to get out of the sandbox's bubblewrap container, each
checked from outside (the host's files, a listening socket, a process to kill, the processes left)
to have ended contained, and with :attr:`SandboxResult.reason` naming what stopped it. Cases marked
``hook off`` run without the audit hook (a negative control: the container and the limits alone)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from alignment.sandbox.bwrap import probe
from alignment.sandbox.runner import SandboxLimits, run_python

ROOT = Path(__file__).resolve().parents[1]
LIMITS = SandboxLimits(wall_seconds=8, cpu_seconds=1, memory_mb=256, disk_mb=8, processes=32)
pytestmark = [pytest.mark.serial,  # counts every process of nobody's: nothing else may sandbox meanwhile
              pytest.mark.skipif(probe() is not None, reason=f"no bubblewrap container here: {probe()}"),
              # serial tests run one at a time: no other test's sandbox runs as uid 65534 meanwhile, so a
              # process of that uid left after an attack is this attack's
              pytest.mark.slow]


@dataclass(frozen=True)
class Attack:
    name: str
    code: str  # formatted with the outside world: {secret}, {outside}, {port}, {canary}
    reason: str  # a part of SandboxResult.reason
    hook: bool = True  # run with the audit hook


REFUSED = "refused by the audit hook"
#: as root, the container's init (bwrap, PID 1) stays root while the code runs as 65534; as another user,
#: both are that user (its environment is empty; killing it ends the whole run)
ROOT_INIT = os.geteuid() == 0
ATTACKS = [
    # processes
    Attack("fork bomb", "import os\nwhile True: os.fork()", f"{REFUSED}: PermissionError: sandbox: os.fork"),
    Attack("fork bomb, hook off", "import os\nwhile True: os.fork()", "process limit", hook=False),
    Attack("thread bomb", "import threading, time\nwhile True: threading.Thread(target=time.sleep, args=(60,), daemon=True).start()",
           "process limit"),
    Attack("shell fork bomb", "import subprocess; subprocess.run(['sh', '-c', 'b(){{ b|b& }}; b'])",
           f"{REFUSED}: PermissionError: sandbox: importing _posixsubprocess"),
    Attack("shell fork bomb, hook off", "import os, subprocess, time\n"
           "subprocess.Popen(['sh', '-c', 'b(){{ b|b& }}; b'])\ntime.sleep(2)\n"
           "n = sum(p.isdigit() for p in os.listdir('/proc'))\nassert n <= 40, n  # RLIMIT_NPROC=32 binds", "ok",
           hook=False),
    Attack("background process", "import os; os.system('sleep 100 &')", f"{REFUSED}: PermissionError: sandbox: os.system"),
    # memory, time, output, disk, descriptors
    Attack("memory bomb", "x = bytearray(4 << 30)", "memory limit"),
    Attack("slow memory bomb", "l = []\nwhile True: l.append(bytearray(1 << 20))", "memory limit"),
    Attack("endless output", "import sys\nwhile True: sys.stdout.write('x' * 65536)", "file size limit"),
    Attack("disk fill", "i = 0\nwhile True:\n    open(f'f{{i}}', 'wb').write(b'x' * 500_000); i += 1", "disk limit"),
    Attack("disk fill in /tmp", "i = 0\nwhile True:\n    open(f'/tmp/f{{i}}', 'wb').write(b'x' * 500_000); i += 1",
           "disk limit", hook=False),
    Attack("descriptor bomb", "fs = [open('main.py') for _ in range(10_000)]", "open files limit"),
    Attack("sleep past the wall clock", "import time; time.sleep(100)", "wall clock"),
    Attack("busy loop", "while True: pass", "CPU time limit"),
    # reading what is not its own
    Attack("read /etc/shadow", "print(open('/etc/shadow').read())", "not in the container"),
    Attack("read the job's files", "print(open({secret!r}).read())", "not in the container"),
    Attack("read the checkout", f"print(open({str(ROOT / 'pyproject.toml')!r}).read())", "not in the container"),
    Attack("read the launcher's environment", "print(open('/proc/1/environ', 'rb').read())",
           "permission denied (unprivileged uid)" if ROOT_INIT else "ok"),
    Attack("list the machine's processes", "import os; print(len(os.listdir('/proc'))); "
           "assert not any(p.isdigit() and int(p) > 10 for p in os.listdir('/proc')), 'other processes seen'", "ok"),
    # writing outside
    Attack("write the system", "open('/usr/evil', 'w').write('x')", f"{REFUSED}: PermissionError: sandbox: writing"),
    Attack("write the system, hook off", "open('/usr/evil', 'w').write('x')", "read-only file system", hook=False),
    Attack("write the job's directory, hook off", "open({outside!r}, 'w').write('x')", "not in the container",
           hook=False),
    Attack("symlink escape", "import os; os.symlink({outside!r}, 'link'); open('link', 'w').write('x')",
           f"{REFUSED}: PermissionError: sandbox: os.symlink"),
    Attack("symlink escape, hook off", "import os; os.symlink({outside!r}, 'link'); open('link', 'w').write('x')",
           "not in the container", hook=False),
    Attack("/proc/self/mem", "open('/proc/self/mem', 'r+b').write(b'x')", f"{REFUSED}: PermissionError: sandbox: writing"),
    # network
    Attack("connect to 127.0.0.1", "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
           f"{REFUSED}: PermissionError: sandbox: socket.__new__"),
    Attack("connect to 127.0.0.1, hook off", "import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)",
           "connection refused (the container's own network)", hook=False),
    Attack("reach the internet, hook off", "import socket; socket.create_connection(('1.1.1.1', 53), timeout=2)",
           "no network", hook=False),
    # other processes and privileges
    Attack("kill the parent", "import os, signal; os.kill(os.getppid(), signal.SIGKILL)",
           f"{REFUSED}: PermissionError: sandbox: os.kill"),
    Attack("kill the launcher, hook off", "import os, signal; os.kill(1, signal.SIGKILL)",
           "not permitted" if ROOT_INIT else "killed by SIGKILL", hook=False),
    Attack("kill a process of the machine, hook off", "import os, signal; os.kill({canary}, signal.SIGKILL)",
           "no such process (PID namespace)", hook=False),
    Attack("kill everything, hook off", "import os, signal; os.kill(-1, signal.SIGKILL); print('alive')", "ok",
           hook=False),
    Attack("become root again, hook off", "import os; os.setuid(0)", "not permitted", hook=False),
    Attack("ctypes", "import ctypes; ctypes.CDLL(None).fork()", f"{REFUSED}: PermissionError: sandbox: importing ctypes"),
    Attack("LD_PRELOAD", "import os, sys; os.environ['LD_PRELOAD'] = '/sandbox/evil.so'; "
           "os.execv(sys.executable, [sys.executable, '-c', 'pass'])", f"{REFUSED}: PermissionError: sandbox: os.exec"),
    Attack("a shell reads /etc/shadow, hook off", "import os; os.execv('/bin/sh', ['sh', '-c', 'cat /etc/shadow'])",
           "exit status 1", hook=False),
    # around the audit hook in Python: the container still holds
    Attack("__builtins__ trick", "import builtins, os.path\nbuiltins.isinstance = lambda *a: True\n"
           "os.path.realpath = lambda p: '/sandbox/x'\nopen('/usr/evil', 'w').write('x')",
           f"{REFUSED}: PermissionError: sandbox: writing"),
    Attack("the hook's closure rewritten", "import gc\n"
           "inside = [f for f in gc.get_objects() if getattr(f, '__name__', '') == 'inside'][0]\n"
           "for cell in inside.__closure__:\n"
           "    if cell.cell_contents == '/sandbox': cell.cell_contents = ''\n"
           "open('/usr/evil', 'w').write('x')", "read-only file system"),
    Attack("escape by subclasses", "posix = [c for c in ().__class__.__base__.__subclasses__() "
           "if c.__name__ == 'BuiltinImporter'][0].load_module('posix'); posix.system('id')",
           f"{REFUSED}: PermissionError: sandbox: os.system"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """What the attacks aim at, outside the container: a secret file, a path to write, a listening
    socket on 127.0.0.1 and a process of the machine's."""
    d = tmp_path_factory.mktemp("outside")
    secret = d / "secret.txt"
    secret.write_text("the job's secret")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield {"secret": str(secret), "outside": str(d / "written"), "port": server.getsockname()[1],
           "canary": canary.pid, "server": server, "proc": canary, "dir": d}
    canary.kill()
    canary.wait()
    server.close()


def nobody_processes() -> set[int]:
    return {p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534}


@pytest.mark.parametrize("attack", ATTACKS, ids=[a.name for a in ATTACKS])
def test_attack_is_contained(attack: Attack, world):
    before = nobody_processes()
    t = time.perf_counter()
    r = run_python(attack.code.format(**world), LIMITS, isolation="bwrap", audit_hook=attack.hook)
    assert attack.reason in r.reason, (attack.name, r.reason, r.stderr[-500:])
    assert time.perf_counter() - t < LIMITS.wall_seconds + 5  # ended, within the wall clock
    # nothing got out: the host's files, the socket, the other process; nothing left running
    assert sorted(p.name for p in world["dir"].iterdir()) == ["secret.txt"]
    assert world["secret"] not in r.stdout or attack.reason != "ok"
    assert "the job's secret" not in r.stdout and "root:" not in r.stdout
    assert not os.path.exists("/usr/evil")
    with pytest.raises(BlockingIOError):
        world["server"].accept()
    assert world["proc"].poll() is None
    deadline = time.time() + 5
    while nobody_processes() - before and time.time() < deadline:
        time.sleep(0.1)
    assert not nobody_processes() - before


def test_the_suite_is_large_and_runs_as_nobody():
    assert len(ATTACKS) >= 30
    r = run_python("import os; print(os.getuid(), os.getgid(), os.getgroups(), os.getpid())", LIMITS,
                   isolation="bwrap")
    assert r.ok and r.stdout == "65534 65534 [] 2\n" and r.isolation == "bwrap"
