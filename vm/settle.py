"""vm/settle.py: wait until a desktop has settled after an action, by watching it from inside the VM.

After an action the papers' trainers sleep a fixed time before the next screenshot (ARPO/OSWorld
0.5 s, ScreenExplorer 1 s), while the desktop is usually done far sooner: an app's window is up and
drawn a fraction of a second after the double-click on its icon, a typed command's output a few
milliseconds after the keys (bench/settle.py measures every kind of step; docs/log.md). vm_server.py
calls this for `POST /action?settle=watch` and answers with the settled screen: one round trip per
step, as long as the desktop needs and no longer.

Why on the server, next to the X server: the X server tells us what it drew (the DAMAGE extension:
a few bytes per drawing, no screenshot shipped or compared per look, which matters when 8 desktops
share 2 cores), and the server can read its own desktop's processes in /proc.

The rule. Looking every LOOK seconds after the action, the desktop is still changing if, since the
previous look,
  1. the screen changed: the X server drew anything (a DamageNotify on the root window, which
     covers every window; drawing during the action counts at the first look);
  2. a program of the desktop is busy: one of its threads is running or waiting for a CPU or the
     disk now (state R or D), or together they used more than BUSY_CPU of CPU since the last look;
  3. a program the action started sleeps on a timer (its wchan is a nanosleep: `sleep 2; xclock`
     typed into a terminal), i.e. it said it will do more later.
It has settled once none of that happened for QUIET seconds and the screen changed at least once
("quiet"); an action whose screen never changes ("nochange") waits FIRST_CHANGE seconds for a
first change (and QUIET of stillness); nothing waits longer than CAP ("cap").

What counts as a change, and why a caret or a clock never keeps a step waiting: a blinking caret,
the taskbar clock and the taskbar's own timer are brief instants of drawing or CPU followed by at
least 0.4 s of stillness (GTK's caret: on 0.8 s, off 0.4 s; tint2 wakes twice a second), so each
can add at most QUIET to a step, never reach CAP. Only
continuous change does (an animation, `watch date`, a command that keeps running: `sleep 100`).
Why a second signal beside pixels: between an icon's selection highlight and the app's window the
screen is still for a moment while the app starts (longer on a loaded machine: a waiting app is
R, not drawing), and after a hotkey the app thinks before it draws a dialog; the app's threads are
running or runnable all that time, and /proc shows it (rule 2), which X events alone would not
(CreateNotify/MapNotify only come once the window exists). Rule 3 is there for a program that
waits on purpose before it shows anything; one that waits inside its own event loop (a GLib
timeout) is not seen, nor is a tooltip that appears after a hover delay of 0.5 s. The one case in
the task suite: GTK's file chooser, which completes a typed path (and turns its Save button
sensitive) and answers the Enter a little later, on timers of its own with nothing
running or drawing meanwhile (bench/settle.py: the settled screen still shows the dialog, as a
fixed 0.5 s one would).

Which processes: with --xvfb every process of the desktop is below the server (it is a subreaper;
in the sandbox the PID namespace holds nothing else). In your own VM the session was there before
the server, so besides our descendants we watch the processes of our user started since the
action began (the app a double-click launched), and not the rest of the session, whose background
work would otherwise keep every step waiting.

Without DAMAGE (an X server without the extension, or a python-xlib without Xlib.ext.damage) the
screen is compared as a full screenshot at every look instead (FALLBACK_LOOK apart). The X
server's own CPU is then left out of rule 2: serving our grab costs it more than BUSY_CPU, so
counting it would keep every step waiting until CAP; whatever it
draws shows in the next grab anyway.

Nothing in the papers does this: OSWorld-based trainers sleep a fixed time, and desktop-automation
tools that poll screenshot hashes pay at least their polling interval per step.

Used by vm_server.py (POST /action?settle=watch), vm/tasks.py (a setup that started an app
answers once it has settled) and vm/desktop.py (a reset's session is up once it has settled); copied
into a VM with vm_server.py. Stdlib, python-xlib and Pillow; imports vm/procs.py.
Tested by `python -m pytest -q tests/test_settle.py` (real desktops); `python bench/settle.py`
measures it step by step.
"""

from __future__ import annotations

import os
import time

from PIL import ImageGrab

from vm.procs import DesktopState, descendants

# The constants, and why each has its value. The measurements behind them (bench/settle.py's
# columns, on a 1280x720 --xvfb desktop of 2 shared cores, idle, at load 2 and beside CPU burners)
# are in docs/log.md.
LOOK = 0.02          # s between looks. A look only reads /proc (and takes the X events): cheap.
QUIET = 0.10         # s without change = settled. Above the longest stillness inside one reaction (a
#                      window mapping, a dialog drawing, a command's output: GTK draws on a 16.7 ms frame
#                      clock, and a program waiting for a CPU is seen as R), except GTK's file chooser
#                      (timers of its own, above); below 0.4 s, the shortest period of a caret blink or
#                      a taskbar tick, so those cost at most QUIET.
FIRST_CHANGE = 0.25  # s an action that changes nothing waits for a first change: above the latest first
#                      drawing any measured reaction made, under load too, with a margin for what /proc
#                      does not show (a compositor in your own VM).
CAP = 5.0            # s at most: far above the longest settle of any solution step of the task suite;
#                      an app's cold start on a slow VM can take seconds. Only continuous change
#                      reaches it (an animation, `watch date`), which a fixed settle cuts off too.
BUSY_CPU = 0.002     # s of CPU the desktop may use between two looks and still be idle: above its idle
#                      wake-ups (taskbar, X server, a caret blink, an open GTK file chooser's 60 Hz
#                      tick), below a starting app or a redraw, which use a whole CPU.
FALLBACK_LOOK = 0.05  # s between looks when screenshots stand in for DAMAGE
X_SERVERS = ("Xvfb", "Xorg", "X", "Xephyr", "Xwayland")  # their CPU is our grab's in the fallback


# -------------------------------------------------------------------------------------------------
# The desktop's programs, from /proc


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("ascii", "replace")
    except OSError:
        return ""


def _pids() -> set[int]:
    return {int(n) for n in os.listdir("/proc") if n.isdigit()}


class Programs:
    """The desktop's processes, as `look()` sees them between two looks: CPU used, a thread running
    or runnable, a newcomer asleep on a timer. `root`: the server's pid (its descendants are the
    desktop); `newcomers`: also watch our user's processes started since `arm()` (your own VM);
    `ignore`: names (/proc/PID/comm) of processes not watched."""

    def __init__(self, root: int, newcomers: bool, ignore: tuple[str, ...] = ()):
        self.root, self.newcomers, self.uid, self.ignore = root, newcomers, os.getuid(), ignore
        self.before: set[int] = set()
        self.cpu: dict[int, int] | None = None   # tid -> ns on a CPU at the last look; None: not armed

    def arm(self) -> None:
        """Before the action: what runs now is not new, and CPU is counted from here."""
        self.before, self.cpu = _pids(), None
        self.look()

    def watched(self) -> list[int]:
        pids = descendants(self.root)
        if self.newcomers:
            mine = set(pids)
            for p in _pids() - self.before - mine - {self.root}:
                try:
                    if os.stat(f"/proc/{p}").st_uid == self.uid:
                        pids.append(p)
                except OSError:
                    pass
        if self.ignore:
            pids = [p for p in pids if _read(f"/proc/{p}/comm").strip() not in self.ignore]
        return pids

    def look(self) -> tuple[float, bool, bool]:
        """-> (s of CPU the watched processes used since the last look, one of their threads is R or
        D now, a process started since arm() sleeps on a timer)."""
        used, running, sleeper, cpu = 0, False, False, {}
        for pid in self.watched():
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue  # gone
            for tid in tids:
                stat, sched = _read(f"/proc/{pid}/task/{tid}/stat"), _read(f"/proc/{pid}/task/{tid}/schedstat").split()
                if not stat or not sched:
                    continue
                state = stat.rsplit(")", 1)[1].split()[0]
                running |= state in "RD"
                ns = cpu[int(tid)] = int(sched[0])  # schedstat: ns on a CPU, ns waiting for one, slices
                # A thread first seen now is new: all its CPU time is since the last look.
                used += 0 if self.cpu is None else ns - self.cpu.get(int(tid), 0)
            if pid not in self.before and "nanosleep" in _read(f"/proc/{pid}/wchan"):
                sleeper = True  # `sleep 2` (hrtimer_nanosleep), time.sleep() (do_nanosleep on older kernels)
        self.cpu = cpu
        return used / 1e9, running, sleeper


# -------------------------------------------------------------------------------------------------
# The screen, from the X server


def x_time(stamp: int, now: float) -> float:
    """An X server timestamp (ms of the server's CLOCK_MONOTONIC, 32 bits, so it wraps every 49.7
    days) as time.monotonic() seconds, given `now` = time.monotonic(). Xorg and Xvfb on Linux use
    the same clock as ours; a stamp more than a minute old (another clock) counts as `now`."""
    age = ((int(now * 1000) & 0xFFFFFFFF) - stamp) & 0xFFFFFFFF  # ms, correct across the wrap
    return now - age / 1000 if age < 60_000 else now


class Screen:
    """What the X server drew between two looks: DamageNotify events on the root window (reported
    raw, one per drawing, so no re-arming can race with new drawing). The DAMAGE object lives from
    arm() to disarm(), one settle: between settles nothing is reported, so nothing piles up unread
    in the X server while a client settles by sleeping. Without DAMAGE: a screenshot compared with
    the previous look's."""

    def __init__(self, display_name: str, damage: bool = True):
        from Xlib import display as xdisplay
        self.name = display_name or None
        self.x = xdisplay.Display(self.name)
        self.watching = damage and self.x.has_extension("DAMAGE")  # else: screenshots
        if self.watching:
            self.x.damage_query_version()  # the protocol requires it before any other DAMAGE request
            self.notify = self.x.extension_event.DamageNotify  # the event code (python-xlib clones the class)
        self.damage = None  # the DAMAGE object of the settle under way
        self.last = None    # the fallback's previous screenshot

    def arm(self) -> None:
        """Start watching, just before the action."""
        if not self.watching:
            self.last = ImageGrab.grab(xdisplay=self.name).tobytes()
            return
        from Xlib.ext import damage as xdamage
        self.disarm()
        self.damage = self.x.screen().root.damage_create(xdamage.DamageReportRawRectangles)
        self.x.sync()  # a new object reports the whole screen once; that, and whatever the last
        while self.x.pending_events():  # settle's object reported after it was read, is not news
            self.x.next_event()

    def disarm(self) -> None:
        if self.damage is not None:
            self.x.damage_destroy(self.damage)
            self.x.flush()
            self.damage = None

    def drawn(self) -> float | None:
        """-> when the first drawing since the last look happened (time.monotonic()), or None."""
        now = time.monotonic()
        if not self.watching:
            shot = ImageGrab.grab(xdisplay=self.name).tobytes()
            changed, self.last = shot != self.last, shot
            return now if changed else None
        first = None
        while self.x.pending_events():  # reads what has arrived, never blocks
            e = self.x.next_event()
            if e.type == self.notify and first is None:
                first = e.timestamp
        return None if first is None else x_time(first, now)

    def close(self) -> None:
        self.x.close()


# -------------------------------------------------------------------------------------------------
# The rule


def verdict(waited: float, still: float, changed: bool, cap: float = CAP,
            first_change: float = FIRST_CHANGE) -> str | None:
    """The rule at one look: `waited` s since the action ended, the desktop `still` for that long,
    the screen `changed` since the action began -> "quiet", "nochange", "cap", or None (wait on)."""
    if waited >= cap:
        return "cap"
    if still >= QUIET and changed:
        return "quiet"
    if still >= QUIET and waited >= first_change:
        return "nochange"
    return None


class Watcher:
    """One desktop's settle: `arm()` just before the action, `settle(started)` right after it.
    `display`: the X display; `root`: the pid whose descendants are the desktop (the server);
    `newcomers`: also watch our user's processes started by the action (a VM's own session);
    `damage=False` forces the screenshot fallback."""

    def __init__(self, display: str, root: int, newcomers: bool = False, damage: bool = True):
        self.screen = Screen(display, damage)
        # The fallback's grabs keep the X server busy: see the module docstring.
        self.programs = Programs(root, newcomers, ignore=() if self.screen.watching else X_SERVERS)
        self.look = LOOK if self.screen.watching else FALLBACK_LOOK

    def arm(self) -> None:
        self.screen.arm()
        self.programs.arm()

    def settle(self, started: float, cap: float = CAP, first_change: float = FIRST_CHANGE) -> dict:
        """Wait until the desktop has settled (see the module docstring) -> the X-Settle dict:
        seconds waited after the action, until ("quiet", "nochange" or "cap"), and first_change,
        the seconds from `started` (time.monotonic() when the action began) to the first change
        on screen (None if none)."""
        end = time.monotonic()
        last, first = end, None
        while True:
            time.sleep(self.look)
            drew = self.screen.drawn()
            used, running, sleeper = self.programs.look()
            now = time.monotonic()
            if drew is not None and first is None:
                first = drew
            if drew is not None or running or sleeper or used > BUSY_CPU:
                last = now
            until = verdict(now - end, now - last, first is not None, cap, first_change)
            if until is None:
                continue
            self.screen.disarm()
            return {"seconds": round(now - end, 3), "until": until,
                    "first_change": None if first is None else round(max(0.0, first - started), 3)}

    def close(self) -> None:
        self.screen.close()


_watchers: dict[str, Watcher] = {}


def watcher(desk: DesktopState) -> Watcher:
    """The served desktop's Watcher, made at its first use and kept (an X connection of its own).
    This server's descendants are the desktop; in your own VM (no --xvfb) also the processes of
    our user that an action starts."""
    if desk.display not in _watchers:
        _watchers[desk.display] = Watcher(desk.display, os.getpid(), newcomers=desk.xvfb is None)
    return _watchers[desk.display]
