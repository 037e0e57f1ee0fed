"""Benchmark: vm_server.py under hostile input, sandboxed and not (and an older revision), side by side.

    python bench/hostile_vm.py                          # bubblewrap sandbox vs --no-sandbox
    python bench/hostile_vm.py --before dd3bdb8         # ... and the server of that git revision
    python bench/hostile_vm.py --seeds 1 --threads 4 --no-stall-wait

One real `vm_server.py --xvfb` desktop per mode, all on loopback, started together:
1. Idle latency of /health, /action (a mouse move, put back after) and /screenshot (PNG), the
   modes interleaved call by call, so the load of a shared machine weighs on all of them alike.
2. Under attack, one mode at a time, the modes taking turns seed by seed: the generated hostile
   requests of tests/test_hostile_input.py (malformed JSON, wrong types, huge values, 10 MB bodies,
   paths and argv that leave HOME, header abuse, bad tokens), --seeds rounds, from --threads
   threads, while this thread measures the same three calls every 50 ms. Every hostile request must get a 4xx JSON error. Afterwards nothing
   happened: HOME byte for byte, the mouse, no new process, nothing outside HOME.
3. 400 idle connections held open: /health latency, and how many threads the server keeps.
4. A stalled client (headers + half a body, then silence): how long until the server drops it
   (the sandboxed one, started with --request-timeout; skipped with --no-stall-wait).
The table has one column per mode and the ratios of the sandboxed server's medians to the
others'. Headline (last line): `sandbox_latency_ratio: R`, the largest ratio sandboxed /
--no-sandbox of the /action and /screenshot medians, idle and under attack (1.0 = no cost).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import SERVER, proc_children, proc_descendants, start_vm_server, vm_call  # noqa: E402
from conftest import mouse  # noqa: E402
import test_hostile_input as H  # noqa: E402

CALLS = ("health", "action", "screenshot")


def call(vm, what: str, i: int) -> tuple[float, bool]:
    """One timed call -> (ms, ok)."""
    t = time.perf_counter()
    if what == "health":
        r = vm_call(vm, "GET", "/health", timeout=30)
    elif what == "action":
        r = vm_call(vm, "POST", "/action", {"type": "move", "x": 600 + i % 2, "y": 400}, timeout=30)
    else:
        r = vm_call(vm, "GET", "/screenshot", timeout=30)
    return 1000 * (time.perf_counter() - t), r.status_code == 200


def watch(vm, stop: threading.Event, out: dict) -> None:
    """The three calls every 50 ms until `stop`."""
    i = 0
    while not stop.is_set():
        for what in CALLS:
            ms, ok = call(vm, what, i)
            out[what].append(ms)
            out["errors"] += not ok
        i += 1
        time.sleep(0.05)


def server_pid(vm) -> int:
    """The pid of the process that serves (Xvfb's parent): in the sandbox, below the launcher and bwrap."""
    for p in [vm.proc.pid, *proc_descendants(vm.proc.pid)]:
        if any(comm(c) == "Xvfb" for c in proc_children(p)):
            return p
    return vm.proc.pid


def comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def attack(vm, seed: int, nthreads: int, outside: str) -> dict:
    """One round of the hostile requests against one desktop, with the three calls watched meanwhile."""
    vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123})
    time.sleep(0.3)
    home0, procs0, mouse0 = H.home_snapshot(vm.home), H.processes_under(vm.proc.pid), mouse(vm)
    work = H.hostile_requests(random.Random(seed), vm.token, outside)
    random.Random(seed).shuffle(work)
    fails, lock = [], threading.Lock()

    def send(chunk):
        for name, data, head in chunk:
            resps = H.exchange(vm.url, data, timeout=60)
            if not resps or not all(H.is_json_4xx(r, head) for r in resps):
                with lock:
                    fails.append((name, [(s, b[:120]) for s, _, b in resps]))
    load = {w: [] for w in CALLS} | {"errors": 0}
    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(vm, stop, load))
    watcher.start()
    t0 = time.perf_counter()
    workers = [threading.Thread(target=send, args=(work[i::nthreads],)) for i in range(nthreads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - t0
    stop.set()
    watcher.join()
    vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123})  # the watcher moved it; put it back
    time.sleep(0.3)
    return {"load": load, "n": len(work), "fails": fails, "wall": wall,
            "clean": H.home_snapshot(vm.home) == home0 and mouse(vm) == mouse0
            and not H.processes_under(vm.proc.pid) - procs0 and os.listdir(outside) == []}


def idle_connections(vm, n: int = 400) -> tuple[float, int]:
    """-> (/health ms, threads the server holds) with n idle connections open."""
    host, port = vm.url.split("//")[1].split(":")
    pid = server_pid(vm)
    base = len(os.listdir(f"/proc/{pid}/task"))
    socks = []
    try:
        for _ in range(n):
            socks.append(socket.create_connection((host, int(port))))
        time.sleep(1.0)
        ms, _ = call(vm, "health", 0)
        return ms, len(os.listdir(f"/proc/{pid}/task")) - base
    finally:
        for s in socks:
            s.close()


def stalled(vm) -> float:
    """Seconds until the server drops a client that sent headers and half a body."""
    host, port = vm.url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)))
    body = b'{"steps": [{"type": "write_file", "path": "stalled.txt", "content": "xxxxxxxx"}]}'
    s.sendall(H.http_bytes("POST", "/setup", body, vm.token)[:-len(body) // 2])
    s.settimeout(600)
    t = time.perf_counter()
    try:
        while s.recv(65536):  # a 408 answer, then the close
            pass
    except OSError:
        pass
    s.close()
    return time.perf_counter() - t


def old_server(rev: str, into: str) -> str:
    """vm_server.py of git `rev`, with the revision's other top-level .py files (what it imports)."""
    names = subprocess.run(["git", "-C", ROOT, "ls-tree", "--name-only", rev], capture_output=True, text=True)
    if "vm_server.py" not in names.stdout.split():
        sys.exit(f"hostile_vm: git finds no vm_server.py in {rev} ({names.stderr.strip()}).")
    for name in (n for n in names.stdout.split() if n.endswith(".py")):
        r = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{name}"], capture_output=True, check=True)
        with open(os.path.join(into, name), "wb") as f:
            f.write(r.stdout)
    return os.path.join(into, "vm_server.py")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="rounds of the hostile request set per mode")
    ap.add_argument("--threads", type=int, default=8, help="attacking threads")
    ap.add_argument("--calls", type=int, default=40, help="idle calls of each kind per mode")
    ap.add_argument("--before", default="", help="also run the vm_server.py of this git revision")
    ap.add_argument("--request-timeout", type=float, default=10.0, help="--request-timeout of the current server")
    ap.add_argument("--stall-wait", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    old_dir = tempfile.mkdtemp(prefix="hostile-old-")
    outside = tempfile.mkdtemp(prefix="hostile-outside-")
    rt = ["--request-timeout", f"{a.request_timeout:g}"]
    modes = {"sandbox": (SERVER, rt), "no-sandbox": (SERVER, ["--no-sandbox", *rt])}
    if a.before:
        modes[f"before {a.before}"] = (old_server(a.before, old_dir), [])
    vms = {}
    try:
        for name, (server, args) in modes.items():  # an older server takes --port 0 and --token
            vms[name] = start_vm_server(*args, server=server, legacy=name.startswith("before"))
            os.symlink(outside, os.path.join(vms[name].home, "out_link"))
            os.symlink("/etc", os.path.join(vms[name].home, "etc_link"))
        # 1. idle, interleaved
        idle = {n: {w: [] for w in CALLS} for n in vms}
        for i in range(a.calls):
            for n, vm in vms.items():
                for what in CALLS:
                    idle[n][what].append(call(vm, what, i)[0])
        # 2. attack, one mode at a time, the modes taking turns round by round; 3. idle connections
        hit = {n: {"load": {w: [] for w in CALLS} | {"errors": 0}, "n": 0, "fails": [], "wall": 0.0, "clean": True}
               for n in vms}
        for seed in range(a.seeds):
            for n, vm in vms.items():
                r = attack(vm, seed, a.threads, outside)
                for w in CALLS:
                    hit[n]["load"][w] += r["load"][w]
                hit[n]["load"]["errors"] += r["load"]["errors"]
                hit[n]["n"] += r["n"]
                hit[n]["fails"] += r["fails"]
                hit[n]["wall"] += r["wall"]
                hit[n]["clean"] &= r["clean"]
        conns = {n: idle_connections(vm) for n, vm in vms.items()}
        stall = stalled(vms["sandbox"]) if a.stall_wait else None

        names = list(vms)
        others = names[1:]
        rows = [(f"/{w} idle ms", {n: statistics.median(idle[n][w]) for n in names}) for w in CALLS]
        rows += [(f"/{w} under attack ms", {n: statistics.median(hit[n]["load"][w]) for n in names}) for w in CALLS]
        rows += [("/health, 400 idle conns ms", {n: conns[n][0] for n in names}),
                 ("threads held by them", {n: conns[n][1] for n in names})]
        head = f"{'median':28s}" + "".join(f"{n:>20s}" for n in names) + "".join(f"{'sandbox / ' + o:>26s}" for o in others)
        print(head)
        for label, v in rows:
            print(f"{label:28s}" + "".join(f"{v[n]:>20.1f}" for n in names)
                  + "".join(f"{v['sandbox'] / v[o] if v[o] else float('nan'):>26.2f}" for o in others))
        for n in names:
            h = hit[n]
            print(f"{n}: hostile requests {h['n']} ({a.seeds} seeds, {a.threads} threads, {h['wall']:.1f} s), "
                  f"4xx JSON {h['n'] - len(h['fails'])}/{h['n']}, watcher errors {h['load']['errors']}, "
                  f"nothing happened (HOME, mouse, processes, outside HOME) {h['clean']}, alive {vms[n].proc.poll() is None}")
            for f in h["fails"][:5]:
                print("   not 4xx JSON:", f)
        if stall is not None:
            print(f"a stalled client (half a body, then silence) was dropped after {stall:.1f} s "
                  f"(--request-timeout {a.request_timeout:g})")
        ratio = max(v["sandbox"] / v["no-sandbox"] for label, v in rows if label.split()[0] in ("/action", "/screenshot"))
        print(f"sandbox_latency_ratio: {ratio:.2f}")
    finally:
        for vm in vms.values():
            vm.stop()
        shutil.rmtree(outside, ignore_errors=True)
        shutil.rmtree(old_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
