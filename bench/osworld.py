"""Benchmark: what an OSWorld VM costs a step, against the project's own desktop.

    OSWORLD_SRC=~/OSWorld python bench/osworld.py              # 7 rounds
    OSWORLD_SRC=~/OSWorld python bench/osworld.py --rounds 15

OSWorld's own VM-side server (from the checkout OSWORLD_SRC names) runs on a local Xvfb desktop
(tests/osworld_server.py) and is attached with `--vms osworld:attach:HOST:PORT`. Per round, timed:
OSWorldClient's reset (no revert: an attached server has no snapshot), setup (DesktopEnv.reset with
the task: its config steps launch a terminal), one step (a typed command, the fixed 0.5 s settle
included, and the screenshot), and evaluate (DesktopEnv.evaluate: OSWorld's metric over the VM's
command output). Then the same episode (the task "make a folder named reports", two scripted
answers, scored) played whole with train_arpo.play_tasks on: the attached OSWorld server; the
project's own desktop with the same task in the project's format and the same 0.5 s settle; and the
project's own desktop with its watched settle (the default). Medians over the rounds; the ratios are
the OSWorld server's time over the own desktop's. What a docker or cloud VM adds (its revert, its
network) is not here: docs/osworld.md says what is known of it.

Prints one table, then `osworld_episode_ratio: R` (OSWorld's episode / ours at the same settle).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import osworld_env  # noqa: E402 -- first: its stand-ins let OSWorld's client import
import osworld_server as S  # noqa: E402
import train_arpo as T  # noqa: E402
from actions import Action  # noqa: E402
from conftest import free_port  # noqa: E402
from env import Task, VMPool  # noqa: E402

# The feasible task in the project's own format: the same instruction, terminal and check.
OURS = Task("local-os-mkdir-reports", S.FEASIBLE["instruction"],
            [{"type": "launch", "argv": ["xterm", "-geometry", "100x30+100+100"]},
             {"type": "command", "argv": ["xdotool", "search", "--sync", "--onlyvisible", "--name", "^xterm$"], "timeout": 15}],
            {"conj": "and", "checks": [{"type": "file_exists", "path": "reports"}]}, 15)


def policy(observations):
    return [S.SOLUTIONS[o.task.id][o.step] for o in observations]


def episode_seconds(pool, task, settle: str, rounds: int, after) -> list[float]:
    """Wall seconds of whole episodes (reset, setup, two answers, the score); after() clears what
    the episode left that a reset does not (an attached OSWorld server is never reverted)."""
    args = T.Args(settle=settle, prompt="arpo", vm_timeout=120, save_trajectories=False)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        (ep,), _ = T.play_tasks(pool, [task], policy, args)
        out.append(time.perf_counter() - t0)
        assert ep.score == 1.0, (ep.end, ep.error)
        after()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    if S.source() is None:
        print("bench/osworld.py: set OSWORLD_SRC to an OSWorld checkout (its desktop_env/server/main.py).")
        return 2
    osworld_env.require()
    server = S.start(S.source(), free_port())
    phases = {k: [] for k in ("reset", "setup", "step (0.5 s settle)", "evaluate")}
    try:
        cache = tempfile.mkdtemp(prefix="osworld-cache-")
        client = osworld_env.OSWorldClient("attach", f"127.0.0.1:{server.port}", cache, (1280, 720), 120)
        task = osworld_env.load_tasks(S.write_tasks(cache))[0]
        for _ in range(a.rounds):
            for name, call in (("reset", lambda: client.reset()), ("setup", lambda: client.setup(task.setup)),
                               ("step (0.5 s settle)", lambda: client.act(Action("type", text="mkdir ~/reports\n"), 0.5, "png")),
                               ("evaluate", lambda: client.evaluate({}))):
                t0 = time.perf_counter()
                call()
                phases[name].append(time.perf_counter() - t0)
            client.act(Action("key", keys=["ctrl", "d"]))  # the terminal closes: the next setup opens a new one
            os.rmdir(os.path.join(server.home, "reports"))
        theirs = VMPool(clients=[client], timeout=120, screen=(1280, 720))

        def clear():
            client.act(Action("key", keys=["ctrl", "d"]))
            os.rmdir(os.path.join(server.home, "reports"))
        ep_osworld = episode_seconds(theirs, task, "0.5", a.rounds, clear)
    finally:
        server.stop()
    with VMPool(1, timeout=120, screen=(1280, 720)) as ours:
        ep_fixed = episode_seconds(ours, OURS, "0.5", a.rounds, lambda: None)  # a reset empties HOME
        ep_watch = episode_seconds(ours, OURS, "watch", a.rounds, lambda: None)
    med = statistics.median
    print(f"{'median of ' + str(a.rounds) + ' rounds, seconds':44s} {'OSWorld server':>15s} {'own desktop':>12s} {'ratio':>7s}")
    for name, xs in phases.items():
        print(f"{name:44s} {med(xs):15.3f} {'':>12s} {'':>7s}")
    print(f"{'episode (2 answers, scored), 0.5 s settle':44s} {med(ep_osworld):15.3f} {med(ep_fixed):12.3f} "
          f"{med(ep_osworld) / med(ep_fixed):7.2f}")
    print(f"{'episode, own desktop with the watched settle':44s} {'':>15s} {med(ep_watch):12.3f} "
          f"{med(ep_osworld) / med(ep_watch):7.2f}")
    print("per round: " + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in xs) for k, xs in
                                    [*phases.items(), ("episode OSWorld", ep_osworld), ("episode own 0.5", ep_fixed),
                                     ("episode own watch", ep_watch)]))
    print(f"osworld_episode_ratio: {med(ep_osworld) / med(ep_fixed):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
