"""Shared pytest fixtures: real local desktops served by vm_server.py over real HTTP on loopback.

`vm_desktop` (session scope) starts ONE `python vm_server.py --xvfb --port 0 --token <random>` for
the whole test run and yields a `ServedDesktop`, which unpacks as `url, token, home = vm_desktop`
and also carries `.display` (for xdotool/wmctrl in tests) and `.proc`. The desktop is shared:
a test that changes it should POST /reset first (`vm_call(vm_desktop, "POST", "/reset")`).
`start_vm_server(...)` starts an extra one (or one on an existing DISPLAY with xvfb=False) when a test needs its own (stop it with `.stop()`).
Plain helpers the test files share (`from conftest import wait_for`): wait_for, free_port, mouse,
kill_x_server.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER = os.path.join(ROOT, "vm_server.py")


# -------------------------------------------------------------------------------------------------
# /proc: which processes a server, a trainer or a desktop left behind (tests and bench/ share these)

def _stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after "pid (comm)": [state, ppid, pgrp, ...]; [] if gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def proc_alive(pid: int) -> bool:
    """Running or sleeping: not gone, not a zombie (Z) or dead (X)."""
    return _stat(pid)[:1] not in ([], ["Z"], ["X"])


def proc_children(pid: int) -> list[int]:
    """The direct children of `pid` (zombies included: a test asks who was started, not who runs)."""
    return [int(n) for n in filter(str.isdigit, os.listdir("/proc")) if _stat(n)[1:2] == [str(pid)]]


def proc_descendants(pid: int) -> list[int]:
    """Every process below `pid`, zombies included: a sandboxed desktop's Xvfb, session and apps sit
    two levels of bubblewrap below the server's launcher, not among its children."""
    found, todo = [], [pid]
    while todo:
        kids = proc_children(todo.pop())
        found += kids
        todo += kids
    return found


def proc_group(pgid: int) -> list[int]:
    """The live members of process group `pgid` (a vm_server and its Xvfb, session, apps)."""
    return [int(n) for n in filter(str.isdigit, os.listdir("/proc"))
            if (f := _stat(n))[2:3] == [str(pgid)] and f[0] != "Z"]


def kill_x_server(pid: int) -> int:
    """SIGKILL the Xvfb below the desktop server `pid` and wait until it is gone: the server lives
    on and answers every request with 503 ("this desktop's X server died"). -> the Xvfb's pid."""
    def cmdline(p):
        try:
            return open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            return b""
    xs = [p for p in proc_descendants(pid) if cmdline(p).startswith(b"Xvfb\0")]
    assert len(xs) == 1, f"one X server expected below {pid}, found {xs}"
    os.kill(xs[0], signal.SIGKILL)
    wait_for(lambda: not proc_alive(xs[0]), "the X server to die")
    return xs[0]


@dataclass
class ServedDesktop:
    url: str
    token: str | None
    home: str
    display: str
    proc: subprocess.Popen
    err: object = None  # the server's stderr, a file (see stderr())

    def __iter__(self):  # `url, token, home = vm_desktop`
        return iter((self.url, self.token, self.home))

    def stderr(self) -> str:
        """What the server wrote to stderr so far."""
        self.err.seek(0)
        return self.err.read()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_vm_server(*args: str, xvfb: bool = True, token: str | None = "", timeout: float = 60,
                    env=None, server: str = SERVER) -> ServedDesktop:
    """Start vm_server.py (--xvfb unless xvfb=False; extra CLI `args`) and wait for its ready
    line. token="" draws a random token; token=None starts it without one. `server`: another
    copy of vm_server.py (bench/hostile_vm.py runs an older revision beside this one)."""
    token = secrets.token_hex(8) if token == "" else token
    cmd = [sys.executable, server, "--port", "0", *(["--xvfb"] if xvfb else []), *args]
    cmd += ["--token", token] if token else []
    err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                            start_new_session=True)
    deadline = time.time() + timeout
    line = ""
    while time.time() < deadline and proc.poll() is None:
        line = proc.stdout.readline()  # the server prints its ready line once the desktop is up
        if line.startswith("vm_server: serving"):
            break
    m = re.match(r"vm_server: serving (\S+) display (\S+) screen \S+ home (.+)$", line.strip())
    if not m:
        proc.kill()
        proc.wait()
        err.seek(0)
        raise RuntimeError(f"vm_server did not start: {line!r} {err.read()[-2000:]}")
    return ServedDesktop(m[1], token, m[3], m[2], proc, err)


def vm_call(vm: ServedDesktop, method: str, path: str, body=None, token: str | None = "", timeout=60):
    """One HTTP request to a served desktop; token="" uses the desktop's own token."""
    token = vm.token if token == "" else token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, vm.url + path, json=body, headers=headers, timeout=timeout)


def wait_for(cond, what: str, timeout: float = 20.0, every: float = 0.1):
    """Poll `cond()` until it returns something truthy, and return that; AssertionError naming
    `what` if it has not within `timeout` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    """A loopback TCP port nothing listens on (the kernel's pick; free when this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mouse(vm: ServedDesktop) -> tuple[int, int]:
    """The pointer's position on the desktop's display, read with xdotool from outside the server."""
    out = subprocess.run(["xdotool", "getmouselocation", "--shell"], env={**os.environ, "DISPLAY": vm.display},
                         capture_output=True, text=True, timeout=10).stdout
    d = dict(line.split("=", 1) for line in out.split())
    return int(d["X"]), int(d["Y"])


@pytest.fixture(scope="session")
def vm_desktop():
    vm = start_vm_server()
    yield vm
    vm.stop()
