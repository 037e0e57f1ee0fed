"""vm/procs.py: the desktop a server drives, and the processes it starts on it.

The bottom of the VM side: `DesktopState` (screen, HOME, environment, allow-list of one served desktop),
starting a program on it (`spawn`), its windows (`list_windows`, `app_windows`), and our process
tree (`descendants`, `reap`, `kill_tree`). vm_server.py, vm/act.py, vm/tasks.py, vm/rules.py and
vm/desktop.py build on it, and it imports nothing of ours (stdlib only). Nothing here runs on its own; it is copied into
a VM with vm_server.py. Tested through tests/test_vm_server.py and tests/test_sandbox.py.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass


@dataclass
class DesktopState:
    screen: tuple[int, int]
    home: str                 # every path in setup/evaluate stays inside it
    env: dict                 # the environment of every program we start
    allow: frozenset          # programs setup/evaluate may run
    xvfb: subprocess.Popen | None = None   # None: a real VM's existing display
    tmp: str | None = None    # --xvfb: holds template/, home/, run/; removed at exit
    display: str = ""
    resets: object = None     # in the sandbox, as root: the launcher's socket that kills for a reset (vm/limits.py)
    scratch: tuple = ()       # in the sandbox: its own /tmp, /var/tmp, /dev/shm, emptied by a reset


def prctl(option: int, arg: int) -> None:
    """Linux prctl(2) on this process (PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, ...)."""
    ctypes.CDLL(None).prctl(option, arg)


def list_windows(desk: DesktopState) -> list[tuple[int, int, str, str]]:
    """(X window id, workspace, class, title) of every managed window; workspace -1 = sticky (the
    desktop icons and the taskbar, which are part of the desktop, not windows an agent opened).
    The class is WM_CLASS as "instance.Class" (xterm.XTerm, pcmanfm.Pcmanfm), "" if the window has
    none: unlike a title (the file manager's is its folder) it names the program. An app's dialogs
    share its class (mousepad's Open File is mousepad.Mousepad)."""
    out = subprocess.run(["wmctrl", "-lx"], env=desk.env, capture_output=True, text=True,
                         errors="replace", timeout=10).stdout
    # wmctrl prints "0x%.8lx %2ld %-20s  %*s %s": id, workspace, the class padded to 20, the host
    # right-aligned, the title as the rest of the line. Columns split on whitespace would break on a
    # class with a space in it (`xterm -name "a b"` makes one), so the class is the first 20 characters,
    # or more up to two spaces, and the title keeps its spaces.
    rows = [re.fullmatch(r"(0x[0-9a-fA-F]{1,8}) +(-?[0-9]+) (.{20,}?)  +\S+ (.*)", line) for line in out.splitlines()]
    return [(int(m[1], 16), int(m[2]), "" if m[3].rstrip() == "N/A" else m[3].rstrip(), m[4])  # N/A: no class
            for m in rows if m]


def app_windows(desk: DesktopState, wm_class: bool = False) -> list[tuple]:
    """(X window id, title) of the application windows: the ones an agent can open or close;
    (X window id, title, class) with wm_class=True (GET /windows; vm/tasks.py's checks read titles)."""
    return [(i, title, c)[:3 if wm_class else 2] for i, ws, c, title in list_windows(desk) if ws != -1]


def spawn(desk: DesktopState, argv: list[str]) -> subprocess.Popen:
    """Start a program detached (own session, no stdio). We keep no handle: /reset and exit find
    every program by walking our process tree, double-forked ones included (we are a subreaper)."""
    return subprocess.Popen(argv, cwd=desk.home, env=desk.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def descendants(root: int) -> list[int]:
    """Every live (not zombie) process below `root`, from /proc."""
    children, zombies = {}, set()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]  # fields after "pid (comm)"
        except (OSError, ValueError):
            continue
        children.setdefault(int(ppid), []).append(int(name))
        zombies.update([int(name)] if state == b"Z" else [])
    out, todo = [], [root]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return [p for p in out if p not in zombies]


def reap() -> None:
    """Collect the exit status of every finished child: closed apps, and orphans we adopted as a
    subreaper. The server runs it under its request lock, like setup commands, so it never steals
    the status subprocess.run is waiting for (a Popen whose child we reaped just reports it gone)."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def kill_tree(keep: set[int]) -> None:
    """SIGTERM every process below us but `keep`; SIGKILL whatever is left after 2 s. Looks every
    5 ms: an app is gone within a few ms of SIGTERM (a reset waits for this)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids, deadline = [p for p in descendants(os.getpid()) if p not in keep], time.time() + 2
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        while pids and time.time() < deadline:
            time.sleep(0.005)
            reap()
            pids = [p for p in descendants(os.getpid()) if p not in keep]
        if not pids:
            return
