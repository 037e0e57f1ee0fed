"""vm/limits.py: each local desktop a bounded box. What its programs (the agent's terminal included)
can take of the host is capped: memory (tmpfs pages included), processes, disk and CPU; and a reset
kills every process of the agent's at once, so none can dodge it.

    box = Box("desktop-1234", parse("memory=1g,pids=512,cpus=1,disk=256m,tmp=256m"))   # root only
    box.join(os.getpid())       # the launcher and all it starts: the sandbox, the server, the desktop
    box.mount_disk(folder)      # the desktop's folder (HOME, run/, the template) on a sized tmpfs
    box.kill(keep={...})        # every process of the desktop but `keep`, with forks stopped first
    box.close()                 # everything killed, the cgroups and the mount removed

Why these mechanisms (this kernel has cgroup v1's memory, pids, cpu and cpuacct hierarchies; a
trainer started as root can make child cgroups):
- memory: a memory cgroup counts every page the desktop's processes hold, and the pages of tmpfs
  files they wrote (a file in /tmp is memory no process holds: killing processes frees none of it).
  At the limit the kernel's OOM killer picks a process of THAT cgroup, never the trainer; and every
  desktop process starts with oom_score_adj 1000, so under host-wide pressure a desktop's process
  goes before the trainer's too (raising one's own score needs no privilege).
- processes: a pids cgroup. The desktops all run as the host's `nobody`, so a per-user rlimit
  would be one budget shared by every desktop (and above the host's pid_max); a cgroup is per desktop.
- disk: the desktop's folder (HOME, XDG_RUNTIME_DIR, the HOME template) is a tmpfs of --limits
  disk bytes, mounted by the launcher; /tmp, /var/tmp and /dev/shm inside the sandbox are tmpfs of
  `tmp` bytes each (bubblewrap's --size). A full one is ENOSPC inside the desktop, not on the host's
  disk where the run folder lives, and all of it is memory, counted in the memory limit too.
- CPU: a CFS quota of `cpus` CPUs' worth of time per period (cpu cgroup): a busy loop in a desktop
  takes at most that, whatever it forks.
- the reset: the launcher (outside the sandbox, root) sets the desktop's pids.max to 0, so nothing
  in it can fork any more, then SIGKILLs every member of the cgroup but the launcher, the sandbox's
  own processes, the server and its X server, and gives the limit back. A process that takes a
  new PID every few milliseconds, or ignores SIGTERM, cannot outrun that: there is no list of PIDs
  to be late for.

Not root: no cgroup and no mount can be made, so memory, processes, the disk of HOME and run/, and
CPU are not bounded per desktop; only /tmp, /var/tmp and /dev/shm keep their sizes (bubblewrap
makes those tmpfs in its own user namespace), and a reset kills the agent's processes one by one
as before. The launcher says so in one line when the desktop starts. A remote VM is bounded by
whatever runs it (the VM's or container's own memory and CPU settings; docs/vm.md).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import re
import signal
import time
from dataclasses import dataclass

# The defaults, each far above what a desktop's apps use and far below what could hurt the host.
# A desktop with every one of its apps open holds a few hundred MB (the X server's framebuffer,
# the session, GTK apps); docs/log.md has what bench/bounds.py measured.
DEFAULTS = {
    "memory": 1 << 30,    # bytes: everything the desktop holds, its tmpfs files included
    "pids": 512,          # processes and threads (a GTK app runs several threads; the session ~100 in all)
    "cpus": 1.0,          # CPUs' worth of time: an app still starts at full speed on one core
    "disk": 256 << 20,    # bytes of HOME + run/ + the template (the template itself is a few KB)
    "tmp": 256 << 20,     # bytes of each of /tmp, /var/tmp, /dev/shm inside the sandbox
}
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
PERIOD_US = 100_000  # CFS period: the quota is cpus * this
PARENT = "gui-agent-rl"  # every desktop's cgroup sits below one of this name, below the launcher's own
SWEEP_LOCK = "/run/vm_server-sweep.lock"  # in root's own folder: no other user can plant it or hold it


@dataclass(frozen=True)
class Limits:
    memory: int
    pids: int
    cpus: float
    disk: int
    tmp: int

    def spec(self) -> str:
        """The --limits string that gives these limits back."""
        return f"memory={self.memory},pids={self.pids},cpus={self.cpus:g},disk={self.disk},tmp={self.tmp}"


def parse(spec: str | None) -> Limits:
    """--limits: comma-separated name=value of memory, pids, cpus, disk, tmp (sizes in bytes or with
    k/m/g; cpus a number of CPUs); the ones not given keep DEFAULTS. ValueError says what is wrong."""
    values = dict(DEFAULTS)
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        name, _, value = part.partition("=")
        name, value = name.strip().lower(), value.strip().lower()
        if name not in DEFAULTS:
            raise ValueError(f"unknown limit {name!r} in {spec!r}; the limits are {', '.join(DEFAULTS)}")
        try:
            if name == "cpus":
                number = float(value)
            elif name == "pids":
                number = int(value)
            else:
                m = re.fullmatch(r"(\d+)([kmg]?)b?", value)
                number = int(m[1]) * UNITS[m[2]] if m else int("x")
        except ValueError:
            raise ValueError(f"limit {name}={value!r} is not a number{'' if name in ('cpus', 'pids') else ' (bytes, or with k/m/g)'}") from None
        if not number > 0:
            raise ValueError(f"limit {name} must be positive, got {value!r}")
        values[name] = number
    if values["memory"] < 64 << 20 or values["pids"] < 32 or values["disk"] < 8 << 20 or values["tmp"] < 1 << 20:
        raise ValueError("a desktop needs at least memory=64m, pids=32, disk=8m and tmp=1m to start at all")
    return Limits(**values)


def _own_paths() -> dict[str, str]:
    """controller -> this process's cgroup path in it (cgroup v1, /proc/self/cgroup)."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(","):
                out[c] = path
    return out


def parent_dir(controller: str) -> str:
    """The folder under which this process's desktops get their cgroups in `controller`: beside
    this process's own cgroup (a launcher run inside a container's cgroup keeps them there)."""
    own = _own_paths().get(controller, "/")
    return os.path.join(f"/sys/fs/cgroup/{controller}", own.lstrip("/"), PARENT)


def available() -> str | None:
    """None if this process can make per-desktop cgroups (root, cgroup v1 memory/pids/cpu/cpuacct
    mounted), else why not, in a few words."""
    if os.geteuid() != 0:
        return "not root"
    for c in ("memory", "pids", "cpu", "cpuacct"):
        if not os.access(f"/sys/fs/cgroup/{c}", os.W_OK):
            return f"no writable cgroup v1 {c} hierarchy"
    return None


def _write(path: str, value) -> None:
    with open(path, "w") as f:
        f.write(str(value))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


class Box:
    """One desktop's cgroups (memory, pids, cpu, cpuacct) and its sized disk. Made by the launcher,
    as root, before the sandbox starts; `close` undoes it all."""

    def __init__(self, name: str, limits: Limits):
        self.limits, self.mounted = limits, None
        self.dirs = {c: os.path.join(parent_dir(c), name) for c in ("memory", "pids", "cpu", "cpuacct")}
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        _write(os.path.join(self.dirs["memory"], "memory.limit_in_bytes"), limits.memory)
        memsw = os.path.join(self.dirs["memory"], "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):  # with swap accounting: swap is no way around the limit either
            _write(memsw, limits.memory)
        _write(os.path.join(self.dirs["pids"], "pids.max"), limits.pids)
        _write(os.path.join(self.dirs["cpu"], "cpu.cfs_period_us"), PERIOD_US)
        _write(os.path.join(self.dirs["cpu"], "cpu.cfs_quota_us"), max(1000, int(limits.cpus * PERIOD_US)))

    def join(self, pid: int) -> None:
        """Move process `pid` into every cgroup of the desktop (its children to come follow it), and
        make it the first the OOM killer takes under host-wide pressure."""
        for d in self.dirs.values():
            _write(os.path.join(d, "cgroup.procs"), pid)
        _write(f"/proc/{pid}/oom_score_adj", 1000)

    def members(self) -> set[int]:
        """Every process in the desktop's pids cgroup now."""
        return {int(p) for p in _read(os.path.join(self.dirs["pids"], "cgroup.procs")).split()}

    def usage(self) -> dict:
        """What the desktop holds now: memory (bytes, its tmpfs files included), the highest it
        reached, how often it hit the limit, processes and threads, CPU seconds used so far."""
        mem, pids, acct = self.dirs["memory"], self.dirs["pids"], self.dirs["cpuacct"]
        return {"memory": int(_read(os.path.join(mem, "memory.usage_in_bytes"))),
                "memory_peak": int(_read(os.path.join(mem, "memory.max_usage_in_bytes"))),
                "memory_failcnt": int(_read(os.path.join(mem, "memory.failcnt"))),
                "pids": int(_read(os.path.join(pids, "pids.current"))),
                "cpu_seconds": int(_read(os.path.join(acct, "cpuacct.usage"))) / 1e9}

    def kill(self, keep: set[int], timeout: float = 5.0) -> int:
        """SIGKILL every process of the desktop but `keep`, at once: pids.max goes to 0 first, so no
        process of it can fork while we look (a fork already under way shows up in the next look),
        and each one is signalled through a pidfd taken while it is still a member, so a PID that
        ended and was reused outside meanwhile is never signalled. -> how many were killed."""
        limit = os.path.join(self.dirs["pids"], "pids.max")
        _write(limit, 0)
        killed, deadline = 0, time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                targets = self.members() - keep
                if not targets:
                    break
                for pid in targets:
                    killed += self._kill_member(pid)
                time.sleep(0.005)
        finally:
            _write(limit, self.limits.pids)
        return killed

    def _kill_member(self, pid: int) -> int:
        try:
            fd = os.pidfd_open(pid)
        except (ProcessLookupError, OSError):
            return 0  # gone already
        try:
            with open(f"/proc/{pid}/cgroup") as f:  # the process the pidfd holds: still one of ours?
                ours = any(line.split(":", 2)[1] == "pids" and line.rstrip("\n").endswith(
                    self.dirs["pids"].split("/sys/fs/cgroup/pids", 1)[1]) for line in f)
            if ours:
                signal.pidfd_send_signal(fd, signal.SIGKILL)
            return int(ours)
        except (ProcessLookupError, OSError):
            return 0
        finally:
            os.close(fd)

    def mount_disk(self, folder: str) -> None:
        """A tmpfs of `disk` bytes on `folder` (empty, made by the caller): HOME and run/ live in it."""
        libc = ctypes.CDLL(None, use_errno=True)
        opts = f"size={self.limits.disk},mode=0711".encode()
        if libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, opts) != 0:
            raise OSError(ctypes.get_errno(), f"cannot mount a tmpfs on {folder}")
        self.mounted = folder

    def close(self) -> None:
        """Kill whatever is left of the desktop (not the caller), unmount its disk, remove its cgroups."""
        try:
            self.kill(keep={os.getpid()})
        except OSError:
            pass
        if self.mounted:
            ctypes.CDLL(None).umount2(self.mounted.encode(), 2)  # MNT_DETACH: gone once nothing uses it
        for d in self.dirs.values():
            try:  # the caller leaves first: back into the cgroup it came from
                _write(os.path.join(os.path.dirname(os.path.dirname(d)), "cgroup.procs"), os.getpid())
            except OSError:
                pass
        for d in self.dirs.values():
            for _ in range(50):  # a cgroup goes once its last process is gone (killed ones: a moment)
                try:
                    os.rmdir(d)
                    break
                except OSError:
                    time.sleep(0.02)


@contextlib.contextmanager
def sweep_lock():
    """One sweep at a time on this host. Launchers start in parallel (env.launch_local_vms starts
    all of a pool's at once), and two sweeping one dead launcher's cgroups would race: the second
    reads the cgroup.procs of a cgroup the first has just removed, and its launcher dies at start
    on the FileNotFoundError. Tests hold it to look at what a killed launcher left before a sweep."""
    try:
        fd = os.open(SWEEP_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:  # no writable /run (a read-only root): sweep unlocked, as before, not never start
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd closes, or when its process dies
        yield
    finally:
        os.close(fd)


def sweep(remove_tree) -> None:
    """What launchers killed by SIGKILL left behind (their `finally` never ran): their desktops'
    cgroups and sized disks. Each name carries its launcher's PID (desktop-<pid>, vm_server-<pid>-*);
    a dead launcher's are removed, after a SIGKILL to anything still in them. One sweep at a time
    (sweep_lock)."""
    with sweep_lock():
        _sweep(remove_tree)


def _sweep(remove_tree) -> None:
    for c in ("memory", "pids", "cpu", "cpuacct"):
        parent = parent_dir(c)
        for name in os.listdir(parent) if os.path.isdir(parent) else []:
            m = re.fullmatch(r"desktop-(\d+)", name)
            if m and not os.path.exists(f"/proc/{m[1]}"):
                d = os.path.join(parent, name)
                for pid in _read(os.path.join(d, "cgroup.procs")).split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                for _ in range(50):
                    try:
                        os.rmdir(d)
                        break
                    except OSError:
                        time.sleep(0.02)
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if " - tmpfs " in line]
    for path in mounts:
        m = re.fullmatch(r".*/vm_server-(\d+)-[^/]+", path)
        if m and not os.path.exists(f"/proc/{m[1]}"):
            ctypes.CDLL(None).umount2(path.encode(), 2)
            remove_tree(path)


def keep_set(box: Box, launcher: int, server_ns_pid: int, xvfb_ns_pid: int | None) -> set[int]:
    """The processes a reset must spare, as host PIDs: the launcher, the sandbox's processes
    between it and the server (bubblewrap, its PID namespace's init), the server, and its X server.
    The server names itself and its X server by their PIDs in its own namespace; a member's
    /proc/<pid>/status NSpid line ends with that number."""
    ns = {}
    for pid in box.members():
        try:
            with open(f"/proc/{pid}/status") as f:
                line = next(x for x in f if x.startswith("NSpid:"))
            ns[pid] = int(line.split()[-1])
        except (OSError, StopIteration, ValueError):
            continue
    by_ns = {}
    for pid, inner in ns.items():
        if pid != inner or pid == launcher:  # a PID of the sandbox's namespace (or the launcher)
            by_ns.setdefault(inner, []).append(pid)
    server = [p for p in by_ns.get(server_ns_pid, []) if _descends(p, launcher)]
    keep = {launcher}
    for pid in server[:1]:
        p = pid
        while p and p != launcher:  # the server and its ancestors up to the launcher
            keep.add(p)
            p = _ppid(p)
    if xvfb_ns_pid is not None:
        keep |= {p for p in by_ns.get(xvfb_ns_pid, []) if server and _ppid(p) == server[0]}
    return keep


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        pid = _ppid(pid)
        if pid == ancestor:
            return True
    return False


def oom_first() -> None:
    """This process (and all it starts) first in line for the OOM killer: raising one's own score
    needs no privilege, so a desktop started by anyone does it."""
    try:
        _write("/proc/self/oom_score_adj", 1000)
    except OSError:
        pass
