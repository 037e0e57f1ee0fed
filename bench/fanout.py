"""Benchmark: lockstep fan-out over N local desktops with env.VMPool.

    python bench/fanout.py                        # N = 1, 2, 4, 8; table; last line = headline
    python bench/fanout.py --ns 1,4 --steps 20    # other sizes / more steps

One lockstep step (VMPool.map: every desktop at once; the trainers no longer step in lockstep, see
rollout.py and bench/arpo_iter.py) is a screenshot from every desktop (PNG, decoded to a PIL
image), one action on every desktop (a mouse move), and a fixed 0.5 s settle. With N desktops
driven in threads the N waits overlap, so ideally a step takes as long with 8 desktops as with 1.

Columns: t(N) = median seconds per lockstep step; speedup = N * t(1) / t(N) (env-steps per second
relative to one desktop; ideal N); efficiency = speedup / N = t(1) / t(N) (ideal 1.0). The
headline is the efficiency at the largest N. All desktops start once, in parallel, and the pools
for smaller N use the first N of them by URL (the same code path as remote VMs).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actions import Action  # noqa: E402
from env import VMPool, launch_local_vms  # noqa: E402


def lockstep_times(pool: VMPool, steps: int, warmup: int, settle: float) -> list[float]:
    """Seconds per lockstep step (screenshots + actions + settle) on every VM of the pool."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        shots = pool.screenshots()
        # Alternate between two points so every move really moves the pointer.
        xy = (400, 300) if i % 2 else (800, 500)
        acts = pool.act([Action("move", x=xy[0], y=xy[1])] * pool.size)
        time.sleep(settle)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        bad = [r.error for r in shots + acts if not r.ok]
        if bad:
            raise SystemExit(f"fanout: a desktop failed during the benchmark: {bad[0]}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", default="1,2,4,8", help="comma-separated pool sizes")
    p.add_argument("--steps", type=int, default=10, help="timed lockstep steps per size")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (connections, caches)")
    p.add_argument("--settle", type=float, default=0.5, help="fixed wait after the actions, seconds")
    args = p.parse_args()
    ns = sorted(int(n) for n in args.ns.split(","))

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    vms = launch_local_vms(max(ns), token="bench")
    launch_s = time.perf_counter() - t0
    rows = []
    try:
        for n in ns:
            with VMPool([vm.url for vm in vms[:n]], token="bench", timeout=30) as pool:
                times = lockstep_times(pool, args.steps, args.warmup, args.settle)
            rows.append((n, statistics.median(times), statistics.mean(times)))
    finally:
        for vm in vms:
            vm.stop()
    load1 = os.getloadavg()

    t1 = rows[0][1] if rows[0][0] == 1 else None
    print(f"started {max(ns)} desktops in parallel in {launch_s:.1f} s; {os.cpu_count()} CPUs; "
          f"load average {load0[0]:.2f} before, {load1[0]:.2f} after")
    print(f"{'N':>3} {'t(N) median s':>14} {'mean s':>8} {'steps/s':>8} {'env-steps/s':>12} "
          f"{'speedup':>8} {'ideal':>6} {'efficiency':>11}")
    for n, med, mean in rows:
        speedup = n * t1 / med if t1 else float("nan")
        print(f"{n:>3} {med:>14.3f} {mean:>8.3f} {1 / med:>8.2f} {n / med:>12.2f} "
              f"{speedup:>8.2f} {n:>6} {speedup / n:>11.3f}")
    n, med, _ = rows[-1]
    print(f"fanout_efficiency_n{n}: {t1 / med:.3f}" if t1 else "fanout_efficiency: n/a (include N=1)")


if __name__ == "__main__":
    main()
