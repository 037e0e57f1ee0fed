"""Benchmark: vm_server.py under hostile input, the long version of tests/test_hostile_input.py.

    python bench/hostile_vm.py                        # last line = headline
    python bench/hostile_vm.py --seeds 3 --threads 4 --no-stall-wait

Against one real `vm_server.py --xvfb` on loopback:
1. the test's generated hostile requests (malformed JSON, wrong types, NaN/inf/huge coordinates,
   10 MB bodies, unknown types, paths and argv that leave HOME, header abuse, bad tokens), --seeds
   times (the seed moves the cut points of the malformed JSON), sent from --threads threads at once,
   while this thread measures /health and a legitimate /action (a mouse move, put back after)
   every 50 ms. Every hostile request must get a 4xx JSON error.
2. Afterwards, nothing happened: HOME byte for byte, the mouse, no new process, nothing outside HOME.
3. A stalled client (headers + half a body, then silence): how long until the server drops it
   (its socket timeout, Handler.timeout = 120 s); skipped with --no-stall-wait.
Columns: requests, 4xx-JSON share, wall seconds, /health median and p95 ms idle vs under load,
/action median ms under load. Headline: the share of hostile requests answered with a 4xx JSON
error (1.0 = all).
"""
from __future__ import annotations

import argparse
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from conftest import start_vm_server, vm_call  # noqa: E402
import test_hostile_input as H  # noqa: E402


def latencies(vm, stop: threading.Event, out: dict) -> None:
    """/health and a mouse move every 50 ms until `stop`, in ms."""
    i = 0
    while not stop.is_set():
        t = time.perf_counter()
        ok = vm_call(vm, "GET", "/health", timeout=30).status_code == 200
        out["health"].append(1000 * (time.perf_counter() - t))
        t = time.perf_counter()
        ok &= vm_call(vm, "POST", "/action", {"type": "move", "x": 600 + i % 2, "y": 400}, timeout=30).status_code == 200
        out["action"].append(1000 * (time.perf_counter() - t))
        out["errors"] += not ok
        i += 1
        time.sleep(0.05)


def p95(xs):
    return sorted(xs)[int(0.95 * (len(xs) - 1))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--stall-wait", action=argparse.BooleanOptionalAction, default=True)
    a = ap.parse_args()
    vm = start_vm_server()
    outside = tempfile.mkdtemp(prefix="hostile-outside-")
    try:
        os.symlink(outside, os.path.join(vm.home, "out_link"))
        os.symlink("/etc", os.path.join(vm.home, "etc_link"))
        vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123})
        time.sleep(1.0)
        idle = {"health": [], "action": [], "errors": 0}
        stop = threading.Event()
        t = threading.Thread(target=latencies, args=(vm, stop, idle))
        t.start()
        time.sleep(3)
        stop.set()
        t.join()
        vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123})
        home0, procs0, mouse0 = H.home_snapshot(vm.home), H.processes_under(vm.proc.pid), H.mouse(vm)

        work = [r for s in range(a.seeds) for r in H.hostile_requests(random.Random(s), vm.token, outside)]
        random.Random(0).shuffle(work)
        chunks = [work[i::a.threads] for i in range(a.threads)]
        fails, lock = [], threading.Lock()

        def send(chunk):
            for name, data, head in chunk:
                resps = H.exchange(vm.url, data, timeout=60)
                if not resps or not all(H.is_json_4xx(r, head) for r in resps):
                    with lock:
                        fails.append((name, [(s, b[:120]) for s, _, b in resps]))
        load = {"health": [], "action": [], "errors": 0}
        stop = threading.Event()
        watcher = threading.Thread(target=latencies, args=(vm, stop, load))
        watcher.start()
        t0 = time.perf_counter()
        workers = [threading.Thread(target=send, args=(c,)) for c in chunks]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - t0
        stop.set()
        watcher.join()
        vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123})  # the watcher moved it; put it back
        time.sleep(0.3)
        same_home = H.home_snapshot(vm.home) == home0
        new_procs = H.processes_under(vm.proc.pid) - procs0
        same_mouse = H.mouse(vm) == mouse0

        stall = None
        if a.stall_wait:
            host, port = vm.url.split("//")[1].split(":")
            s = socket.create_connection((host, int(port)))
            body = b'{"steps": [{"type": "write_file", "path": "stalled.txt", "content": "xxxxxxxx"}]}'
            s.sendall(H.http_bytes("POST", "/setup", body, vm.token)[:-len(body) // 2])
            s.settimeout(600)
            t = time.perf_counter()
            try:
                s.recv(1)
            except OSError:
                pass
            stall = time.perf_counter() - t
            s.close()

        n = len(work)
        print(f"hostile requests: {n} ({a.seeds} seeds x {n // a.seeds}), {a.threads} threads, {wall:.1f} s "
              f"({n / wall:.0f} req/s); answered with a 4xx JSON error: {n - len(fails)}/{n}")
        for f in fails[:10]:
            print("   not 4xx JSON:", f)
        print(f"{'':22s} {'median ms':>10} {'p95 ms':>8} {'calls':>6} {'errors':>7}")
        print(f"{'/health idle':22s} {statistics.median(idle['health']):>10.1f} {p95(idle['health']):>8.1f} {len(idle['health']):>6} {idle['errors']:>7}")
        print(f"{'/health under attack':22s} {statistics.median(load['health']):>10.1f} {p95(load['health']):>8.1f} {len(load['health']):>6} {load['errors']:>7}")
        print(f"{'/action idle':22s} {statistics.median(idle['action']):>10.1f} {p95(idle['action']):>8.1f} {len(idle['action']):>6}")
        print(f"{'/action under attack':22s} {statistics.median(load['action']):>10.1f} {p95(load['action']):>8.1f} {len(load['action']):>6}")
        print(f"after: HOME unchanged {same_home}, mouse unchanged {same_mouse}, new processes {len(new_procs)}, "
              f"files outside HOME {len(os.listdir(outside))}, server alive {vm.proc.poll() is None}")
        if stall is not None:
            print(f"a stalled client (half a body, then silence) was dropped after {stall:.1f} s (Handler.timeout 120 s)")
        print(f"hostile_4xx_json_share: {(n - len(fails)) / n:.4f}")
    finally:
        vm.stop()
        shutil.rmtree(outside, ignore_errors=True)


if __name__ == "__main__":
    main()
