"""Shared pytest fixtures: real local desktops served by vm_server.py over real HTTP on loopback.

`vm_desktop` (session scope) starts ONE `python vm_server.py --xvfb` for the whole test run, on a
port we bind and hand over (--listen-fd), with the token vm_rules.vm_token derives from a secret
of this test session (SECRET) and its URL, handed over through a pipe (--token-fd), as
env.launch_local_vms does. It yields a `ServedDesktop`, which unpacks as
`url, token, home = vm_desktop` and also carries `.display`, `.secret` and `.proc`. The desktop is
shared: a test that changes it should POST /reset first (`vm_call(vm_desktop, "POST", "/reset")`).
`start_vm_server(...)` starts an extra one (or one on an existing desktop's display with
xvfb=False, display_of=that desktop) when a test needs its own (stop it with `.stop()`).
Plain helpers the test files share (`from conftest import wait_for`): wait_for, free_port, and
x_env / x11 / mouse, the sanctioned way from the host to a desktop's X display (below),
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
sys.path.insert(0, ROOT)
from vm.rules import vm_token  # noqa: E402

SECRET = secrets.token_hex(8)  # this session's trainer secret: each server's token is derived from it


# -------------------------------------------------------------------------------------------------
# /proc: which processes a server, a trainer or a desktop left behind (tests and bench/ share these)

def proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after "pid (comm)": [state, ppid, pgrp, ...]; [] if gone."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return []


def proc_comm(pid: int | str) -> str:
    """The process's name (/proc/<pid>/comm), or "" if it is gone."""
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def proc_alive(pid: int) -> bool:
    """Running or sleeping: not gone, not a zombie (Z) or dead (X)."""
    return proc_stat(pid)[:1] not in ([], ["Z"], ["X"])


def proc_children(pid: int) -> list[int]:
    """The direct children of `pid` (zombies included: a test asks who was started, not who runs)."""
    return [int(n) for n in filter(str.isdigit, os.listdir("/proc")) if proc_stat(n)[1:2] == [str(pid)]]


def proc_descendants(pid: int) -> list[int]:
    """Every process below `pid`, zombies included: a sandboxed desktop's Xvfb, session and apps sit
    two levels of bubblewrap below the server's launcher, not among its children."""
    kids: dict[int, list[int]] = {}  # one pass over /proc, not one per process of the tree
    for n in filter(str.isdigit, os.listdir("/proc")):
        if len(f := proc_stat(n)) > 1:
            kids.setdefault(int(f[1]), []).append(int(n))
    found, todo = [], [pid]
    while todo:
        below = kids.get(todo.pop(), [])
        found += below
        todo += below
    return found


def proc_group(pgid: int) -> list[int]:
    """The live members of process group `pgid` (a vm_server and its Xvfb, session, apps)."""
    return [int(n) for n in filter(str.isdigit, os.listdir("/proc"))
            if (f := proc_stat(n))[2:3] == [str(pgid)] and f[0] != "Z"]


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
    secret: str | None = None  # what its token was derived from (VMPool(urls, token=secret) finds it)

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


def start_vm_server(*args: str, xvfb: bool = True, token: str | None = "", secret: str = SECRET,
                    timeout: float = 60, env=None, server: str = SERVER, display_of: ServedDesktop | None = None,
                    legacy: bool = False) -> ServedDesktop:
    """Start vm_server.py (--xvfb unless xvfb=False; extra CLI `args`) on a loopback port we bind
    (--listen-fd) and wait for its ready line. token="" derives the token from `secret` and the
    URL (vm_rules.vm_token), token=None starts it without one, any other string is the token; it
    travels through a pipe (--token-fd). display_of=desktop runs it (xvfb=False) on that desktop's
    display, inside its network namespace (the socket we bind stays on the host's). `server`:
    another copy of vm_server.py; legacy=True for one older than --listen-fd, started with --port 0
    and the token on its argv (bench/hostile_vm.py runs an older revision beside this one)."""
    cmd, fds, r = [sys.executable, server, *(["--xvfb"] if xvfb else []), *args], [], None
    if legacy:
        token = secrets.token_hex(8) if token == "" else token
        cmd += ["--port", "0", *(["--token", token] if token else [])]
    else:
        sock = socket.create_server(("127.0.0.1", 0))
        token = vm_token(secret, f"http://127.0.0.1:{sock.getsockname()[1]}") if token == "" else token
        cmd += ["--listen-fd", str(sock.fileno())]
        fds.append(sock.fileno())
        if token:
            r, w = os.pipe()
            os.write(w, token.encode())
            os.close(w)
            cmd += ["--token-fd", str(r)]
            fds.append(r)
    if display_of is not None:
        prefix, xenv = x_env(display_of)
        cmd = prefix + cmd
        env = {**(os.environ if env is None else env), "DISPLAY": xenv["DISPLAY"], "XAUTHORITY": xenv["XAUTHORITY"]}
    err = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty server never blocks on it
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                start_new_session=True, pass_fds=fds)
    finally:
        if not legacy:
            sock.close()
        if r is not None:
            os.close(r)
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
    return ServedDesktop(m[1], token, m[3], m[2], proc, err, secret if not legacy else None)


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


# -------------------------------------------------------------------------------------------------
# The host's way to a desktop's X display. A sandboxed desktop's Xvfb listens only on an abstract
# socket in the sandbox's own network namespace (and on a path in its private /tmp), and admits
# only clients with its cookie (Xauthority beside HOME). A test enters that namespace (root
# may; another user joins the user namespace that owns it first, which it made itself, starting
# the sandbox) and shows the cookie; no process on another desktop can do either.

ENTER = """import ctypes, fcntl, os, sys
libc = ctypes.CDLL(None, use_errno=True)
net = os.open(sys.argv[1], os.O_RDONLY)
if os.getuid() != 0:
    user = fcntl.ioctl(net, 0xB701)  # NS_GET_USERNS: the user namespace that owns the network one
    if libc.setns(user, 0x10000000):  # CLONE_NEWUSER
        raise OSError(ctypes.get_errno(), "cannot join the sandbox's user namespace")
if libc.setns(net, 0x40000000):  # CLONE_NEWNET
    raise OSError(ctypes.get_errno(), "cannot join the sandbox's network namespace")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def netns_of(vm: ServedDesktop) -> str | None:
    """/proc/<pid>/ns/net of a process of the desktop in a network namespace not ours; None when it
    shares ours (--no-sandbox, or an older server)."""
    ours = os.readlink("/proc/self/ns/net")
    for pid in proc_descendants(vm.proc.pid):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") != ours:
                return f"/proc/{pid}/ns/net"
        except OSError:
            continue
    return None


def x_env(vm: ServedDesktop) -> tuple[list[str], dict]:
    """(argv prefix, environment) that run a program from the host on the desktop's display."""
    env = {**os.environ, "DISPLAY": vm.display, "XAUTHORITY": os.path.join(os.path.dirname(vm.home), "Xauthority")}
    ns = netns_of(vm)
    return ([] if ns is None else [sys.executable, "-c", ENTER, ns]), env


def in_x_namespace(vm: ServedDesktop, fn):
    """fn() run in a thread that entered the desktop's network namespace, with its cookie shown:
    what fn connects to there (an X display, through python-xlib) stays connected from any thread
    (a socket keeps the namespace it was made in). setns(CLONE_NEWNET) changes only the calling
    thread, so the test's own HTTP calls still reach the host's loopback. Root only."""
    import ctypes
    import threading
    prefix, env = x_env(vm)
    out: dict = {}

    def run():
        try:
            if prefix:
                if os.getuid() != 0:
                    pytest.skip("joining a sandbox's network namespace from a thread needs root")
                fd = os.open(netns_of(vm), os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000):  # CLONE_NEWNET
                        raise OSError(ctypes.get_errno(), "cannot join the sandbox's network namespace")
                finally:
                    os.close(fd)
            saved = {k: os.environ.get(k) for k in ("DISPLAY", "XAUTHORITY")}
            os.environ.update(DISPLAY=env["DISPLAY"], XAUTHORITY=env["XAUTHORITY"])
            try:
                out["value"] = fn()
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            out["error"] = e
    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def x11(vm: ServedDesktop, *argv: str, check: bool = False) -> subprocess.CompletedProcess:
    """Run `argv` (xdotool, wmctrl, xwininfo ...) on the desktop's display from the host."""
    prefix, env = x_env(vm)
    return subprocess.run([*prefix, *argv], env=env, capture_output=True, text=True, timeout=10, check=check)


def mouse(vm: ServedDesktop) -> tuple[int, int]:
    """The pointer's position on the desktop's display, read with xdotool from outside the server."""
    out = x11(vm, "xdotool", "getmouselocation", "--shell").stdout
    d = dict(line.split("=", 1) for line in out.split())
    return int(d["X"]), int(d["Y"])


@pytest.fixture(scope="session")
def vm_desktop():
    vm = start_vm_server()
    yield vm
    vm.stop()
