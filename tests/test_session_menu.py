"""No click or key an agent can send ends the local desktop's session: openbox's menus and key
bindings, and tint2's panel, hold nothing that exits, restarts or replaces the window manager, or
starts a program.

Run: python -m pytest -q tests/test_session_menu.py     (~55 s; a real --xvfb desktop)

Why: an exploring agent right-clicked the empty end of the taskbar (tint2 hands such clicks to the
window manager), got openbox's root menu, and opened its "Exit Openbox" prompt; one more click
would have quit the window manager for the rest of the episode. vm/desktop.py (openbox_config,
tint2_config) now gives the session configurations without those.

The test is the agent, through POST /action: clicks, double clicks, right clicks, drags and
scrolls on the desktop's background and along the panel (its empty middle, its left end, the clock
at its right end), the key combinations openbox's stock rc.xml binds to programs (Print,
alt+Print, super+e) and the classic session killers (ctrl+alt+backspace, ctrl+alt+delete, alt+f4
on the desktop), and typing.
Middle clicks come from xdotool: the action schema has none, but a session that is safe only
because of that is one schema change from unsafe. Every openbox menu any of it opens has each of
its entries clicked in turn (an entry is a window of openbox's menu frame, so no screenshot
reading is needed); a prompt that appears gets the agent's next keys too (Tab, Enter: its second
button, "Exit" in openbox's exit prompt). After every step the session must be as it was: the same
openbox process managing the screen, no window and no process that was not there, HOME unchanged.
What went wrong is collected, the desktop reset, and the probe goes on, so a failure lists every
hole at once.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

from conftest import ENTER, proc_alive, proc_comm, proc_descendants, vm_call, x_env

# Everything the probe needs in one X connection, run on the desktop's display (x11() enters its
# network namespace): the window manager's name (EWMH check window), the managed windows, and
# every mapped popup menu with the centres of its entries. An openbox menu frame holds one
# window, whose children are the entries (separators are 7 px high); a GTK menu (pcmanfm's)
# draws its entries itself and lists none.
PROBE = r"""
import json
from Xlib import X, display, error
d = display.Display()
root = d.screen().root
def prop(w, name):
    p = w.get_full_property(d.intern_atom(name), X.AnyPropertyType)
    return p.value if p is not None else None
def title(w):
    v = prop(w, "_NET_WM_NAME")
    return (v.decode(errors="replace") if isinstance(v, bytes) else v) or w.get_wm_name() or ""
out = {"wm": None, "windows": {}, "menus": []}
check = prop(root, "_NET_SUPPORTING_WM_CHECK")
try:
    if check is not None and len(check):
        out["wm"] = title(d.create_resource_object("window", check[0]))
except error.XError:
    pass
for wid in prop(root, "_NET_CLIENT_LIST") or []:
    try:
        out["windows"][str(wid)] = title(d.create_resource_object("window", wid))
    except error.XError:
        pass
menu = d.intern_atom("_NET_WM_WINDOW_TYPE_POPUP_MENU")
for w in root.query_tree().children:
    try:
        if w.get_attributes().map_state != X.IsViewable or menu not in (prop(w, "_NET_WM_WINDOW_TYPE") or []):
            continue
        g, entries = w.get_geometry(), []
        for box in w.query_tree().children:
            for e in box.query_tree().children:
                eg = e.get_geometry()
                if e.get_attributes().map_state == X.IsViewable and eg.height > 10:
                    c = root.translate_coords(e, eg.width // 2, eg.height // 2)
                    entries.append((c.x, c.y))
        out["menus"].append({"rect": [g.x, g.y, g.width, g.height], "entries": sorted(entries, key=lambda p: p[1])})
    except error.XError:  # gone meanwhile
        pass
print(json.dumps(out))
"""

DESKTOP = (700, 400)      # empty background, right of the icons
PANEL = (700, 705)        # the taskbar's empty middle (tint2 forwards clicks there to openbox)
PANEL_LEFT = (12, 705)    # the panel's left end (where tint2's stock config puts its launcher)
CLOCK = (1215, 700)       # the clock, at its right end
KEYS = [["printscreen"], ["alt", "printscreen"], ["win", "e"], ["ctrl", "alt", "backspace"],
        ["ctrl", "alt", "delete"], ["alt", "f4"], ["alt", "space"], ["alt", "f2"], ["ctrl", "escape"],
        ["ctrl", "q"]]


def x11(vm, *argv: str, check: bool = False) -> subprocess.CompletedProcess:
    """conftest.x11, entering the network namespace of the desktop's X server itself rather than
    that of the first process of the desktop conftest.netns_of finds: on the unchanged desktop,
    after the menus' programs had run, conftest.x11 once reached another display (an invalid
    cookie), so a failing run could not finish its list."""
    prefix, env = x_env(vm)
    if prefix:
        xvfb = [p for p in proc_descendants(vm.proc.pid) if proc_comm(p) == "Xvfb"]
        prefix = [sys.executable, "-c", ENTER, f"/proc/{xvfb[0]}/ns/net"]
    return subprocess.run([*prefix, *argv], env=env, capture_output=True, text=True, timeout=10, check=check)


def probe(vm) -> dict:
    r = x11(vm, sys.executable, "-c", PROBE)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def act(vm, **action) -> None:
    r = vm_call(vm, "POST", "/action", action)
    assert r.status_code == 200, r.text


def middle_click(vm, x: int, y: int) -> None:
    x11(vm, "xdotool", "mousemove", str(x), str(y), "click", "2", check=True)


def home_files(vm) -> set[str]:
    return {os.path.relpath(os.path.join(top, f), vm.home) for top, _, files in os.walk(vm.home) for f in files}


class Session:
    """The desktop as it was after the last reset, and what the steps since changed of it."""

    def __init__(self, vm):
        self.vm, self.problems = vm, []
        self.reset()

    def reset(self) -> None:
        assert vm_call(self.vm, "POST", "/reset").status_code == 200
        self.pids = self.live()
        self.openbox = [p for p in self.pids if proc_comm(p) == "openbox"]
        self.windows = probe(self.vm)["windows"]
        self.home = home_files(self.vm)
        assert len(self.openbox) == 1 and probe(self.vm)["wm"] == "Openbox"

    def live(self) -> set[int]:
        return {p for p in proc_descendants(self.vm.proc.pid) if proc_alive(p)}

    def look(self, step: str, settle: float = 0.5) -> dict:
        """The screen after `step`: record what it changed of the session, reset if anything."""
        time.sleep(settle)
        seen, now = probe(self.vm), self.live()
        wrong = []
        if not proc_alive(self.openbox[0]) or seen["wm"] != "Openbox":
            wrong.append(f"openbox is gone (window manager now {seen['wm']!r})")
        new = {w: t for w, t in seen["windows"].items() if w not in self.windows}
        if new:
            wrong.append(f"new windows {sorted(new.values())}")
            if any("exit" in t.lower() for t in new.values()):  # the agent's next keys: Tab, Enter
                act(self.vm, type="key", keys=["tab"])
                act(self.vm, type="key", keys=["enter"])
                time.sleep(0.5)
                if not proc_alive(self.openbox[0]) or probe(self.vm)["wm"] != "Openbox":
                    wrong.append("and Tab, Enter in it quit openbox")
        started = sorted(proc_comm(p) for p in now - self.pids)
        gone = sorted(proc_comm(p) or str(p) for p in self.pids - now)
        if started:
            wrong.append(f"started {started}")
        if gone and not any("openbox is gone" in w for w in wrong):
            wrong.append(f"ended {gone}")
        if (files := home_files(self.vm)) != self.home:
            wrong.append(f"HOME changed: {sorted(files ^ self.home)}")
        if wrong:
            self.problems.append(f"{step}: " + "; ".join(wrong))
            self.reset()
        return seen

    def close_menus(self, seen: dict) -> None:
        """Escape whatever menu `seen` (a probe) shows, until none is left."""
        for _ in range(3):
            if not seen["menus"]:
                return
            act(self.vm, type="key", keys=["escape"])
            time.sleep(0.15)
            seen = probe(self.vm)

    def explore(self, step: str, open_it) -> None:
        """Do `open_it`; every openbox menu it opens gets each of its entries clicked, the menu
        opened afresh for each (a click on an entry closes it)."""
        open_it()
        seen = self.look(step)
        entries = [e for m in seen["menus"] for e in m["entries"]]
        self.close_menus(seen)
        for i, (x, y) in enumerate(entries):
            open_it()
            time.sleep(0.3)
            act(self.vm, type="click", x=x, y=y)
            self.close_menus(self.look(f"{step}, then a click on its entry {i + 1} of {len(entries)} (at {x},{y})"))


def test_no_click_or_key_ends_the_session(vm_desktop):
    vm = vm_desktop
    s = Session(vm)
    try:
        explored = False  # the window list's entries are clicked once, wherever it opened from
        for where, (x, y) in [("the desktop", DESKTOP), ("the panel", PANEL), ("the panel's left end", PANEL_LEFT),
                              ("the clock at the panel's right end", CLOCK)]:
            # The middle button opens openbox's window list (pcmanfm and tint2 hand it over; pcmanfm
            # stops doing so once its own right-click menu has been open, hence first); its entries
            # (workspaces, add or remove one) are clicked the first time only.
            middle = lambda: middle_click(vm, x, y)  # noqa: E731
            if explored:
                middle()
                s.close_menus(s.look(f"middle click on {where}"))
            else:
                s.explore(f"middle click on {where}", middle)
                explored = True
            for kind in ("click", "double_click", "right_click"):
                s.explore(f"{kind} on {where}", lambda: act(vm, type=kind, x=x, y=y))
            for direction in ("up", "down"):
                act(vm, type="scroll", direction=direction, x=x, y=y, amount=1)
                s.look(f"scroll {direction} on {where}", settle=0.3)
            act(vm, type="drag", x=x, y=y, x2=500, y2=300)
            s.close_menus(s.look(f"drag from {where}"))
        for keys in KEYS:
            act(vm, type="click", x=DESKTOP[0], y=DESKTOP[1])  # the desktop has the focus (alt+f4 on it)
            s.explore("+".join(keys) + " on the desktop", lambda: act(vm, type="key", keys=keys))
        act(vm, type="click", x=DESKTOP[0], y=DESKTOP[1])
        act(vm, type="type", text="exit quit logout")
        s.look("typing on the desktop")
        assert s.problems == [], "\n".join(["what the agent's actions did to the session:", *s.problems])
    finally:
        vm_call(vm, "POST", "/reset")


def test_the_session_is_configured_without_them(vm_desktop):
    """The files the running session read: openbox's rc.xml binds no action that exits, restarts,
    reconfigures or runs a program, nor shows a root menu; its menu.xml defines no menu; tint2's
    panel has no launcher, button or executor and no click command. (Restart and Reconfigure leave
    no trace the test above could see: openbox execs itself in place.)"""
    vm = vm_desktop
    config = os.path.join(os.path.dirname(vm.home), "run", "session", "config")
    rc = re.sub(r"<!--.*?-->", "", open(os.path.join(config, "openbox", "rc.xml")).read(), flags=re.S)
    assert not re.search(r"""name\s*=\s*["'](Execute|Exit|SessionLogout|Restart|Reconfigure)["']""", rc, re.I)
    assert not re.search(r"<menu>\s*root-menu\s*</menu>", rc) and not re.search(r"<file>", rc)
    assert "<popupTime>0</popupTime>" in rc and re.search(r"""name\s*=\s*["']Close["']""", rc)  # kept
    menu = open(os.path.join(config, "openbox", "menu.xml")).read()
    assert "<openbox_menu" in menu and not re.search(r"<(item|menu)\b", menu)
    tint2 = open(os.path.join(config, "tint2", "tint2rc")).read()
    items = re.search(r"(?m)^\s*panel_items\s*=\s*(\S+)", tint2)[1]
    assert "T" in items and "C" in items and not set("LBE") & set(items), items
    assert not re.search(r"(?m)^\s*(\w+_(command|cmd)|launcher_item_app)[ \t]*=[ \t]*\S", tint2)
