"""vm_server.py on real Xvfb desktops over real HTTP (loopback): every action changes the desktop
observably, /reset restores it, every setup step and check type works (and fails when it should),
auth and input validation hold, and stopping the server leaves no process behind.

Run: python -m pytest -q tests/test_vm_server.py   (~1 min; needs the packages of setup.sh)
"""

from __future__ import annotations

import hashlib
import io
import os
import select
import shutil
import signal
import subprocess
import sys
import time

import pytest
import requests
from PIL import Image, ImageChops

from conftest import SERVER, proc_alive, proc_descendants, start_vm_server, vm_call
from conftest import mouse, netns_of, wait_for, x11 as on_display

sys.path.insert(0, os.path.dirname(SERVER))
import vm_server  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402

ICONS = desktop_icons((1280, 720))
BG = (0x2F, 0x5F, 0x8F)


# ------------------------------------------------------------------------------------------------
# helpers: observe the desktop from outside the server (xdotool / wmctrl / the files in HOME)

def act(vm, **action):
    r = vm_call(vm, "POST", "/action", action)
    assert r.status_code == 200, r.text


def reset(vm):
    r = vm_call(vm, "POST", "/reset")
    assert r.status_code == 200, r.text


def x11(vm, *argv) -> str:
    return on_display(vm, *argv).stdout


def windows(vm) -> list[str]:
    """Titles of the app windows (workspace >= 0: not the desktop icons or the taskbar)."""
    rows = [line.split(None, 3) + [""] for line in x11(vm, "wmctrl", "-l").splitlines()]
    return [r[3] for r in rows if r[1] != "-1"]


def wait_window(vm, title: str) -> None:
    wait_for(lambda: title in windows(vm), f"window {title!r} (have {windows(vm)})")


def geometry(vm, title: str) -> tuple[int, int, int, int]:
    """(x, y, w, h) on screen of the client area of the window called `title` (xwininfo; xdotool's
    getwindowgeometry counts the window frame's offset twice)."""
    info = dict(line.strip().split(":", 1) for line in x11(vm, "xwininfo", "-name", title).splitlines()
                if line.count(":") == 1)
    return tuple(int(info[k]) for k in ("Absolute upper-left X", "Absolute upper-left Y", "Width", "Height"))


def shot(vm, fmt="png") -> Image.Image:
    r = vm_call(vm, "GET", f"/screenshot?format={fmt}")
    assert r.status_code == 200, r.text
    return Image.open(io.BytesIO(r.content)).convert("RGB")


def changed(a: Image.Image, b: Image.Image) -> float:
    """Fraction of pixels that differ between two images."""
    diff = ImageChops.difference(a, b).convert("L").point(lambda v: 255 if v > 16 else 0)
    return sum(diff.histogram()[255:]) / (a.width * a.height)


def is_bg(img: Image.Image, box) -> bool:
    """Is `box` all desktop background?"""
    colours = img.crop(box).getcolors(1 << 16)  # [(count, rgb)], or None if very many
    return colours is not None and [c for _, c in colours] == [BG]


@pytest.fixture
def vm(vm_desktop):
    """The shared desktop, reset to its initial state before each test."""
    reset(vm_desktop)
    return vm_desktop


# ------------------------------------------------------------------------------------------------
# screenshots and the layout contract

def test_screenshots_decode_to_screen_size(vm):
    assert vm_call(vm, "GET", "/health").json() == {"ok": True, "screen": [1280, 720]}
    r = vm_call(vm, "GET", "/screenshot")
    assert r.headers["Content-Type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    sizes = {}
    for q in (10, 90):
        r = vm_call(vm, "GET", f"/screenshot?format=jpeg&quality={q}")
        assert r.headers["Content-Type"] == "image/jpeg"
        assert Image.open(io.BytesIO(r.content)).size == (1280, 720)
        sizes[q] = len(r.content)
    assert sizes[10] < sizes[90]  # the quality parameter reaches the encoder
    img = shot(vm)
    assert img.size == (1280, 720)
    # The background colour fills the empty desktop; the taskbar is at the bottom.
    assert img.getpixel((700, 300)) == BG and img.getpixel((700, 710)) != BG


def test_encode_png_is_lossless():
    # Noise plus flat areas: every pixel must come back exactly, in the right row and column.
    img = Image.effect_noise((97, 61), 80).convert("RGB")
    img.paste((47, 95, 143), (10, 10, 60, 40))
    back = Image.open(io.BytesIO(vm_server.encode_png(img)))
    assert back.mode == "RGB" and back.size == (97, 61)
    assert ImageChops.difference(img, back).getbbox() is None
    rgba = Image.new("RGBA", (3, 2), (1, 2, 3, 4))  # other modes are converted to RGB first
    assert Image.open(io.BytesIO(vm_server.encode_png(rgba))).getpixel((2, 1)) == (1, 2, 3)


def test_every_desktop_icon_opens_its_app(vm):
    expected = {"Terminal": "xterm", "Text Editor": "Untitled 1 - Mousepad", "Calculator": "galculator",
                "File Manager": "home", "Clock": "xclock", "Eyes": "xeyes", "XCalc": "Calculator"}
    assert set(ICONS) == set(expected)
    img = shot(vm)
    for label, (x, y) in ICONS.items():
        assert not is_bg(img, (x - 8, y - 8, x + 8, y + 8)), f"no icon drawn at {label}'s position"
    for label, title in expected.items():
        if windows(vm):
            reset(vm)  # an open window may cover the next icon
        x, y = ICONS[label]
        act(vm, type="double_click", x=x, y=y)
        wait_window(vm, title)


# ------------------------------------------------------------------------------------------------
# every action type has an observable effect

def test_move_and_click(vm):
    act(vm, type="move", x=321, y=123)
    assert mouse(vm) == (321, 123)
    x, y = ICONS["Terminal"]
    cell = (x - 58, y - 30, x + 62, y + 70)
    before = shot(vm).crop(cell)
    act(vm, type="click", x=x, y=y)  # a single click selects the icon: its label is highlighted
    time.sleep(0.3)
    assert changed(before, shot(vm).crop(cell)) > 0.02
    assert mouse(vm) == (x, y)
    act(vm, type="click", x=700, y=400)  # clicking the empty desktop deselects it again
    time.sleep(0.3)
    assert changed(before, shot(vm).crop(cell)) < 0.005
    act(vm, type="click")  # no point: clicks where the mouse is
    assert mouse(vm) == (700, 400)


def test_right_click_opens_context_menu(vm):
    box = (702, 402, 800, 500)  # below-right of the click, where the menu unfolds
    assert is_bg(shot(vm), box)
    act(vm, type="right_click", x=700, y=400)
    wait_for(lambda: not is_bg(shot(vm), box), "the desktop's context menu")
    act(vm, type="key", keys=["esc"])
    wait_for(lambda: is_bg(shot(vm), box), "the menu to close")


PRINTABLE = "".join(map(chr, range(32, 127)))


def test_type_hotkey_and_save_in_editor(vm):
    x, y = ICONS["Text Editor"]
    act(vm, type="double_click", x=x, y=y)
    wait_window(vm, "Untitled 1 - Mousepad")
    act(vm, type="type", text="ascii line 1\n")
    act(vm, type="type", text=PRINTABLE + "\n")  # every ASCII symbol lands as itself ("<" once didn't)
    act(vm, type="type", text="héllo wörld ✓")  # non-ASCII goes through xdotool
    act(vm, type="key", keys=["ctrl", "s"])
    wait_window(vm, "Save As")
    act(vm, type="type", text="typed.txt")
    time.sleep(0.3)
    act(vm, type="key", keys=["enter"])
    wait_window(vm, "typed.txt - Mousepad")
    path = os.path.join(vm.home, "typed.txt")
    wait_for(lambda: os.path.exists(path), "the saved file")
    assert open(path, encoding="utf-8").read().startswith("ascii line 1\n" + PRINTABLE + "\nhéllo wörld ✓")


def test_hotkey_closes_window(vm):
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "launch", "argv": ["galculator"]}]})
    assert r.status_code == 200, r.text
    wait_window(vm, "galculator")
    time.sleep(0.3)
    act(vm, type="key", keys=["alt", "f4"])  # openbox's default close binding (on the focused window)
    wait_for(lambda: "galculator" not in windows(vm), "alt+f4 to close galculator")


def test_drag_moves_icon_and_selects_text(vm):
    # 1. Dragging a desktop icon moves it; pcmanfm records the new place in HOME.
    x, y = ICONS["Terminal"]
    act(vm, type="drag", x=x, y=y, x2=640, y2=300)
    conf = os.path.join(vm.home, ".config/pcmanfm/default/desktop-items-0.conf")
    wait_for(lambda: "x=16\ny=16" not in open(conf).read().split("[terminal.desktop]")[1][:20],
             "pcmanfm to save the moved icon")
    img = shot(vm)
    assert is_bg(img, (x - 8, y - 8, x + 8, y + 8)) and not is_bg(img, (620, 280, 660, 320))
    # 2. Dragging over text in a terminal selects it (X's PRIMARY selection).
    vm_call(vm, "POST", "/setup", {"steps": [{"type": "launch", "argv": [
        "xterm", "-T", "viewer", "-geometry", "60x10+400+300", "-hold", "-e", "cat", "notes.txt"]}]})
    wait_window(vm, "viewer")
    time.sleep(0.5)
    wx, wy, _, _ = geometry(vm, "viewer")
    # xterm's default font is 6x13 pixels after a 2-pixel border: row 0 is y in [wy+2, wy+15),
    # column c is x in [wx+2+6c, wx+8+6c). Press in column 0, release early in column 7.
    act(vm, type="drag", x=wx + 3, y=wy + 8, x2=wx + 2 + 6 * 7 + 1, y2=wy + 8)
    primary = wait_for(lambda: x11(vm, "xclip", "-o", "-selection", "primary"), "a selection")
    assert primary == "Welcome"


def test_scroll_moves_the_view(vm):
    lines = "".join(f"line {i}\n" for i in range(1, 501))
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "long.txt", "content": lines},
                                                 {"type": "open", "path": "long.txt"}]})
    assert r.status_code == 200, r.text
    wait_window(vm, "long.txt - Mousepad")
    time.sleep(0.8)
    x, y, w, h = geometry(vm, "long.txt - Mousepad")
    box = (x + 40, y + 80, x + w - 40, y + h - 40)  # inside the text view
    top = shot(vm).crop(box)
    act(vm, type="scroll", x=x + w // 2, y=y + h // 2, direction="down", amount=10)
    time.sleep(0.5)
    assert changed(top, shot(vm).crop(box)) > 0.01
    act(vm, type="scroll", direction="up", amount=10)  # no point: scrolls where the mouse is
    time.sleep(0.5)
    assert changed(top, shot(vm).crop(box)) < 0.003  # back at the top (the caret may blink)


def test_wait_done_fail_execute_nothing(vm):
    act(vm, type="move", x=500, y=500)
    t = time.time()
    act(vm, type="wait", amount=1)
    assert time.time() - t >= 1.0
    act(vm, type="done")
    act(vm, type="fail")
    assert mouse(vm) == (500, 500) and windows(vm) == []


# ------------------------------------------------------------------------------------------------
# reset, setup, evaluate

def test_reset_restores_files_windows_and_mouse(vm):
    steps = [{"type": "launch", "argv": ["xclock"]}, {"type": "open", "path": "Documents"},
             {"type": "write_file", "path": "junk/new.txt", "content": "x"},
             {"type": "command", "argv": ["mv", "notes.txt", "moved.txt"]}]
    assert vm_call(vm, "POST", "/setup", {"steps": steps}).status_code == 200
    wait_for(lambda: {"xclock", "Documents"} <= set(windows(vm)), "the launched windows")
    os.chmod(os.path.join(vm.home, "junk"), 0o500)  # a read-only folder must not stop the restore
    act(vm, type="move", x=5, y=5)
    reset(vm)
    assert windows(vm) == []
    assert open(os.path.join(vm.home, "notes.txt")).read().startswith("Welcome")
    assert not os.path.exists(os.path.join(vm.home, "junk"))
    assert not os.path.exists(os.path.join(vm.home, "moved.txt"))
    assert mouse(vm) == (640, 360)
    assert not is_bg(shot(vm), (66, 38, 82, 54))  # the icons are back


def home_snapshot(path: str) -> dict:
    """Every entry below `path` -> (mode, size, mtime in ns, sha256 of a file / target of a link)."""
    out = {}
    for d, dirs, files in os.walk(path):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            what = os.readlink(p) if os.path.islink(p) else (
                hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.isfile(p) else "")
            out[os.path.relpath(p, path)] = (st.st_mode, st.st_size if not os.path.isdir(p) else 0,
                                             st.st_mtime_ns, what)
    return out


def without_clock(img: Image.Image) -> Image.Image:
    """The screen with tint2's clock and date blanked: a minute may turn between two screenshots."""
    img = img.copy()
    img.paste((0, 0, 0), (img.width - 160, img.height - 34, img.width, img.height))
    return img


def test_a_window_mapped_once_openbox_answers_is_managed(tmp_path, monkeypatch):
    """openbox publishes its EWMH properties (what _wm_ready checks) before its event loop runs, and
    drops what reaches it in between: a window mapped right after _wm_ready is never managed (so
    tint2's and pcmanfm's windows, now and then, and a reset waited 30 s for icons that never came).
    On a bare Xvfb, ten openbox starts: a window mapped the moment _wm_listening returns is managed
    every time. (Mapped right after _wm_ready instead, it was lost in 60 of 60 starts here.)"""
    from Xlib import X, display
    from vm import desktop as D
    auth = str(tmp_path / "xauth")
    D.write_xauthority(auth)
    monkeypatch.setenv("XAUTHORITY", auth)
    # Not D.start_xvfb: that takes the lowest free display, :0 on this host, and a sandboxed
    # desktop's clients (the host's /tmp, the sandbox's network) would find its socket first.
    n = next(i for i in range(400, 1000) if not os.path.exists(f"/tmp/.X{i}-lock"))
    name = f":{n}"
    # -displayfd: Xvfb writes its number once it takes connections. Its socket file comes earlier: a
    # connection made then was refused, and the SIGTERM that followed left its lock and socket behind.
    r, w = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", name, "-displayfd", str(w), "-screen", "0", "320x200x24", "-nolisten", "tcp",
                             "-auth", auth], pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    try:
        D._wait(lambda: select.select([r], [], [], 0)[0], "Xvfb", timeout=20)
        os.close(r)
        x = display.Display(name)
        root, fresh = x.screen().root, D.root_properties(name)
        for _ in range(10):
            wm = subprocess.Popen(["openbox"], env={**os.environ, "DISPLAY": name, "HOME": str(tmp_path)},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            D._wait(lambda: D._wm_ready(x), "openbox")
            D._wm_listening(x)
            w = root.create_window(0, 0, 50, 50, 0, X.CopyFromParent)
            w.map()
            x.sync()
            clients = lambda: root.get_full_property(x.intern_atom("_NET_CLIENT_LIST"), X.AnyPropertyType)
            D._wait(lambda: clients() is not None and w.id in clients().value, "the window managed", timeout=5)
            w.destroy()
            wm.kill()
            wm.wait()
            D._wait(lambda: D._wm_gone(x), "openbox's exit")
            D.restore_root(name, fresh)  # as a reset does: a new openbox finds no stale EWMH properties
    finally:
        xvfb.terminate()  # not kill: Xvfb removes its socket and lock file on the way out
        xvfb.wait()


def test_reset_is_a_fresh_desktop():
    """After an episode that opened apps, moved and selected icons, switched the workspace, set a
    root window property (X resources), and wrote, deleted, chmod-ed, linked and back-dated files,
    /reset gives the desktop of a fresh server: the same pixels (the clock aside), HOME equal to
    the template byte for byte (modes and mtimes too), the root window's properties gone."""
    vm = start_vm_server()
    try:
        template = os.path.join(os.path.dirname(vm.home), "template")
        fresh, fresh_home = shot(vm), home_snapshot(vm.home)
        assert fresh_home == home_snapshot(template)
        term, clock, xcalc = ICONS["Terminal"], ICONS["Clock"], ICONS["XCalc"]
        act(vm, type="double_click", x=term[0], y=term[1])
        wait_for(lambda: any("xterm" in w for w in windows(vm)), "the terminal")
        vm_call(vm, "POST", "/action?settle=watch", {"type": "type", "text": (
            "cd; echo x > new.txt; mkdir -p d/e; rm Documents/todo.txt; chmod 000 Pictures; chmod 600 notes.txt; "
            "touch -d 2001-01-01 Documents/report.txt; ln -s /etc etc; ln notes.txt hard.txt; "
            "printf more >> Documents/budget.csv; "
            "xprop -root -f RESOURCE_MANAGER 8s -set RESOURCE_MANAGER 'XTerm*background: red'\n")})
        wait_for(lambda: "red" in x11(vm, "xprop", "-root", "RESOURCE_MANAGER"), "the command line to run")
        assert os.stat(os.path.join(vm.home, "Documents/report.txt")).st_mtime < 1e9
        assert os.path.islink(os.path.join(vm.home, "etc")) and os.stat(os.path.join(vm.home, "notes.txt")).st_nlink == 2
        act(vm, type="double_click", x=ICONS["Text Editor"][0], y=ICONS["Text Editor"][1])
        wait_for(lambda: any("Mousepad" in w for w in windows(vm)), "the editor")
        act(vm, type="type", text="unsaved words")
        act(vm, type="drag", x=clock[0], y=clock[1], x2=700, y2=400)  # an icon moved (and saved in HOME)
        act(vm, type="click", x=xcalc[0], y=xcalc[1])                  # an icon selected
        act(vm, type="key", keys=["ctrl", "alt", "right"])             # openbox: the next workspace
        assert x11(vm, "xprop", "-root", "_NET_CURRENT_DESKTOP").strip().endswith("= 1")
        assert changed(fresh, shot(vm)) > 0.001
        os.chmod(vm.home, 0)  # and HOME locked (chmod 000 ~)
        for _ in range(2):  # a reset, and a reset of a reset desktop
            r = vm_call(vm, "POST", "/reset")
            assert r.status_code == 200 and set(r.json()["seconds"]) == {"kill", "home", "root", "session", "mouse"}
            after = shot(vm)
            assert ImageChops.difference(without_clock(fresh), without_clock(after)).getbbox() is None
            assert home_snapshot(vm.home) == fresh_home
            assert "RESOURCE_MANAGER:  not found" in x11(vm, "xprop", "-root", "RESOURCE_MANAGER")
            assert x11(vm, "xprop", "-root", "_NET_CURRENT_DESKTOP").strip().endswith("= 0")
            assert windows(vm) == [] and mouse(vm) == (640, 360)
    finally:
        vm.stop()


def test_setup_steps(vm):
    steps = [{"type": "write_file", "path": "~/a/b/ü.txt", "content": "grüße\n"},
             {"type": "open", "path": "Documents/todo.txt"}, {"type": "open", "path": "Documents"},
             {"type": "launch", "argv": ["xeyes"]}, {"type": "sleep", "seconds": 0.5},
             {"type": "command", "argv": ["cat", "a/b/ü.txt"]},
             {"type": "command", "argv": ["sleep", "60"], "timeout": 0.3}]
    t = time.time()
    r = vm_call(vm, "POST", "/setup", {"steps": steps})
    assert r.status_code == 200, r.text
    # the sleep step and the timed-out command each took their time; the command was killed at its
    # 0.3 s timeout, not run to its 60 s
    assert 0.8 <= time.time() - t < 30
    res = r.json()["results"]
    assert [s["type"] for s in res] == [s["type"] for s in steps]
    assert res[0]["bytes"] == len("grüße\n".encode())
    assert open(os.path.join(vm.home, "a/b/ü.txt"), encoding="utf-8").read() == "grüße\n"
    assert res[5] == {"type": "command", "exit_code": 0, "stdout": "grüße\n"}
    assert res[6]["exit_code"] is None  # timed out
    wait_for(lambda: {"todo.txt - Mousepad", "Documents", "xeyes"} <= set(windows(vm)), "the opened windows")


def test_health_answers_while_a_long_setup_runs(vm):
    import threading
    slow = threading.Thread(target=vm_call, args=(vm, "POST", "/setup", {"steps": [{"type": "sleep", "seconds": 5}]}))
    slow.start()
    time.sleep(0.3)
    assert vm_call(vm, "GET", "/health").json()["ok"] is True
    assert slow.is_alive()  # /health answered while the setup still slept: not queued behind it
    slow.join()


def test_setup_is_all_or_nothing(vm):
    steps = [{"type": "write_file", "path": "first.txt", "content": "x"},
             {"type": "launch", "argv": ["rm", "-rf", "/"]}]
    r = vm_call(vm, "POST", "/setup", {"steps": steps})
    assert r.status_code == 400 and "not allowed" in r.json()["error"]
    assert not os.path.exists(os.path.join(vm.home, "first.txt"))


def test_evaluate_every_check_type(vm):
    vm_call(vm, "POST", "/setup", {"steps": [{"type": "launch", "argv": ["xclock"]}]})
    wait_window(vm, "xclock")
    passing = [{"type": "file_exists", "path": "notes.txt"},
               {"type": "file_exists", "path": "~/nope.txt", "exists": False},
               {"type": "file_contains", "path": "Documents/todo.txt", "text": "buy milk"},
               {"type": "file_contains", "path": os.path.join(vm.home, "notes.txt"), "regex": r"^Welcome\b"},
               {"type": "window_exists", "title": "^xclock$"},
               {"type": "window_exists", "title": "Mousepad", "exists": False},
               {"type": "command", "argv": ["wc", "-l", "Documents/todo.txt"], "stdout": "3"},
               {"type": "command", "argv": ["grep", "-c", "rent", "Documents/budget.csv"], "regex": r"^1$"},
               {"type": "command", "argv": ["test", "-d", "Documents"]},
               {"type": "command", "argv": ["false"], "exit_code": 1}]
    failing = [{"type": "file_exists", "path": "nope.txt"},
               {"type": "file_exists", "path": "notes.txt", "exists": False},
               {"type": "file_contains", "path": "notes.txt", "text": "not in there"},
               {"type": "file_contains", "path": "missing.txt", "text": "x"},
               {"type": "window_exists", "title": "Mousepad"},
               {"type": "window_exists", "title": "xclock", "exists": False},
               {"type": "command", "argv": ["cat", "notes.txt"], "stdout": "absent"},
               {"type": "command", "argv": ["false"]},
               {"type": "command", "argv": ["sleep", "5"], "timeout": 0.2}]
    for check in passing + failing:
        r = vm_call(vm, "POST", "/evaluate", {"conj": "and", "checks": [check]})
        assert r.status_code == 200, (check, r.text)
        d = r.json()
        assert d["score"] == float(check in passing), (check, d)
        assert d["details"][0]["passed"] == (check in passing) and d["details"][0]["type"] == check["type"]
    mixed = [passing[0], failing[0]]
    assert vm_call(vm, "POST", "/evaluate", {"conj": "and", "checks": mixed}).json()["score"] == 0.0
    assert vm_call(vm, "POST", "/evaluate", {"conj": "or", "checks": mixed}).json()["score"] == 1.0
    assert vm_call(vm, "POST", "/evaluate", {"conj": "or", "checks": failing[:2]}).json()["score"] == 0.0
    assert vm_call(vm, "POST", "/evaluate", {"checks": passing}).json()["score"] == 1.0  # "and" by default


def test_windows_lists_app_windows_with_ids(vm):
    assert vm_call(vm, "GET", "/windows").json() == {"windows": []}  # icons and taskbar are not listed
    vm_call(vm, "POST", "/setup", {"steps": [{"type": "launch", "argv": ["xclock"]},
                                             {"type": "launch", "argv": ["xeyes"]}]})
    wait_for(lambda: {"xclock", "xeyes"} <= set(windows(vm)), "xclock and xeyes")
    got = vm_call(vm, "GET", "/windows").json()["windows"]
    assert sorted(w["title"] for w in got) == ["xclock", "xeyes"]
    # each with its WM_CLASS, "instance.Class": what names the program when a title does not
    assert sorted((w["title"], w["class"]) for w in got) == [("xclock", "xclock.XClock"), ("xeyes", "xeyes.XEyes")]
    assert all(set(w) == {"id", "title", "class"} for w in got)
    ids = [w["id"] for w in got]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == 2
    # the ids are the X server's: the same ones xdotool finds by title
    assert any(int(x) in ids for x in x11(vm, "xdotool", "search", "--name", "^xclock$").split())
    assert vm_call(vm, "POST", "/windows").status_code == 405
    reset(vm)
    assert vm_call(vm, "GET", "/windows").json() == {"windows": []}


def test_a_pathological_regex_fails_its_check_instead_of_freezing_the_server(vm):
    # (a+)+$ against "aaaa...b" backtracks 2^n ways in Python's re: at n=40 that is days. Window
    # titles are short ("xclock"), so for them a pattern with many nested .* does the same.
    vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "evil.txt", "content": "a" * 40 + "b"},
                                             {"type": "launch", "argv": ["xclock"]}]})
    wait_window(vm, "xclock")
    evil = r"(a+)+$"
    for check in [{"type": "file_contains", "path": "evil.txt", "regex": evil},
                  {"type": "window_exists", "title": "(" + ".*" * 13 + ")*z"},
                  {"type": "command", "argv": ["cat", "evil.txt"], "regex": evil}]:
        t = time.time()
        d = vm_call(vm, "POST", "/evaluate", {"checks": [check]}).json()
        assert time.time() - t < 60, check  # REGEX_SECONDS is 2; the regex alone would run for days
        assert d["score"] == 0.0 and "regex did not finish within 2 s" in d["details"][0]["info"], d
    # ...and the server goes on: the same checks with a sane regex pass, and /health answers
    sane = [{"type": "file_contains", "path": "evil.txt", "regex": r"a{40}b"},
            {"type": "window_exists", "title": "^xclock$"},
            {"type": "command", "argv": ["cat", "evil.txt"], "regex": r"b$"}]
    assert vm_call(vm, "POST", "/evaluate", {"checks": sane}).json()["score"] == 1.0
    assert vm_call(vm, "GET", "/health").json()["ok"] is True


# ------------------------------------------------------------------------------------------------
# auth and validation

def test_auth_required_and_nothing_executed(vm):
    act(vm, type="move", x=100, y=100)
    for token in (None, "wrong-token", vm.token + "x"):
        for method, path, body in [("GET", "/health", None), ("GET", "/screenshot", None), ("GET", "/windows", None),
                                   ("POST", "/action", {"type": "move", "x": 900, "y": 600}),
                                   ("POST", "/setup", {"steps": [{"type": "write_file", "path": "pwned.txt", "content": ""}]}),
                                   ("POST", "/reset", None),
                                   ("POST", "/evaluate", {"checks": [{"type": "file_exists", "path": "x"}]})]:
            r = vm_call(vm, method, path, body, token=token)
            assert r.status_code == 401 and "token" in r.json()["error"], (token, path)
    assert mouse(vm) == (100, 100)
    assert not os.path.exists(os.path.join(vm.home, "pwned.txt"))


def test_bad_inputs_get_4xx_and_server_survives(vm):
    os.symlink("/etc", os.path.join(vm.home, "etc_link"))
    bad = [("/action", {"type": "click", "x": 1280, "y": 5}), ("/action", {"type": "click", "x": -1, "y": 5}),
           ("/action", {"type": "click", "x": True, "y": 5}), ("/action", {"type": "click", "x": 5.0, "y": 5}),
           ("/action", {"type": "click", "x": "5", "y": 5}), ("/action", {"type": "click", "x": 5}),
           ("/action", {"type": "move"}), ("/action", {"type": "drag", "x": 1, "y": 1, "x2": 1}),
           ("/action", {"type": "type", "text": "x" * 2001}), ("/action", {"type": "type", "text": ""}),
           ("/action", {"type": "key", "keys": ["ctrl", "nokey"]}), ("/action", {"type": "key", "keys": "ctrl"}),
           ("/action", {"type": "key", "keys": ["a"] * 9}), ("/action", {"type": "scroll", "direction": "in"}),
           ("/action", {"type": "scroll", "direction": "up", "amount": 0}),
           ("/action", {"type": "wait", "amount": 60}), ("/action", {"type": "click", "button": "middle"}),
           ("/action", {"type": "rm -rf"}), ("/action", [1, 2]), ("/action", None),
           ("/setup", {"steps": []}), ("/setup", {"steps": [{"type": "eval", "code": "1"}]}),
           ("/setup", {"steps": [{"type": "launch", "argv": ["/usr/bin/xclock"]}]}),
           ("/setup", {"steps": [{"type": "command", "argv": "ls -la"}]}),
           ("/setup", {"steps": [{"type": "write_file", "path": "/etc/passwd", "content": ""}]}),
           ("/setup", {"steps": [{"type": "write_file", "path": "../escape.txt", "content": ""}]}),
           ("/setup", {"steps": [{"type": "write_file", "path": "etc_link/x", "content": ""}]}),
           ("/setup", {"steps": [{"type": "open", "path": "photo.png"}]}),
           ("/setup", {"steps": [{"type": "sleep", "seconds": 31}]}),
           ("/evaluate", {"checks": []}), ("/evaluate", {"conj": "xor", "checks": [{"type": "file_exists", "path": "a"}]}),
           ("/evaluate", {"checks": [{"type": "file_contains", "path": "notes.txt"}]}),
           ("/evaluate", {"checks": [{"type": "file_contains", "path": "notes.txt", "regex": "("}]}),
           ("/evaluate", {"checks": [{"type": "file_exists", "path": "/etc/passwd"}]}),
           ("/evaluate", {"checks": [{"type": "command", "argv": ["rm", "x"]}]}),
           ("/nope", {})]
    for path, body in bad:
        r = vm_call(vm, "POST", path, body)
        assert 400 <= r.status_code < 500 and r.json()["error"].endswith("."), (path, body, r.text)
    raw = [b"{not json", b'{"type": "move", "x": NaN, "y": 1}', b"[" * 100000 + b"]" * 100000]
    for data in raw:
        r = requests.post(vm.url + "/action", data=data, headers={"Authorization": f"Bearer {vm.token}"})
        assert r.status_code == 400, (data[:40], r.text)
    r = requests.post(vm.url + "/setup", data=b"x" * (2 << 20), headers={"Authorization": f"Bearer {vm.token}"})
    assert r.status_code == 413
    assert vm_call(vm, "GET", "/action").status_code == 405
    assert vm_call(vm, "GET", "/screenshot?format=gif").status_code == 400
    assert vm_call(vm, "GET", "/screenshot?format=jpeg&quality=500").status_code == 400
    # still healthy, and still acting
    assert vm_call(vm, "GET", "/health").json()["ok"] is True
    act(vm, type="move", x=1279, y=719)  # a corner is a legitimate target (FAILSAFE is off)
    assert mouse(vm) == (1279, 719) and vm.proc.poll() is None


def test_non_loopback_without_token_is_refused():
    env = {k: v for k, v in os.environ.items() if k != "VM_TOKEN"}
    r = subprocess.run([sys.executable, SERVER, "--host", "0.0.0.0", "--xvfb"], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "without a token" in r.stderr and r.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------------------
# process lifetime, isolation, and the mode for your own VM

def test_parallel_desktops_are_isolated_and_stop_cleanly(vm):
    other = start_vm_server()
    try:
        # A display of its own: both may be :0, each in the network namespace of its sandbox.
        assert other.home != vm.home and os.readlink(netns_of(other)) != os.readlink(netns_of(vm))
        # Single-instance apps (pcmanfm, mousepad) must open on the desktop that asked.
        vm_call(vm, "POST", "/setup", {"steps": [{"type": "open", "path": "notes.txt"}, {"type": "open", "path": "Pictures"}]})
        wait_for(lambda: {"notes.txt - Mousepad", "Pictures"} <= set(windows(vm)), "the first desktop's windows")
        r = vm_call(other, "POST", "/setup", {"steps": [{"type": "write_file", "path": "mine.txt", "content": "1"},
                                                        {"type": "open", "path": "mine.txt"},
                                                        {"type": "open", "path": "Documents"},
                                                        {"type": "launch", "argv": ["xclock"]}]})
        assert r.status_code == 200
        assert os.path.exists(os.path.join(other.home, "mine.txt"))
        assert not os.path.exists(os.path.join(vm.home, "mine.txt"))
        wait_for(lambda: {"xclock", "mine.txt - Mousepad", "Documents"} <= set(windows(other)), "the second desktop's windows")
        assert set(windows(vm)) == {"notes.txt - Mousepad", "Pictures"}
        kids = proc_descendants(other.proc.pid)
        assert len(kids) >= 5  # (bubblewrap,) Xvfb, openbox, tint2, pcmanfm, xclock
    finally:
        other.stop(signal.SIGTERM)
    wait_for(lambda: all(not proc_alive(p) for p in kids), "every process of the stopped server to exit")
    assert not os.path.exists(os.path.dirname(other.home))  # its temp HOME is removed too
    # Even `kill -9` leaves no orphan display: Xvfb has a parent-death signal, its clients follow.
    third = start_vm_server()
    kids = proc_descendants(third.proc.pid)
    third.stop(signal.SIGKILL)
    wait_for(lambda: all(not proc_alive(p) for p in kids), "the desktop of a killed server to exit")
    shutil.rmtree(os.path.dirname(third.home), ignore_errors=True)


def test_inside_your_own_vm_mode(vm, tmp_path):
    """Without --xvfb the server drives the existing DISPLAY and the real HOME, and /reset closes
    only what it launched (here the shared test desktop plays the VM's display)."""
    env = {**os.environ, "HOME": str(tmp_path)}
    own = start_vm_server(xvfb=False, env=env, timeout=30, display_of=vm)
    try:
        assert vm_call(own, "GET", "/health").json()["screen"] == [1280, 720]
        assert own.home == str(tmp_path)
        r = vm_call(own, "POST", "/setup", {"steps": [{"type": "write_file", "path": "kept.txt", "content": "k"},
                                                      {"type": "launch", "argv": ["xeyes"]}]})
        assert r.status_code == 200
        wait_window(vm, "xeyes")
        act(own, type="move", x=10, y=20)
        assert mouse(vm) == (10, 20)
        reset(own)
        wait_for(lambda: "xeyes" not in windows(vm), "reset to close the app it launched")
        assert (tmp_path / "kept.txt").read_text() == "k"  # a real HOME is never wiped
        assert mouse(vm) == (640, 360)
    finally:
        own.stop()


def test_reset_stress_bench_end_to_end():
    """bench/reset_stress.py, the smallest budget: one desktop reset in a loop for 3 s, no failure."""
    out = subprocess.run([sys.executable, os.path.join(os.path.dirname(SERVER), "bench", "reset_stress.py"),
                          "--desktops", "1", "--seconds", "3"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n = int(out.stdout.split("resets ")[1].split()[0])
    assert n >= 2 and "failed: 0" in out.stdout and "slow (> 5 s): 0" in out.stdout
