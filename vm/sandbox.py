"""vm/sandbox.py: `python vm_server.py --xvfb` inside bubblewrap, so an agent's terminal is not a shell
on the trainer's machine.

`vm_server.py --xvfb` binds its port, then re-runs itself under `bwrap` before it
starts anything, handing in the listening socket and the token (a pipe), so the server, Xvfb, the
session and every app (the agent's terminal included) see only the host's system folders
(read-only) and what the server runs from, a private /tmp and /dev, their own PID, IPC, UTS and
network namespaces (a loopback of their own: no route to the host's services, another desktop or
out; the socket handed in stays on the host's loopback), and run as an unprivileged user without
capabilities (the host's `nobody` when started by root). The desktop's HOME (and its
XDG_RUNTIME_DIR) is the one writable place, and everything dies with the server. The display
admits only clients with its cookie (`Xauthority` beside HOME, read-only inside), the apps'
environment is built from a short list (no credentials of the caller's), and Xt's per-user resource files (`~/XTerm`, `~/XCalc`,
`~/.Xdefaults-<host>`) are switched off: they are code (a translations resource types into the
shell). `--no-sandbox` runs without bubblewrap.

Top to bottom: what the sandbox sees (SYSTEM; its environment is desktop.ENV_KEEP), its bubblewrap
command line (`bwrap_argv`), and `launch`, which vm_server.py calls outside the sandbox: it makes the desktop's
folder (desktop.make_tmp), runs the server inside and removes the folder when it ends.
Tested through `python -m pytest -q tests/test_sandbox.py tests/test_containment.py` (real Xvfb
desktops; the second types an agent's attacks into a desktop's terminal).

Where this departs from the papers' environment: OSWorld's VM is its own sandbox; a local desktop
has none, and an exploring agent types anything into its terminal.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

from vm import FILES
from vm import limits as L
from vm.desktop import ENV_KEEP, make_tmp, remove_tree
from vm.procs import descendants

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: vm_server.py's folder

SANDBOX_LINE = ("vm_server: sandbox: bubblewrap (only the host's system folders, read-only; this desktop's HOME "
                "the one writable place; private /tmp, /dev, PID, IPC and network namespaces, no route out; an "
                "unprivileged user without capabilities, nobody when started as root)")
# The part of the host's tree the desktop's apps need: programs, libraries, fonts, icons, /etc and
# /var (font caches, the MIME database). The rest (/root, /home, /srv, /mnt, /opt, /run and its
# sockets, data and project folders) is not there at all; what the server runs from is added.
SYSTEM = ("/usr", "/etc", "/var", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
NOBODY = 65534  # the host user the desktop runs as when root starts the server


def bwrap_argv(bwrap: str, tmp: str, command: list[str], nested: bool = True, tmp_bytes: int | None = None) -> list[str]:
    """The bubblewrap command line that runs `command` confined to the desktop folder `tmp`.

    Files: the host's SYSTEM folders read-only, what the server runs from (the Python prefix and
    search path, and the repository's vm.FILES: vm_server.py, actions.py and vm/, not its tasks/ or runs/), a private
    /tmp and /var/tmp, and the desktop folder, whose HOME and run/ (XDG_RUNTIME_DIR) are the only
    writable places. The folder holding every desktop's folder is an empty tmpfs: no desktop sees
    another's HOME or X cookie.
    Network: a namespace of its own, with only a loopback of its own. No route to the host's
    loopback services, to another desktop's server or X display (an X server's abstract socket
    lives in its network namespace), or out. The server still serves on the host's loopback: the
    launcher binds the port outside and hands the socket in, and a socket keeps the namespace it
    was made in (no proxy, no extra hop).
    User: started by root, root's bubblewrap makes the sandbox and `setpriv` runs everything in it
    as the host's user nobody, without groups or capabilities, so file permissions keep root's
    files (/etc/shadow) from it as from any unprivileged user. (bwrap's own --uid would map nobody
    inside to root outside.) `nested` adds an unprivileged bwrap inside whose --disable-userns
    keeps the agent from making user namespaces of its own. Started by another user, one
    unprivileged bwrap runs everything as that same user."""
    home, run, parent = os.path.join(tmp, "home"), os.path.join(tmp, "run"), os.path.dirname(tmp)
    cmd = [bwrap]
    for p in SYSTEM:
        if os.path.islink(p):  # merged /usr: /bin -> usr/bin
            cmd += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            cmd += ["--ro-bind", p, p]
    size = ["--size", str(tmp_bytes)] if tmp_bytes else []  # each tmpfs at most this (vm/limits.py)
    cmd += ["--ro-bind", "/sys", "/sys",
            "--dev", "/dev",     # null, zero, random, tty, a private pts and shm; no disks
            "--perms", "1777", *size, "--tmpfs", "/dev/shm",  # shared memory: sized like /tmp
            "--proc", "/proc"]   # the processes of our own PID namespace only
    empty = ["/tmp"] + (["/var/tmp"] if os.path.isdir("/var/tmp") and not os.path.islink("/var/tmp") else [])
    for d in empty:  # private, gone with the sandbox
        cmd += ["--perms", "1777", *size, "--tmpfs", d]
    made = set(empty)

    def visible(path: str) -> bool:  # already there: inside a SYSTEM folder, not under a fresh tmpfs
        return any(path == d or path.startswith(d + "/") for d in SYSTEM) and \
            not any(path == d or path.startswith(d + "/") for d in made)

    def mount_point(path: str) -> list[str]:  # the folders above `path`, made traversable (bwrap's own are 0700)
        out, above = [], []
        while (path := os.path.dirname(path)) != "/":
            above.append(path)
        for d in reversed(above):
            if d not in made and not visible(d):
                out += ["--perms", "0755", "--dir", d]
                made.add(d)
        return out
    if parent not in made:  # the other desktops' folders beside ours
        cmd += mount_point(parent) + ["--tmpfs", parent]
        made.add(parent)
    runs_from = sorted(p for p in {sys.prefix, sys.base_prefix, *sys.path} if os.path.isabs(p) and os.path.isdir(p)
                       and not (ROOT == p or ROOT.startswith(p + "/")))  # never the project folder itself
    files = [os.path.join(ROOT, f) for f in FILES]  # what a VM needs of the repository (vm/__init__.py)
    bound: list[str] = []
    for path in runs_from + files:
        if not visible(path) and not any(path == b or path.startswith(b + "/") for b in bound):
            cmd += mount_point(path) + ["--ro-bind", path, path]
            bound.append(path)
    cmd += mount_point(tmp) + ["--ro-bind", tmp, tmp,  # the template, read-only: a reset always restores a clean HOME
                               "--bind", home, home,   # the one writable place that outlives the sandbox
                               "--bind", run, run,     # XDG_RUNTIME_DIR, and the display's cookie
                               "--remount-ro", "/"]    # bwrap's root, where the mount points were made
    cmd += ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            # No --new-session: the server stays in the launcher's process group, so signalling the
            # group freezes or stops the whole desktop. Nothing the agent can reach holds the
            # launcher's terminal (the apps get /dev/null and sessions of their own; the server's
            # descriptors are out of reach, it is not dumpable).
            "--die-with-parent",   # bwrap, and with it everything inside, dies with the launcher
            "--chdir", home, "--setenv", "TMPDIR", "/tmp", "--setenv", "VM_SERVER_SANDBOX", tmp]
    # bwrap covers these itself where it sees them writable; some kernels (gVisor) hide that
    sysctl = ["--ro-bind-try", "/proc/sys", "/proc/sys", "--ro-bind-try", "/proc/sysrq-trigger", "/proc/sysrq-trigger"]
    # --disable-userns (bubblewrap >= 0.8): no user namespace of the agent's, whose root could mount things
    no_userns = ["--disable-userns"] if "--disable-userns" in _bwrap_help(bwrap) else []
    if os.getuid() == 0:
        inner = [bwrap, "--dev-bind", "/", "/", *sysctl, "--unshare-user", *no_userns, "--uid", str(NOBODY),
                 "--gid", str(NOBODY), "--cap-drop", "ALL", "--chdir", home, "--"] if nested and no_userns else []
        cmd += ([] if inner else sysctl) + [
            "--", "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--", *inner, *command]
    else:
        cmd += [*sysctl, "--unshare-user", *no_userns, "--uid", str(os.getuid()), "--gid", str(os.getgid()),
                "--cap-drop", "ALL", "--", *command]
    return cmd


@functools.lru_cache(maxsize=None)
def _bwrap_help(bwrap: str) -> str:
    return subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout


def launch(argv: list[str], sock: socket.socket, token: str | None, limits: L.Limits | None = None) -> int:
    """`vm_server.py --xvfb` outside the sandbox: bound the desktop (vm/limits.py: this process and
    all it starts in the desktop's cgroups, its folder on a sized tmpfs), make the desktop's folder,
    run the server with `argv` inside bubblewrap, serve its resets' kills, wait for it, then remove
    it all. The server gets the listening socket `sock` (bound here, on the host's network) and the
    token through a pipe, so the token is in no argv or environment a process of the desktop could
    read. SIGTERM, SIGHUP and Ctrl-C end the sandbox (bwrap's --die-with-parent and the PID
    namespace take every process in it); a kill -9 of this launcher does too (only the folder, and
    its mount and cgroups as root, are then left: the next desktop's launcher does not reuse them)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        sys.exit("vm_server: --xvfb runs each desktop inside a bubblewrap sandbox and `bwrap` is not installed; "
                 "install it (`apt-get install bubblewrap`, part of `bash setup.sh`), or pass --no-sandbox to "
                 "run the desktop unconfined.")
    root = os.getuid() == 0
    if root and shutil.which("setpriv") is None:
        sys.exit("vm_server: started as root, the sandbox runs the desktop as the user nobody through `setpriv`, "
                 "which is not installed; install util-linux, or pass --no-sandbox to run the desktop unconfined.")
    limits = limits or L.parse("")
    L.oom_first()  # this launcher and everything it starts: the OOM killer's first choice, before the trainer
    why, box = L.available(), None
    if why is None:
        L.sweep(remove_tree)  # what a SIGKILLed launcher before us left
        box = L.Box(f"desktop-{os.getpid()}", limits)
        box.join(os.getpid())
        print(f"vm_server: limits: memory {limits.memory >> 20} MB, {limits.pids} processes, {limits.cpus:g} CPU, "
              f"disk {limits.disk >> 20} MB, /tmp {limits.tmp >> 20} MB", file=sys.stderr, flush=True)
    else:
        print(f"vm_server: limits: /tmp, /var/tmp, /dev/shm {limits.tmp >> 20} MB each; memory, processes, CPU and "
              f"the disk of HOME are not bounded ({why}: no cgroups)", file=sys.stderr, flush=True)
    tmp, fds, resets = make_tmp(box.mount_disk if box else None), [], None
    try:
        if root:  # the sandbox's user writes HOME and XDG_RUNTIME_DIR, and reads the cookie
            for d in ("home", "run", "Xauthority"):
                os.chown(os.path.join(tmp, d), NOBODY, NOBODY)
        # Without the inner user namespace where the machine forbids unprivileged ones (then the
        # agent cannot make one either).
        for nested in ((True, False) if root else (False,)):
            probe = subprocess.run(bwrap_argv(bwrap, tmp, ["true"], nested, limits.tmp), capture_output=True, text=True)
            if probe.returncode == 0:
                break
        else:
            why = (probe.stderr.strip().splitlines() or [f"exit code {probe.returncode}"])[-1]
            sys.exit(f"vm_server: bubblewrap cannot make a sandbox on this machine ({why}); pass --no-sandbox to "
                     f"run the desktop unconfined.")
        print(SANDBOX_LINE, file=sys.stderr, flush=True)
        extra, fds = ["--listen-fd", str(sock.fileno())], [sock.fileno()]
        if token:  # a pipe holds it until the server reads it (it is far below a pipe's buffer)
            r, w = os.pipe()
            os.write(w, token.encode())
            os.close(w)
            extra, fds = extra + ["--token-fd", str(r)], fds + [r]
        if box is not None:  # the server asks us for its resets' kills through this socket
            resets, inner_end = socket.socketpair()
            fd = inner_end.detach()  # a plain descriptor: closed below once the server holds it
            extra, fds = extra + ["--reset-fd", str(fd)], fds + [fd]
            threading.Thread(target=serve_resets, args=(box, resets), daemon=True).start()
        script = os.path.join(ROOT, "vm_server.py")
        proc = subprocess.Popen(bwrap_argv(bwrap, tmp, [sys.executable, script, *argv, *extra], nested, limits.tmp),
                                stdin=subprocess.DEVNULL, pass_fds=fds,
                                env={k: v for k, v in os.environ.items() if k in ENV_KEEP})
        for fd in fds[1:]:
            os.close(fd)
        sock.close()  # the server inside holds it now
        fds = []
        try:
            return proc.wait()
        except KeyboardInterrupt:
            return 130
        finally:
            inside = descendants(proc.pid)
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
            deadline = time.time() + 5  # the PID namespace's processes die a moment after bwrap
            while any(map(_alive, inside)) and time.time() < deadline:
                time.sleep(0.05)
    finally:
        for fd in fds[1:]:
            os.close(fd)
        if box is not None:
            box.close()  # whatever the sandbox left, its disk and its cgroups
        remove_tree(tmp)


def _alive(pid: int) -> bool:
    """Running or sleeping: not gone, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def serve_resets(box: L.Box, conn: socket.socket) -> None:
    """The launcher's side of the server's resets: each request `reset <server pid> <X server pid>`
    (PIDs in the sandbox's namespace) kills every process of the desktop but those, the sandbox's
    own and this launcher (vm/limits.py: Box.kill), and answers `ok <killed>`. Ends with the server."""
    f = conn.makefile("rwb", buffering=0)
    for line in f:
        words = line.split()
        if len(words) != 3 or words[0] != b"reset" or not all(w.isdigit() for w in words[1:]):
            continue
        try:
            keep = L.keep_set(box, os.getpid(), int(words[1]), int(words[2]))
            killed = box.kill(keep)
            f.write(b"ok %d\n" % killed)
        except OSError as e:
            f.write(b"error %s\n" % str(e).encode()[:200])

