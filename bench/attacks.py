"""Benchmark: what an agent's attacks on its own desktop take of the host, this checkout against an
older revision, side by side.

    python bench/attacks.py --before 7fed0cd          # as root (the bounds need it), ~3 min

Each revision (the older one extracted with `git archive`) starts one local desktop as the trainers
do (its own env.launch_local_vms, sandboxed; this checkout with --limits LIMITS, small so each
attack hits them fast), in a process of its own. The agent opens the Terminal (a double-click) and
types each attack through POST /action, bounded in size and time as in tests/test_bounds.py; what
landed on the host is read from /proc (the desktop's processes: the launcher's descendants) and
from the desktop's folder. One row per attack:
- memory: a 700 MB bytearray touched and held 5 s: its exit status (137: OOM-killed) and the most
  the host's MemAvailable dropped meanwhile
- /tmp, /dev/shm, HOME: MB a 100 MB file got to; HOME on the run folder's filesystem or not
- processes: how many of 400 sleepers ran at once
- CPU: CPUs' worth of time four busy loops in new sessions took over 3 s
- reset: processes of a SIGTERM-ignoring, PID-hopping shell left after POST /reset
- zombies: left 1 s after 300 orphans exited, no request meanwhile
- OOM order: the desktop processes' oom_score_adj (the trainer's is 0)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import proc_comm as comm, proc_descendants, proc_stat as stat  # noqa: E402
LIMITS = "memory=400m,pids=160,cpus=0.5,disk=48m,tmp=32m"
TERMINAL = (74, 46)  # the Terminal's icon on an --xvfb desktop (vm/desktop.py: desktop_icons)


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


class Desk:
    """The desktop as its agent sees it (a Terminal to type into) and as the host sees it."""

    def __init__(self, env, vm):
        self.client, self.launcher = env.VMClient(vm.url, vm.token, timeout=120), vm.proc.pid
        self.home = re.search(r" home (\S+)", open(vm.log).read())[1]

    def procs(self) -> list[int]:
        return proc_descendants(self.launcher)

    def type(self, line: str, timeout: float = 60) -> str:
        """A fresh episode: reset, open the Terminal, type `line; echo $? > ~/rc`. -> ~/rc's text."""
        self.client.reset()
        self.client.act({"type": "double_click", "x": TERMINAL[0], "y": TERMINAL[1]})
        self.wait(lambda: "xterm" in [w["title"] for w in self.client.windows()], "the Terminal")
        self.wait(lambda: any(comm(p) in ("sh", "bash", "dash") and comm(int(stat(p)[1])) == "xterm"
                              for p in self.procs() if stat(p)), "the Terminal's shell")
        rc = os.path.join(self.home, "rc")
        sep = " " if line.rstrip().endswith("&") else "; "
        self.client.act({"type": "type", "text": f"{line}{sep}echo $? > ~/rc\n"})
        self.wait(lambda: os.path.exists(rc) and open(rc).read().endswith("\n"), "~/rc", timeout)
        text = open(rc).read().strip()
        os.unlink(rc)
        return text

    def wait(self, cond, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise TimeoutError(f"attacks: {what} did not come within {timeout:g} s")
            time.sleep(0.05)

    def file_mb(self, line: str) -> float:
        """MB of the file `line` wrote to $F (the agent measures it with du, then removes it; 0: none made)."""
        self.type(f"{line}; kb=$(du -k $F | cut -f1); rm -f $F; echo ${{kb:-0}} > ~/kb")  # (a full HOME: rm first)
        kb = open(os.path.join(self.home, "kb")).read().strip()
        if not kb.isdigit():
            raise RuntimeError(f"attacks: `{line}` measured {kb!r}, not a size")
        return int(kb) / 1024


def attacks(desk: Desk) -> dict:
    out = {}
    lowest, done = [mem_available()], []

    def watch():
        while not done:
            lowest[0] = min(lowest[0], mem_available())
            time.sleep(0.05)
    before = lowest[0]
    threading.Thread(target=watch, daemon=True).start()
    out["memory: 700 MB, exit status"] = desk.type(
        "python3 -c \"b = bytearray(700 << 20); b[::4096] = b'x' * len(b[::4096]); import time; time.sleep(5)\"")
    done.append(True)
    out["memory: host MemAvailable drop MB"] = round((before - lowest[0]) / 2**20)
    for where in ("/tmp", "/dev/shm", "$HOME"):
        out[f"{where}: MB of a 100 MB file"] = round(desk.file_mb(f"F={where}/fill; head -c 100M /dev/zero > $F"), 1)
    out["$HOME: on the run folder's filesystem"] = os.stat(desk.home).st_dev == os.stat(ROOT).st_dev
    desk.type("sh -c 'i=0; while [ $i -lt 400 ]; do sleep 60 & i=$((i + 1)); done' 2>/dev/null")
    time.sleep(1)  # each fork's exec of sleep done
    out["processes: of 400 sleepers, running"] = sum(comm(p) == "sleep" for p in desk.procs())
    desk.type("for i in 1 2 3 4; do setsid sh -c 'while :; do :; done' & done")
    ticks = lambda: sum(int(s[11]) + int(s[12]) for s in map(stat, desk.procs()) if len(s) > 12)  # noqa: E731
    t0, c0 = time.monotonic(), ticks()
    time.sleep(3)
    out["CPU: CPUs taken by 4 loops"] = round((ticks() - c0) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - t0), 2)
    desk.type("setsid sh -c 'trap \"\" TERM; while :; do sh -c \"trap \\\"\\\" TERM; sleep 600\" & sleep 0.005; done' &")
    time.sleep(1)
    desk.client.reset()
    out["reset: the storm's processes left"] = sum(comm(p) in ("sh", "sleep") for p in desk.procs())
    desk.type("for i in $(seq 300); do (sh -c 'exit 0' &); done; sleep 1")
    time.sleep(1)
    out["zombies: left after 1 s idle"] = sum(stat(p)[:1] == ["Z"] for p in desk.procs())
    adj = {int(open(f"/proc/{p}/oom_score_adj").read()) for p in desk.procs() if os.path.exists(f"/proc/{p}")}
    out["OOM order: desktop oom_score_adj"] = ",".join(map(str, sorted(adj)))
    desk.client.reset()
    return out


def child(code: str, limits: str) -> None:
    """One revision's desktop and the attacks on it; prints their outcomes as one JSON line."""
    sys.path.insert(0, code)
    import env
    vms = env.launch_local_vms(1, **({"limits": limits} if limits else {}))
    try:
        print(json.dumps(attacks(Desk(env, vms[0]))), flush=True)
    finally:
        env.stop_vms(vms)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", help="git revision to compare with (the code before the bounds: 7fed0cd)")
    ap.add_argument("--code", help=argparse.SUPPRESS)  # a child: one revision's folder
    ap.add_argument("--limits", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.code:
        return child(a.code, a.limits)
    if not a.before:
        sys.exit("attacks: --before REV is required (e.g. --before 7fed0cd).")
    old = tempfile.mkdtemp(prefix="attacks-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", a.before], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"attacks: git cannot archive {a.before} ({archive.stderr.decode().strip()}).")
    subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
    results = {}
    try:
        for name, code, limits in (("now", ROOT, LIMITS), (f"before {a.before}", old, "")):
            r = subprocess.run([sys.executable, __file__, "--code", code, "--limits", limits],
                               capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                sys.exit(f"attacks: {name}: {r.stderr.strip()[-1500:]}")
            results[name] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(old, ignore_errors=True)
    names = list(results)
    print(f"now: --limits {LIMITS}; trainer oom_score_adj {open('/proc/self/oom_score_adj').read().strip()}")
    print(f"{'':40s}" + "".join(f"{n:>20s}" for n in names))
    for row in results[names[0]]:
        print(f"{row:40s}" + "".join(f"{str(results[n][row]):>20s}" for n in names))


if __name__ == "__main__":
    main()
