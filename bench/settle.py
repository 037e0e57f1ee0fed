"""Benchmark: what one step costs with the watched settle (vm_server ?settle=watch), beside the
fixed settles of the papers, and whether the watched screen is the one a 2 s settle would show.

    python bench/settle.py                          # both parts, ~15 min on 2 cores
    python bench/settle.py --runs 1 --kinds dclick-Terminal,noop-click --no-solutions   # a quick look
    python bench/settle.py --no-table --desktops 3  # only the solutions check, on 3 desktops
    python bench/settle.py --no-table --no-solutions --explore 12   # only the explore check

Part 1, the step table: each kind of step the task suite has (a double-click on each desktop
icon, a command typed into a terminal, typing into the editor, hotkeys that open or close a
window, the Enter of a save dialog, a click that opens a menu, no-op clicks, moves and keys),
`--runs` times each, on a fresh desktop (/reset, the kind's setup and first actions). Columns, in
seconds from the moment the action is sent:
  action     the action's own round trip (POST /action with no settle)
  watched    POST /action?settle=watch&screenshot=png: the settled screen is in hand (until: why it
             stopped; final: it equals the screen 2.5 s after the action, carets and the taskbar
             clock aside)
  floor      the physical floor: the action, then screenshots as fast as the server answers them
             (GET /screenshot, PNG); the first one that shows the final screen. Nothing that waits
             for the screen can do better than this without knowing the final screen in advance
             (to within one screenshot round trip, its resolution).
  fixed 0.5 / fixed 2.0   the papers' way: the action, a fixed sleep, a screenshot (0.5 final: the
             screen 0.5 s after the action's answer was already the final one)
  gap        what QUIET must exceed: on a third fresh desktop, the action sent with no settle and
             the desktop watched from this process with the rule's own signals (settle.Programs,
             and X damage with each drawing's size) for FINAL_AFTER s; the longest stretch without
             any signal that still ended in a change bigger than a caret (the largest over the runs)
Medians over the runs; the last line is the headline (the median step, watched vs fixed 2.0).

Part 2, the solutions check: every scripted solution of the task suite (each task file's `solution`)
on `--desktops` desktops; at every step the watched screen is compared with a screenshot taken
2 s after the step was answered. Screens count as equal when they differ only in caret-sized
regions (at most CARET wide, CARET_H tall) or in the taskbar clock (CLOCK). Prints each step that
differs and the count.

Part 3, the explore check (`--explore N`): N episodes of ScreenExplorer's random baseline (the
eval's `random_chooser`: clicks, double- and right-clicks, moves and scrolls anywhere, seeded) of
`--explore-steps` steps each, on a reset desktop; every watched screen compared as in part 2, and
by the exploration eval's screen hash (dHash bits apart; the eval counts <= 2 bits as one screen).
This is the check that found openbox's workspace popup (desktop.openbox_config).

Timings are noisy on a shared machine: the load average is printed first; compare runs at alike
load. The desktops are real `vm_server.py --xvfb` servers over HTTP on loopback.
"""

from __future__ import annotations

import argparse
import io
import os
import queue
import random
import statistics
import sys
import threading
import time

import numpy as np
import requests
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from conftest import in_x_namespace, proc_descendants, start_vm_server  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402
from env import VMClient  # noqa: E402
from vm.settle import BUSY_CPU, LOOK, QUIET, Programs  # noqa: E402
from env import load_tasks  # noqa: E402

CARET, CARET_H = 4, 40   # px: a differing region this narrow (and at most this tall) is a caret
CLOCK = 160, 34          # px from the bottom-right corner: tint2's clock and date
FINAL_AFTER = 2.5        # s after the action: the screen by then is "final"
ICONS = desktop_icons()

# name -> (setup steps, actions before the measured one (sent with the watched settle), the action)
TERM = [{"type": "launch", "argv": ["xterm"]},
        {"type": "command", "argv": ["xdotool", "search", "--sync", "--onlyvisible", "--class", "xterm"], "timeout": 15}]
EDIT = [{"type": "write_file", "path": "Documents/draft.txt", "content": "Meeting notes\n"},
        {"type": "open", "path": "Documents/draft.txt"},
        {"type": "command", "argv": ["xdotool", "search", "--sync", "--onlyvisible", "--name", "Mousepad$"], "timeout": 15}]
FILES = [{"type": "open", "path": "Documents"},
         {"type": "command", "argv": ["xdotool", "search", "--sync", "--onlyvisible", "--name", "^Documents$"], "timeout": 15}]
KEY = lambda *keys: {"type": "key", "keys": list(keys)}  # noqa: E731
KINDS = {f"dclick-{label.replace(' ', '')}": ([], [], {"type": "double_click", "x": x, "y": y})
         for label, (x, y) in ICONS.items()}
KINDS.update({
    "terminal-command": (TERM, [], {"type": "type", "text": "ls -l /usr/bin | tail -30\n"}),
    "terminal-touch": (TERM, [], {"type": "type", "text": "touch ~/ready.flag\n"}),
    "editor-type": (EDIT, [], {"type": "type", "text": "water the plants\n"}),
    "editor-ctrl+s": (EDIT, [{"type": "type", "text": "more\n"}], KEY("ctrl", "s")),
    "editor-save-as-dialog": (EDIT, [], KEY("ctrl", "shift", "s")),
    "editor-save-dialog-enter": (EDIT, [KEY("ctrl", "shift", "s"), KEY("ctrl", "a"),
                                        {"type": "type", "text": "~/Documents/final.txt"}], KEY("enter")),
    "editor-alt+f4": (EDIT, [], KEY("alt", "f4")),
    "files-new-folder-dialog": (FILES, [], KEY("ctrl", "shift", "n")),
    "files-location-bar": (FILES, [], KEY("ctrl", "l")),
    "files-goto-folder": (FILES, [KEY("ctrl", "l"), {"type": "type", "text": "~/Pictures"}], KEY("enter")),
    "desktop-menu-right-click": ([], [], {"type": "right_click", "x": 700, "y": 400}),
    "noop-click": ([], [], {"type": "click", "x": 700, "y": 400}),
    "noop-move": ([], [], {"type": "move", "x": 600, "y": 300}),
    "noop-key": ([], [], KEY("shift")),
})


# -------------------------------------------------------------------------------------------------
# Screens: equal but for carets and the clock


def regions(a: Image.Image, b: Image.Image, cell: int = 4) -> list[tuple[int, int, int, int]]:
    """The bounding boxes (x0, y0, x1, y1) of the regions where two screens differ: differing
    pixels grouped on a grid of `cell`-pixel cells, cells touching (8 ways) in one region."""
    d = np.any(np.asarray(a, dtype=np.int16) != np.asarray(b, dtype=np.int16), axis=2)  # (H, W)
    h, w = d.shape
    grid = d[: h - h % cell, : w - w % cell].reshape(h // cell, cell, w // cell, cell).any(axis=(1, 3))  # (H/c, W/c)
    ys, xs = np.nonzero(grid)
    todo, seen, out = set(zip(ys.tolist(), xs.tolist())), set(), []
    for start in sorted(todo):
        if start in seen:
            continue
        stack, comp = [start], []
        seen.add(start)
        while stack:
            y, x = stack.pop()
            comp.append((y, x))
            for dy in (-1, 0, 1):
                for dx in (-1, 0, 1):
                    n = (y + dy, x + dx)
                    if n in todo and n not in seen:
                        seen.add(n)
                        stack.append(n)
        cy, cx = [c[0] for c in comp], [c[1] for c in comp]
        # shrink the cell box to the differing pixels inside it
        sub = d[min(cy) * cell:(max(cy) + 1) * cell, min(cx) * cell:(max(cx) + 1) * cell]
        py, px = np.nonzero(sub)
        out.append((min(cx) * cell + int(px.min()), min(cy) * cell + int(py.min()),
                    min(cx) * cell + int(px.max()) + 1, min(cy) * cell + int(py.max()) + 1))
    return out


def differences(a: Image.Image, b: Image.Image) -> list[tuple[int, int, int, int]]:
    """The regions where two screens differ that are neither a caret nor the taskbar clock."""
    w, h = a.size
    return [r for r in regions(a, b)
            if not (r[2] - r[0] <= CARET and r[3] - r[1] <= CARET_H)
            and not (r[0] >= w - CLOCK[0] and r[1] >= h - CLOCK[1])]


# -------------------------------------------------------------------------------------------------
# Part 1: the step table


def fresh(c: VMClient, setup: list[dict], pre: list[dict]) -> None:
    """A reset desktop with the kind's setup and first actions, settled."""
    c.reset()
    c.setup(setup)
    for a in pre + [{"type": "wait", "amount": 0}]:
        c.act(a, settle="watch")


def grab(c: VMClient) -> Image.Image:
    r = c.session.get(c.url + "/screenshot", timeout=30)
    r.raise_for_status()
    return Image.open(io.BytesIO(r.content)).convert("RGB")


def server_pid(vm) -> int:
    """The vm_server.py process itself (inside the sandbox, below bubblewrap): its descendants are
    the desktop."""
    for pid in proc_descendants(vm.proc.pid):
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        if argv[0] == sys.executable.encode() and argv[1:2] and argv[1].endswith(b"vm_server.py"):
            return pid
    raise SystemExit("bench/settle.py: cannot find the server's process below its launcher.")


def longest_gap(c: VMClient, vm, setup: list[dict], pre: list[dict], action: dict) -> float:
    """The longest stillness (no drawing, nothing busy, no newcomer asleep) after the action that
    still ended in a change bigger than a caret (see the docstring's `gap`)."""
    from Xlib import display as xdisplay
    from Xlib.ext import damage as xdamage
    fresh(c, setup, pre)
    x = in_x_namespace(vm, lambda: xdisplay.Display(vm.display))  # the display lives in the sandbox's network
    x.damage_query_version()
    x.screen().root.damage_create(xdamage.DamageReportRawRectangles)
    notify = x.extension_event.DamageNotify
    x.sync()
    programs = Programs(server_pid(vm), newcomers=False)
    while x.pending_events():
        x.next_event()
    programs.arm()
    t0 = time.monotonic()
    c.act(action)
    answered = time.monotonic() - t0  # (no look while the action runs: its own time counts as busy)
    seen = []  # (s after the action was sent, any signal, a change bigger than a caret)
    while time.monotonic() - t0 < FINAL_AFTER:
        time.sleep(LOOK)
        drew = big = False
        while x.pending_events():
            e = x.next_event()
            if e.type == notify:
                drew = True
                big |= not (e.area.width <= CARET and e.area.height <= CARET_H)
        used, running, sleeper = programs.look()
        seen.append((time.monotonic() - t0, drew or running or sleeper or used > BUSY_CPU, big))
    x.close()
    last_big = max((t for t, _, big in seen if big), default=0.0)
    active = [answered] + [t for t, signal, _ in seen if signal and answered < t <= last_big]
    return max((b - a for a, b in zip(active, active[1:])), default=0.0)


def one_kind(c: VMClient, setup: list[dict], pre: list[dict], action: dict) -> dict:
    """One run of one kind: the watched step, then (on a fresh desktop) the action with no settle
    and screenshots as fast as they come, for the floor and the fixed settles."""
    fresh(c, setup, pre)
    t0 = time.perf_counter()
    r = c.act(action, settle="watch", screenshot="png")
    watched = time.perf_counter() - t0
    time.sleep(max(0.0, t0 + FINAL_AFTER - time.perf_counter()))
    watched_final = not differences(r.image, grab(c))

    fresh(c, setup, pre)
    t0 = time.perf_counter()
    c.act(action)
    answered = time.perf_counter() - t0
    shots = []  # (s after the action was sent: requested, received), screen
    while time.perf_counter() - t0 < FINAL_AFTER:
        asked = time.perf_counter() - t0
        img = grab(c)
        shots.append((asked, time.perf_counter() - t0, img))
    final = shots[-1][2]
    floor = next(got for asked, got, img in shots if not differences(img, final))
    shot_rt = statistics.median(got - asked for asked, got, _ in shots)
    after_half = next((img for asked, _, img in shots if asked >= answered + 0.5), final)
    return {"action": answered, "watched": watched, "until": r.settle["until"], "final": watched_final,
            "floor": floor, "fixed0.5": answered + 0.5 + shot_rt, "half_final": not differences(after_half, final),
            "fixed2.0": answered + 2.0 + shot_rt}


def table(c: VMClient, vm, kinds: list[str], runs: int) -> None:
    print(f"{'step':26s} {'action':>7s} {'watched':>8s} {'until':>9s} {'final':>6s} {'floor':>7s} "
          f"{'fixed 0.5':>9s} {'0.5 final':>9s} {'fixed 2.0':>9s} {'gap':>6s}")
    med = statistics.median
    all_w, all_2, gaps = [], [], []
    for name in kinds:
        setup, pre, action = KINDS[name]
        rows = [one_kind(c, setup, pre, action) for _ in range(runs)]
        gap = max(longest_gap(c, vm, setup, pre, action) for _ in range(runs))
        untils = sorted({r["until"] for r in rows})
        all_w += [r["watched"] for r in rows]
        all_2 += [r["fixed2.0"] for r in rows]
        print(f"{name:26s} {med(r['action'] for r in rows):7.3f} {med(r['watched'] for r in rows):8.3f} "
              f"{'/'.join(untils):>9s} {sum(r['final'] for r in rows):>4d}/{runs} {med(r['floor'] for r in rows):7.3f} "
              f"{med(r['fixed0.5'] for r in rows):9.3f} {sum(r['half_final'] for r in rows):>7d}/{runs} "
              f"{med(r['fixed2.0'] for r in rows):9.3f} {gap:6.3f}", flush=True)
        gaps.append(gap)
    print(f"median step: watched {med(all_w):.3f} s vs fixed 2.0 {med(all_2):.3f} s "
          f"({med(all_2) / med(all_w):.1f}x faster); longest gap {max(gaps):.3f} s (QUIET = {QUIET} s)")


# -------------------------------------------------------------------------------------------------
# Part 2: the solutions check


def solutions(clients: list[VMClient], later: float) -> None:
    tasks = [t for t in load_tasks(os.path.join(ROOT, "tasks")) if not t.infeasible]
    todo: queue.Queue = queue.Queue()
    for t in tasks:
        todo.put(t)
    out, lock = [], threading.Lock()

    def worker(c: VMClient) -> None:
        while True:
            try:
                task = todo.get_nowait()
            except queue.Empty:
                return
            c.reset()
            c.setup(task.setup)
            for k, a in enumerate(task.solution):
                r = c.act(a, settle="watch", screenshot="png")
                time.sleep(later)
                diff = differences(r.image, grab(c))
                with lock:
                    out.append((task.id, k, a, r.settle, diff))
            score = c.evaluate(task.evaluator)["score"]
            with lock:
                out.append((task.id, "score", score, None, []))

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    steps = [o for o in out if o[1] != "score"]
    bad = [o for o in steps if o[4]]
    for tid, k, a, info, diff in bad:
        print(f"  differs: {tid} step {k} {a} settle {info}: regions {diff[:4]}")
    unsolved = [o[0] for o in out if o[1] == "score" and o[2] != 1.0]
    print(f"solutions check: {len(steps)} steps of {len(tasks)} tasks, {len(bad)} watched screens differ from the "
          f"screen {later:g} s later (carets and the clock aside); tasks not solved: {unsolved or 'none'}")
    untils = {u: sum(o[3]["until"] == u for o in steps) for u in ("quiet", "nochange", "cap")}
    waited = [o[3]["seconds"] for o in steps]
    print(f"  settles: {untils}; waited median {statistics.median(waited):.3f} s, max {max(waited):.3f} s")


# -------------------------------------------------------------------------------------------------
# Part 3: the explore check


def explore_check(c: VMClient, episodes: int, steps: int, later: float, seed: int = 0) -> None:
    from rewards import dhash
    from train_explore import Observation, parse_answer, random_policy
    choose, out = random_policy(random.Random(seed)), []
    for e in range(episodes):
        c.reset()
        img = grab(c)
        for t in range(steps):
            cursor = (img.width // 2, img.height // 2)
            _, parsed, _ = parse_answer(choose([Observation(0, t, img, cursor)])[0], img.size, cursor)
            a = parsed.action.to_dict()
            r = c.act(a, settle="watch", screenshot="png")
            time.sleep(later)
            img = grab(c)
            out.append((e, t, a, r.settle, differences(r.image, img), (dhash(r.image) ^ dhash(img)).bit_count()))
    bad = [o for o in out if o[4]]
    for e, t, a, info, diff, bits in bad:
        print(f"  differs: episode {e} step {t} {a} settle {info}: hash bits {bits}, regions {diff[:4]}")
    print(f"explore check: {len(out)} random steps in {episodes} episodes, {len(bad)} watched screens differ from the "
          f"screen {later:g} s later (carets and the clock aside), {sum(o[5] > 2 for o in out)} by more than 2 hash "
          f"bits; waited median {statistics.median(o[3]['seconds'] for o in out):.3f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs of each kind of step (part 1)")
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds of step (part 1)")
    p.add_argument("--desktops", type=int, default=1, help="desktops for the solutions check (part 2)")
    p.add_argument("--later", type=float, default=2.0, help="part 2: compare with the screen this long after")
    p.add_argument("--no-table", action="store_true", help="skip part 1")
    p.add_argument("--no-solutions", action="store_true", help="skip part 2")
    p.add_argument("--explore", type=int, default=0, help="part 3: episodes of random explore actions (0: skip)")
    p.add_argument("--explore-steps", type=int, default=8, help="part 3: steps per episode")
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.exit(f"bench/settle.py: unknown kinds {unknown}; choose from {', '.join(KINDS)}.")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    vms = [start_vm_server() for _ in range(max(1, args.desktops))]
    try:
        clients = [VMClient(vm.url, vm.token, timeout=60) for vm in vms]
        if not args.no_table:
            table(clients[0], vms[0], kinds, args.runs)
        if not args.no_solutions:
            solutions(clients, args.later)
        if args.explore:
            explore_check(clients[0], args.explore, args.explore_steps, args.later)
    except requests.RequestException as e:
        sys.exit(f"bench/settle.py: a desktop stopped answering ({e}).")
    finally:
        for vm in vms:
            vm.stop()


if __name__ == "__main__":
    main()
