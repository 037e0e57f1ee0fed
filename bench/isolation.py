"""Benchmark: what the desktops' isolation costs, this checkout against an older revision, in one run.

    python bench/isolation.py --before 0a6fdf7                 # 8 desktops, 3 rounds, 200 calls each
    python bench/isolation.py --before 0a6fdf7 --desktops 2 --rounds 1 --calls 20   # a quick look

The older revision is extracted with `git archive` into a temporary folder; both run sandboxed
(`--xvfb`), on the same machine, taking turns, so the load of a shared machine weighs on both.
1. Start: --desktops local desktops at once with each revision's own env.launch_local_vms (what
   `--vms N` does), timed from the call until every one answers /health, then stopped; the
   revisions alternate, --rounds times each.
2. Memory: --many local desktops of each revision (launch_local_vms, with each revision's own
   default bounds), the Text Editor opened on every one (a double-click on its icon), then the
   host's MemAvailable drop since before the start (which counts tmpfs files too: a desktop's HOME
   is one now) and the sum of the desktops' processes' Pss; revisions taking turns, --rounds times.
3. Latency: one desktop of each revision (tests/conftest.start_vm_server), called in alternation
   call by call: POST /action (a mouse move) and GET /screenshot (PNG), --calls times each;
   median and 90th percentile in ms.
Headlines (last lines): `isolation_latency_ratio: R`, the larger of now / before of the /action and
/screenshot medians (1.10 = 10% slower), `isolation_start_ratio: R`, now / before of the median
start time of the --desktops desktops, and `isolation_memory_ratio: R`, now / before of the median
MemAvailable drop of the --many desktops.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import start_vm_server, vm_call  # noqa: E402

START = """import sys, time
sys.path.insert(0, sys.argv[1])
import env
t = time.perf_counter()
vms = env.launch_local_vms(int(sys.argv[2]), timeout=300)
print(time.perf_counter() - t, flush=True)
env.stop_vms(vms)
"""

# --many desktops with an app open; prints the launchers' PIDs, then waits for stdin to close.
MANY = """import sys, time
sys.path.insert(0, sys.argv[1])
import env
vms = env.launch_local_vms(int(sys.argv[2]), timeout=600)
clients = [env.VMClient(vm.url, vm.token, timeout=120) for vm in vms]
for c in clients:
    c.act({"type": "double_click", "x": 74, "y": 146})  # the Text Editor's icon
time.sleep(8)  # every editor up and drawn
print(" ".join(str(vm.proc.pid) for vm in vms), flush=True)
sys.stdin.read()
env.stop_vms(vms)
"""


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def tree_pss(pids: list[int]) -> int:
    """Bytes of Pss of `pids` and all their descendants (/proc/<pid>/smaps_rollup), shmem included."""
    children = {}
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat", "rb") as f:
                children.setdefault(int(f.read().rsplit(b")", 1)[1].split()[1]), []).append(int(p))
        except OSError:
            continue
    total, todo = 0, list(pids)
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next(int(line.split()[1]) << 10 for line in f if line.startswith("Pss:"))
        except (OSError, StopIteration):
            continue
    return total


def many_memory(code: str, n: int) -> tuple[int, int]:
    """(MemAvailable drop, Pss sum) in bytes of n desktops of `code` with the Text Editor open."""
    time.sleep(3)  # the previous round's desktops gone
    before = mem_available()
    p = subprocess.Popen([sys.executable, "-c", MANY, code, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.strip():
        p.kill()
        sys.exit(f"isolation: {n} desktops of {code} did not start: {p.stderr.read()[-500:]}")
    drop, pss = before - mem_available(), tree_pss([int(x) for x in line.split()])
    p.stdin.close()
    p.wait(timeout=300)
    return drop, pss


def start_seconds(code: str, n: int) -> float:
    """Seconds for `code`'s launch_local_vms(n) to bring n desktops up (its own process)."""
    r = subprocess.run([sys.executable, "-c", START, code, str(n)], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        sys.exit(f"isolation: {n} desktops of {code} did not start: {r.stderr.strip()[-500:]}")
    return float(r.stdout.split()[0])


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="git revision to compare with (e.g. the commit before the change)")
    ap.add_argument("--desktops", type=int, default=8, help="desktops started at once")
    ap.add_argument("--rounds", type=int, default=3, help="start measurements per revision")
    ap.add_argument("--calls", type=int, default=200, help="calls of each kind per revision")
    ap.add_argument("--many", type=int, default=32, help="desktops with an app open, for the memory (0: skip)")
    a = ap.parse_args()
    old = tempfile.mkdtemp(prefix="isolation-before-")
    archive = subprocess.run(["git", "-C", ROOT, "archive", a.before], capture_output=True)
    if archive.returncode != 0:
        sys.exit(f"isolation: git cannot archive {a.before} ({archive.stderr.decode().strip()}).")
    subprocess.run(["tar", "-x", "-C", old], input=archive.stdout, check=True)
    codes = {"now": ROOT, f"before {a.before}": old}
    vms = {}
    try:
        # 1. start time of N desktops at once, the revisions taking turns
        starts = {n: [] for n in codes}
        for _ in range(a.rounds):
            for name, code in codes.items():
                starts[name].append(start_seconds(code, a.desktops))
        # 2. memory of --many desktops with an app open, the revisions taking turns
        mem = {n: [] for n in codes}
        for _ in range(a.rounds if a.many else 0):
            for name, code in codes.items():
                mem[name].append(many_memory(code, a.many))
        # 3. latency, one desktop each, interleaved call by call
        vms = {"now": start_vm_server(), f"before {a.before}": start_vm_server(
            server=os.path.join(old, "vm_server.py"), legacy=True)}
        lat = {n: {"action": [], "screenshot": []} for n in vms}
        for i in range(a.calls + 5):
            for name, vm in vms.items():
                for what, call in (("action", lambda: vm_call(vm, "POST", "/action", {"type": "move", "x": 600 + i % 2, "y": 400})),
                                   ("screenshot", lambda: vm_call(vm, "GET", "/screenshot"))):
                    t = time.perf_counter()
                    r = call()
                    ms = 1000 * (time.perf_counter() - t)
                    if r.status_code != 200:
                        sys.exit(f"isolation: {name} /{what} answered {r.status_code}: {r.text[:200]}")
                    if i >= 5:  # the first calls warm up (connection, caches)
                        lat[name][what].append(ms)
    finally:
        for vm in vms.values():
            vm.stop()
        shutil.rmtree(old, ignore_errors=True)

    names = list(codes)
    print(f"{'':32s}" + "".join(f"{n:>22s}" for n in names) + f"{'now / before':>16s}")
    rows = [(f"start {a.desktops} desktops s (median)", {n: statistics.median(starts[n]) for n in names})]
    for what in ("action", "screenshot"):
        rows.append((f"/{what} ms (median)", {n: statistics.median(lat[n][what]) for n in names}))
        rows.append((f"/{what} ms (p90)", {n: pct(lat[n][what], 0.9) for n in names}))
    for label, v in rows:
        print(f"{label:32s}" + "".join(f"{v[n]:>22.2f}" for n in names) + f"{v[names[0]] / v[names[1]]:>16.2f}")
    if a.many:
        for label, k in (("used", 0), ("Pss", 1)):
            v = {n: statistics.median(m[k] for m in mem[n]) / 2**30 for n in names}
            print(f"{f'{a.many} desktops, editor: GiB {label}':32s}" + "".join(f"{v[n]:>22.2f}" for n in names)
                  + f"{v[names[0]] / v[names[1]]:>16.2f}")
    print("start seconds per round: " + "; ".join(f"{n}: {', '.join(f'{s:.1f}' for s in starts[n])}" for n in names))
    median = {w: {n: statistics.median(lat[n][w]) for n in names} for w in ("action", "screenshot")}
    print(f"isolation_latency_ratio: {max(m[names[0]] / m[names[1]] for m in median.values()):.2f}")
    print(f"isolation_start_ratio: {statistics.median(starts[names[0]]) / statistics.median(starts[names[1]]):.2f}")
    if a.many:
        print("memory GiB per round (available drop / Pss): " + "; ".join(
            f"{n}: {', '.join(f'{d / 2**30:.2f}/{p / 2**30:.2f}' for d, p in mem[n])}" for n in names))
        drop = {n: statistics.median(m[0] for m in mem[n]) for n in names}
        print(f"isolation_memory_ratio: {drop[names[0]] / drop[names[1]]:.2f}")


if __name__ == "__main__":
    main()
