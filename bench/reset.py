"""Benchmark: what POST /reset costs on a local desktop, and where the time goes.

    python bench/reset.py                 # 10 episodes of each kind; medians
    python bench/reset.py --episodes 3    # a quick look
    python bench/reset.py --server /tmp/old/vm_server.py   # another revision, for before/after
                                          # (e.g. git archive <rev> | tar -x -C /tmp/old)

Each episode does something to the desktop, then /reset is timed (the HTTP round trip, as a
trainer sees it). Kinds of episode: "nothing" (reset a reset desktop), "apps" (a terminal, the
editor and the calculator opened from their icons), "files" (the file manager opened, a file
written and one deleted from a terminal, an icon selected). The server answers /reset with its
phases in seconds (kill: the apps and the session stopped; home: HOME made equal to the template
again; session: window manager, taskbar and icons up and settled; mouse), printed beside.
Timings are noisy on a shared machine; the load average is printed first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from conftest import start_vm_server  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402
from env import VMClient  # noqa: E402

ICONS = desktop_icons()


def dclick(label: str) -> dict:
    return {"type": "double_click", "x": ICONS[label][0], "y": ICONS[label][1]}


EPISODES = {
    "nothing": [],
    "apps": [dclick("Terminal"), dclick("Text Editor"), dclick("Calculator")],
    "files": [dclick("Terminal"), {"type": "type", "text": "echo hi > ~/new.txt; rm ~/notes.txt\n"},
              dclick("File Manager"), {"type": "click", "x": ICONS["Clock"][0], "y": ICONS["Clock"][1]}],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=10, help="episodes of each kind")
    p.add_argument("--server", default=os.path.join(ROOT, "vm_server.py"), help="the vm_server.py to run")
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; {args.server}")
    vm = start_vm_server(server=args.server)
    try:
        c = VMClient(vm.url, vm.token, timeout=60)
        c.reset()
        print(f"{'episode':10s} {'reset (s)':>10s}  phases (medians, s)")
        for kind, actions in EPISODES.items():
            times, phases = [], {}
            for _ in range(args.episodes):
                for a in actions:
                    c.act(a, settle="watch")
                t0 = time.perf_counter()
                answer = c.reset()
                times.append(time.perf_counter() - t0)
                for k, v in answer.get("seconds", {}).items():
                    phases.setdefault(k, []).append(v)
            med = {k: round(statistics.median(v), 3) for k, v in phases.items()}
            print(f"{kind:10s} {statistics.median(times):10.3f}  {med or '(the server reports no phases)'}", flush=True)
    finally:
        vm.stop()


if __name__ == "__main__":
    main()
