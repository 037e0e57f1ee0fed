"""The watched settle (vm/settle.py, POST /action?settle=watch) on real desktops, one test per rule,
and the protocol around it.

Run: python -m pytest -q tests/test_settle.py   (~1 min; needs the packages of setup.sh)

Each rule is shown on the real thing, and where a rule could be missing the test shows what a
fixed settle gets instead (so the test fails without the rule): a window that maps 1 s after a
typed command (a program asleep on a timer), a busy program that shows its window when done,
a blinking caret and a ticking clock that must not keep a step waiting, an action that changes
nothing (waits FIRST_CHANGE), a screen that never stops changing (stops at CAP). The rule itself
(`verdict`) and the X clock conversion (`x_time`) get hand-computed numbers; `Programs` is checked
on processes this test starts. Protocol: the X-Settle header, the PNG/JPEG body, a refused query
runs nothing, a fixed settle sleeps what it says; VMClient.act.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
from PIL import Image

from conftest import in_x_namespace, mouse, proc_descendants, vm_call, wait_for, x11

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vm import settle  # noqa: E402
from env import ActResult, VMClient  # noqa: E402
from vm.settle import CAP, FIRST_CHANGE, QUIET, Programs, verdict, x_time  # noqa: E402

SCREEN = (1280, 720)


# ------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture
def vm(vm_desktop):
    """The session's shared desktop, reset before and after the test."""
    assert vm_call(vm_desktop, "POST", "/reset").status_code == 200
    yield vm_desktop
    vm_call(vm_desktop, "POST", "/reset")


def act(vm, action: dict, query: str = "settle=watch&screenshot=png"):
    """POST /action?<query> -> (the X-Settle dict, the screen it answered with or None)."""
    r = vm_call(vm, "POST", "/action?" + query, action)
    assert r.status_code == 200, r.text
    img = Image.open(io.BytesIO(r.content)).convert("RGB") if r.headers["Content-Type"].startswith("image/") else None
    return json.loads(r.headers["X-Settle"]), img


def titles(vm) -> list[str]:
    out = x11(vm, "wmctrl", "-l").stdout
    return [line.split(None, 3)[3] if len(line.split(None, 3)) > 3 else "" for line in out.splitlines()]


def terminal(vm) -> None:
    """An xterm with the keyboard focus, its prompt drawn."""
    steps = [{"type": "launch", "argv": ["xterm"]},
             {"type": "command", "argv": ["xdotool", "search", "--sync", "--onlyvisible", "--class", "xterm"],
              "timeout": 15}]
    assert vm_call(vm, "POST", "/setup", {"steps": steps}).status_code == 200
    act(vm, {"type": "wait", "amount": 0})  # settled


def screen(vm) -> Image.Image:
    return Image.open(io.BytesIO(vm_call(vm, "GET", "/screenshot").content)).convert("RGB")


def boxes(a: Image.Image, b: Image.Image) -> tuple[int, int, int, int] | None:
    """The bounding box of every pixel where two screens differ, the taskbar's clock and date
    aside (a minute may turn between two screenshots), or None."""
    from PIL import ImageChops
    a, b = a.copy(), b.copy()
    for img in (a, b):
        img.paste((0, 0, 0), (SCREEN[0] - 160, SCREEN[1] - 34, SCREEN[0], SCREEN[1]))
    return ImageChops.difference(a, b).getbbox()


# ------------------------------------------------------------------------------------------------
# The rule and the clock, by hand


def test_verdict_by_hand():
    # waited (s since the action ended), still (s without change), changed (the screen changed)
    assert verdict(0.05, 0.05, True) is None                        # still less than QUIET: wait on
    assert verdict(0.30, QUIET, True) == "quiet"                    # QUIET of stillness after a change
    assert verdict(0.30, QUIET - 0.001, True) is None
    assert verdict(0.12, 0.12, False) is None                       # no change yet: FIRST_CHANGE first
    assert verdict(FIRST_CHANGE, 0.12, False) == "nochange"
    assert verdict(FIRST_CHANGE, 0.05, False) is None               # ... and QUIET of stillness too
    assert verdict(CAP, 0.0, True) == "cap" and verdict(CAP + 1, 0.0, False) == "cap"
    assert verdict(1.0, 0.2, True, cap=0.5) == "cap"
    assert verdict(0.2, 0.2, False, first_change=0.1) == "nochange"


def test_x_time_by_hand():
    # now = 1000.000 s -> 1_000_000 ms; a stamp 40 ms old is 999.960 s
    assert x_time(1_000_000 - 40, 1000.0) == pytest.approx(999.960)
    # across the 32-bit wrap: now = 2**32 ms + 5 ms (our clock) -> the server's stamp reads 5 - 30
    now = (2 ** 32 + 5) / 1000
    assert x_time((5 - 30) % 2 ** 32, now) == pytest.approx(now - 0.030)
    # a stamp from another clock (90 s "old") counts as now
    assert x_time(1_000_000 - 90_000, 1000.0) == 1000.0


# A stand-in desktop: a process whose children are, in turn, an idle one started before the action,
# a busy loop, and a newcomer asleep on a timer; it says which phase it is in, and waits for a line.
PHASES = """
import subprocess, sys
idle = subprocess.Popen(["sleep", "30"])
print("idle", flush=True); sys.stdin.readline()
busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
print("busy", flush=True); sys.stdin.readline(); busy.kill(); busy.wait()
late = subprocess.Popen(["sleep", "30"])
print("late", late.pid, flush=True); sys.stdin.readline(); late.kill(); late.wait()
print("gone", flush=True); sys.stdin.readline(); idle.kill()
"""


def test_programs_sees_cpu_a_runnable_thread_and_a_sleeper():
    root = subprocess.Popen([sys.executable, "-c", PHASES], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    p = Programs(root.pid, newcomers=False)

    def phase() -> list[str]:
        root.stdin.write("\n")
        root.stdin.flush()
        return root.stdout.readline().split()
    try:
        assert root.stdout.readline().split() == ["idle"]
        p.arm()
        time.sleep(0.05)
        used, running, sleeper = p.look()
        assert used < settle.BUSY_CPU and not running and not sleeper, (used, running, sleeper)
        assert phase() == ["busy"]
        time.sleep(0.2)
        used, running, _ = p.look()
        assert used > settle.BUSY_CPU and running, (used, running)  # it ran, and is R (running or runnable)
        word, pid = phase()
        wait_for(lambda: "nanosleep" in open(f"/proc/{pid}/wchan").read(), "the newcomer to go to sleep")
        assert p.look()[2], "a newcomer asleep on a timer"
        assert phase() == ["gone"]
        assert not p.look()[2]
    finally:
        root.kill()
        root.wait()


# ------------------------------------------------------------------------------------------------
# One test per rule, on a real desktop


def test_a_window_that_maps_late_is_waited_for(vm):
    """Rule 3: `sleep 1; xmessage` typed into a terminal. The screen is still for a second (the
    command sleeps), then a window maps; the watched settle answers with the window on screen."""
    terminal(vm)
    before = screen(vm)
    info, img = act(vm, {"type": "type", "text": "sleep 1; xmessage -geometry +500+300 mapped late\n"})
    assert info["until"] == "quiet" and 1.0 <= info["seconds"] < CAP, info
    assert "xmessage" in titles(vm)
    box = boxes(before, img)
    assert box and box[0] <= 500 and box[1] <= 300 < box[3], (box, "the window is in the answer")
    time.sleep(1.0)
    assert boxes(img, screen(vm)) is None, "the answer was the final screen"
    # Without the rule a fixed settle shorter than the sleep answers without the window.
    vm_call(vm, "POST", "/reset")
    terminal(vm)
    info, _ = act(vm, {"type": "type", "text": "sleep 1; xmessage -geometry +500+300 again\n"}, "settle=0.3")
    assert info["until"] == "fixed" and "xmessage" not in titles(vm)


def test_a_busy_program_is_waited_for(vm):
    """Rule 2: a command that computes for 0.8 s and then opens a window; it draws nothing while
    it computes, but it runs, so the settle waits."""
    terminal(vm)
    cmd = "timeout 0.8 sh -c 'while :; do :; done'; xmessage -geometry +500+300 computed\n"
    info, img = act(vm, {"type": "type", "text": cmd})
    assert info["until"] == "quiet" and 0.8 <= info["seconds"] < CAP, info
    assert "xmessage" in titles(vm)
    time.sleep(1.0)
    assert boxes(img, screen(vm)) is None


def test_an_app_started_by_a_double_click_is_up_in_the_answer(vm):
    """A desktop icon: the window is up and drawn in the answer (the gap between the icon's
    highlight and the window is covered by the app's own activity)."""
    from vm.desktop import desktop_icons
    x, y = desktop_icons(SCREEN)["Text Editor"]
    info, img = act(vm, {"type": "double_click", "x": x, "y": y})
    assert info["until"] == "quiet" and info["first_change"] is not None, info
    assert any(t.endswith("Mousepad") for t in titles(vm))
    time.sleep(1.5)
    box = boxes(img, screen(vm))  # at most the caret blinked since
    assert box is None or (box[2] - box[0] <= 4 and box[3] - box[1] <= 40), box


@pytest.mark.parametrize("system, want", [
    ("<openbox_config><desktops><number>4</number><popupTime>875</popupTime></desktops></openbox_config>",
     "<openbox_config><desktops><number>4</number><popupTime>0</popupTime></desktops></openbox_config>"),
    ("<openbox_config><desktops><number>4</number></desktops></openbox_config>",
     "<openbox_config><desktops><popupTime>0</popupTime><number>4</number></desktops></openbox_config>"),
    ("<openbox_config><theme/></openbox_config>",
     "<openbox_config><theme/><desktops><popupTime>0</popupTime></desktops></openbox_config>")])
def test_openbox_config_switches_the_workspace_popup_off(tmp_path, monkeypatch, system, want):
    """The system's rc.xml, with the popup's time 0 however the system file states it (or not)."""
    from vm.desktop import openbox_config
    os.makedirs(tmp_path / "xdg" / "openbox")
    (tmp_path / "xdg" / "openbox" / "rc.xml").write_text(system)
    monkeypatch.setenv("XDG_CONFIG_DIRS", str(tmp_path / "xdg"))
    openbox_config(str(tmp_path / "home"))
    assert (tmp_path / "home" / "openbox" / "rc.xml").read_text() == want


def test_a_workspace_switch_answers_the_screen_a_fixed_sleep_would(vm):
    """A scroll on the empty desktop switches openbox's workspace. openbox would show a "desktop 2"
    popup for 875 ms on a timer of its own, which the watch answers before and a fixed 1-2 s
    sleep after; the desktop's openbox has the popup off (desktop.openbox_config), so the watched
    screen is the one 2 s later, and the switch itself still happens."""
    def current():
        return next(line.split()[0] for line in x11(vm, "wmctrl", "-d").stdout.splitlines() if " * " in line)
    first = current()
    for direction in ("down", "up"):
        before = current()
        # one wheel click: one switch (the default 5 go round the 4 workspaces, and openbox may
        # drop one of a fast burst, so where 5 end is not fixed)
        info, img = act(vm, {"type": "scroll", "x": 640, "y": 360, "direction": direction, "amount": 1})
        time.sleep(2.0)
        assert boxes(img, screen(vm)) is None, (direction, info, "the watched screen is the final one")
        assert current() != before, "the scroll switched the workspace"
    assert current() == first


def test_a_blinking_caret_does_not_keep_a_step_waiting(vm):
    """GTK's caret blinks (on 0.8 s, off 0.4 s): each blink is drawing, yet the step ends QUIET
    after it, far from CAP."""
    steps = [{"type": "open", "path": "notes.txt"}]
    assert vm_call(vm, "POST", "/setup", {"steps": steps}).status_code == 200
    wait_for(lambda: any(t.endswith("Mousepad") for t in titles(vm)), "the editor")
    act(vm, {"type": "wait", "amount": 0})
    shots = []
    for _ in range(8):  # the caret really blinks: caret-sized differences over 2 s
        shots.append(screen(vm))
        time.sleep(0.25)
    blinks = [b for a, b2 in zip(shots, shots[1:]) if (b := boxes(a, b2))]
    assert blinks and all(b[2] - b[0] <= 4 for b in blinks), blinks
    for _ in range(3):
        info, _ = act(vm, {"type": "wait", "amount": 0})
        assert info["seconds"] < 1.0 and info["until"] in ("quiet", "nochange"), info


def test_a_ticking_clock_does_not_keep_a_step_waiting(vm):
    """xclock redrawing every second: each tick is drawing; a step that does nothing still ends
    within a second, not at CAP."""
    terminal(vm)
    act(vm, {"type": "type", "text": "xclock -digital -update 1 -geometry +600+300 &\n"})
    wait_for(lambda: "xclock" in titles(vm), "xclock")
    a = screen(vm)
    wait_for(lambda: boxes(a, screen(vm)) is not None, "the clock to tick", timeout=5)
    for _ in range(3):
        info, _ = act(vm, {"type": "move", "x": 900, "y": 600})
        assert info["seconds"] < 1.2, info


def test_an_action_that_changes_nothing_waits_first_change(vm):
    act(vm, {"type": "move", "x": 900, "y": 500})
    infos = []
    for _ in range(3):  # the taskbar clock may change once a minute: one of three is enough
        info, img = act(vm, {"type": "move", "x": 900, "y": 500})  # the pointer is there already
        infos.append(info)
        if info["until"] == "nochange":
            break
    assert info["until"] == "nochange" and info["first_change"] is None, infos
    assert FIRST_CHANGE <= info["seconds"] < CAP
    assert img.size == SCREEN


def test_a_screen_that_never_stops_changing_stops_at_the_cap(vm):
    terminal(vm)
    info, _ = act(vm, {"type": "type", "text": "while :; do date +%N; done\n"}, "settle=watch")
    assert info["until"] == "cap" and CAP <= info["seconds"] < CAP + 1, info  # the reset stops the loop


def test_the_screenshot_fallback_follows_the_same_rule(vm):
    """Without DAMAGE (forced here): screenshots compared at every look. Watched from this test
    process, on the served desktop (its server's processes are the desktop). The watcher's
    screenshots need the desktop's display, so the whole episode runs in a thread inside the
    sandbox's network namespace, and the double-click comes from xdotool on that display."""
    from vm.desktop import desktop_icons
    argv = {p: open(f"/proc/{p}/cmdline", "rb").read().split(b"\0") for p in proc_descendants(vm.proc.pid)}
    server = [p for p, a in argv.items() if a[0] == sys.executable.encode() and a[1].endswith(b"vm_server.py")]
    x, y = desktop_icons(SCREEN)["Terminal"]

    def episode():
        w = settle.Watcher(vm.display, server[-1], damage=False)  # the server inside the sandbox
        try:
            assert not w.screen.watching and w.look == settle.FALLBACK_LOOK
            w.arm()
            started = time.monotonic()
            x11(vm, "xdotool", "mousemove", str(x), str(y), "click", "--repeat", "2", "--delay", "50", "1", check=True)
            launched = w.settle(started)
            w.arm()
            idle = w.settle(time.monotonic())  # nothing happens
            return launched, idle
        finally:
            w.close()
    launched, idle = in_x_namespace(vm, episode)
    assert launched["until"] == "quiet" and launched["first_change"] is not None, launched
    assert "xterm" in titles(vm)
    assert idle["until"] == "nochange", idle


# ------------------------------------------------------------------------------------------------
# The protocol


def test_the_answer_carries_the_settle_and_the_screen(vm):
    r = vm_call(vm, "POST", "/action?settle=watch&screenshot=png", {"type": "move", "x": 10, "y": 10})
    assert r.status_code == 200 and r.headers["Content-Type"] == "image/png"
    info = json.loads(r.headers["X-Settle"])
    assert set(info) == {"seconds", "until", "first_change"} and info["until"] in ("quiet", "nochange")
    assert Image.open(io.BytesIO(r.content)).size == SCREEN
    r = vm_call(vm, "POST", "/action?settle=watch&screenshot=jpeg&quality=30", {"type": "move", "x": 20, "y": 20})
    assert r.headers["Content-Type"] == "image/jpeg" and Image.open(io.BytesIO(r.content)).size == SCREEN
    r = vm_call(vm, "POST", "/action?settle=watch", {"type": "move", "x": 30, "y": 30})
    assert r.headers["Content-Type"] == "application/json"
    assert r.json() == {"ok": True, "settle": json.loads(r.headers["X-Settle"])}
    r = vm_call(vm, "POST", "/action", {"type": "move", "x": 40, "y": 40})  # as before: no settle
    assert r.json() == {"ok": True, "settle": {"seconds": 0.0, "until": "none", "first_change": None}}
    assert json.loads(r.headers["X-Settle"])["until"] == "none"


def test_a_fixed_settle_sleeps_what_it_says(vm):
    t0 = time.monotonic()
    info, img = act(vm, {"type": "move", "x": 50, "y": 50}, "settle=0.4&screenshot=png")
    assert time.monotonic() - t0 >= 0.4
    assert info == {"seconds": 0.4, "until": "fixed", "first_change": None} and img.size == SCREEN


@pytest.mark.parametrize("query", ["settle=soon", "settle=10.5", "settle=-1", "settle=1e1", "settle=%C2%B2",
                                   "settle=watch&screenshot=gif", "settle=watch&screenshot=jpeg&quality=0",
                                   "screenshot=png&quality=x"])
def test_a_bad_query_is_refused_before_anything_runs(vm, query):
    act(vm, {"type": "move", "x": 100, "y": 100}, "")
    r = vm_call(vm, "POST", "/action?" + query, {"type": "move", "x": 300, "y": 300})
    assert r.status_code == 400 and r.json()["error"].endswith(".")
    assert mouse(vm) == (100, 100), "the action must not have run"


def test_client_act_answers_the_settled_screen(vm):
    c = VMClient(vm.url, vm.token)
    r = c.act({"type": "move", "x": 60, "y": 60}, settle="watch", screenshot="png")
    assert isinstance(r, ActResult) and r.image.size == SCREEN and r.image.mode == "RGB"
    assert r.settle["until"] in ("quiet", "nochange")
    r = c.act({"type": "move", "x": 70, "y": 70}, settle=0.1, screenshot="jpeg", quality=40)
    assert r.settle == {"seconds": 0.1, "until": "fixed", "first_change": None} and r.image.size == SCREEN
    assert c.act({"type": "move", "x": 80, "y": 80}, settle="watch")["settle"]["until"] in ("quiet", "nochange")
    with pytest.raises(ValueError, match="settle must be"):
        c.act({"type": "move", "x": 80, "y": 80}, settle="later")
