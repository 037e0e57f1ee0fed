"""desktop.py: the local desktop that `python vm_server.py --xvfb` serves.

One Xvfb display per server, with a real session on it: openbox (window manager), tint2 (taskbar)
and pcmanfm (desktop icons pinned to a fixed grid), and a HOME of its own, copied from a fresh
template before every episode. N servers are N independent desktops on one machine, standing in
for N VMs. Top to bottom: the icon layout (`desktop_icons`, `DESKTOP_APPS`), the HOME template
(`template_files`), `start_xvfb`, `start_session`, `restore_home`, and `local_desktop`, which
puts them together.

Only vm_server.py imports this file, lazily, when `--xvfb` is given: without `--xvfb`, vm_server.py
stays ONE file you copy into your own VM. vm_server.py re-exports the public names here
(`from vm_server import desktop_icons` works). The process-tree cleanup (`kill_tree`, `reap`) stays
in vm_server.py, because a real VM's /reset and the server's exit need it too.
Tested through `python -m pytest -q tests/test_vm_server.py` (real Xvfb desktops).

Where this departs from the papers' environment (OSWorld: one Ubuntu VM per episode, restored
from a snapshot): a local Xvfb desktop per server, reset by restarting its session and copying its
HOME back from the template, instead of restoring a VM. The icon layout is pinned (not pcmanfm's
auto-layout, which sorts by file time), so every desktop looks the same.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from PIL import ImageGrab

# vm_server registers itself under this name before importing us, even when it runs as a script.
from vm_server import Desktop, _prctl, list_windows, spawn

# -------------------------------------------------------------------------------------------------
# The icons and the HOME template

# (file stem, label under the icon, command (allow-listed), icon name from the installed themes)
DESKTOP_APPS = [
    ("terminal", "Terminal", "xterm", "utilities-terminal"),
    ("editor", "Text Editor", "mousepad", "accessories-text-editor"),
    ("calculator", "Calculator", "galculator", "accessories-calculator"),
    ("files", "File Manager", "pcmanfm", "system-file-manager"),
    ("clock", "Clock", "xclock", "clock"),
    ("eyes", "Eyes", "xeyes", "face-glasses"),
    ("xcalc", "XCalc", "xcalc", "applications-science"),
]
ICON_ORIGIN, ICON_PITCH, ICON_ROWS = (16, 16), (120, 100), 4
ICON_CENTRE = (58, 30)   # from a cell's top-left to its icon's centre, measured on pcmanfm 1.3.2
BG_COLOUR = "#2f5f8f"
# The file types the tasks' files have (.txt, .csv, .log, .md, .py, .sh, no extension), all opened
# in the text editor by a double-click in the file manager.
TEXT_MIME_TYPES = ("text/plain", "text/csv", "text/markdown", "text/x-log", "text/x-python",
                   "text/x-python3", "application/x-shellscript", "text/x-shellscript",
                   "application/x-zerosize", "application/octet-stream")


def _cell(i: int) -> tuple[int, int]:
    """Top-left of desktop cell i: column-major, ICON_ROWS rows, fixed pitch."""
    return ICON_ORIGIN[0] + ICON_PITCH[0] * (i // ICON_ROWS), ICON_ORIGIN[1] + ICON_PITCH[1] * (i % ICON_ROWS)


def desktop_icons(screen: tuple[int, int] = (1280, 720)) -> dict[str, tuple[int, int]]:
    """Label -> (x, y): the screen pixel to double-click to open that app on an --xvfb desktop.

    pcmanfm draws its desktop icons where the template's desktop-items-0.conf pins them, so the
    layout is identical on every start and every screen of at least 640x480: Terminal (74, 46),
    Text Editor (74, 146), Calculator (74, 246), File Manager (74, 346), Clock (194, 46),
    Eyes (194, 146), XCalc (194, 246). (pcmanfm's own auto-layout sorts by file time, which is
    not stable; a Tk desktop would be stable but would not look like a desktop a person knows.)
    """
    if screen[0] < 640 or screen[1] < 480:
        raise ValueError(f"the desktop needs a screen of at least 640x480, got {screen}.")
    return {app[1]: (_cell(i)[0] + ICON_CENTRE[0], _cell(i)[1] + ICON_CENTRE[1])
            for i, app in enumerate(DESKTOP_APPS)}


def template_files() -> dict[str, str]:
    """Relative path -> content of a fresh HOME. The config files make every app start clean: no
    first-run dialogs, no session restore, predictable window titles ("notes.txt - Mousepad")."""
    items = ["[*]", "wallpaper_mode=color", "wallpaper_common=1", f"desktop_bg={BG_COLOUR}",
             "desktop_fg=#ffffff", "desktop_shadow=#000000", "desktop_font=Sans 11", "show_wm_menu=0",
             "sort=name;ascending;", "show_documents=0", "show_trash=0", "show_mounts=0", ""]
    files = {}
    for i, (stem, label, cmd, icon) in enumerate(DESKTOP_APPS):
        files[f"Desktop/{stem}.desktop"] = (f"[Desktop Entry]\nType=Application\nName={label}\n"
                                            f"Exec={cmd}\nIcon={icon}\nTerminal=false\n")
        items += [f"[{stem}.desktop]", f"x={_cell(i)[0]}", f"y={_cell(i)[1]}", ""]
    files[".config/pcmanfm/default/desktop-items-0.conf"] = "\n".join(items)
    # quick_exec: a double-click launches a .desktop file instead of asking "Execute File?".
    files[".config/libfm/libfm.conf"] = "[config]\nquick_exec=1\n"
    # Default applications, stated here rather than left to the host: without them pcmanfm asks
    # "Choose Application" for a text file on any machine whose desktop database (mimeinfo.cache,
    # written by desktop-file-utils) happens not to list mousepad. GIO takes the first entry of each
    # list that is installed; mousepad's file is org.xfce.mousepad.desktop from 0.5 on.
    text = "org.xfce.mousepad.desktop;mousepad.desktop;"
    files[".config/mimeapps.list"] = "[Default Applications]\n" + "".join(
        f"{mime}={text}\n" for mime in TEXT_MIME_TYPES) + "inode/directory=pcmanfm.desktop;\n"
    # mousepad keeps its settings in GSettings; with GSETTINGS_BACKEND=keyfile they live here.
    files[".config/glib-2.0/settings/keyfile"] = (
        "[org/xfce/mousepad/preferences/window]\npath-in-title=false\n\n"
        "[org/xfce/mousepad/preferences/file]\nsession-restore='never'\n")
    files["notes.txt"] = "Welcome to this desktop.\nThese notes are yours to edit.\n"
    files["Documents/todo.txt"] = "buy milk\nwrite report\ncall Alice\n"
    files["Documents/report.txt"] = "Quarterly report\n\nSales grew 12% over the last quarter.\n"
    files["Documents/budget.csv"] = "item,cost\nrent,1200\nfood,300\ntravel,150\n"
    files["Downloads/.keep"] = files["Pictures/.keep"] = ""
    return files


# -------------------------------------------------------------------------------------------------
# Processes: the X server and the session on it


def start_xvfb(screen: tuple[int, int]) -> tuple[subprocess.Popen, str]:
    """Xvfb on a free display. -displayfd makes Xvfb choose the number and write it to us when it
    is ready, which stays race free when many servers start at once (probing locks would not)."""
    r, w = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(w), "-screen", "0", f"{screen[0]}x{screen[1]}x24", "-nolisten",
         "tcp", "-noreset"], pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # PR_SET_PDEATHSIG (1): the kernel SIGTERMs Xvfb when our main thread ends, so even a
        # `kill -9` of the server leaves no orphan display (its clients then die with it).
        preexec_fn=lambda: _prctl(1, signal.SIGTERM))
    os.close(w)
    num, deadline = b"", time.time() + 20
    while not num.endswith(b"\n") and time.time() < deadline and proc.poll() is None:
        if select.select([r], [], [], 0.2)[0]:
            num += os.read(r, 16) or b"\n"
    os.close(r)
    if not num.strip().isdigit():
        proc.kill()
        sys.exit("vm_server: Xvfb did not start; install the desktop packages with `bash setup.sh`.")
    return proc, ":" + num.decode().strip()


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.1)


def start_session(desk: Desktop) -> None:
    """Window manager, then taskbar and desktop icons; returns once the icons are drawn."""
    spawn(desk, ["openbox"])
    _wait(lambda: subprocess.run(["wmctrl", "-m"], env=desk.env, capture_output=True).returncode == 0, "openbox")
    spawn(desk, ["tint2"])
    spawn(desk, ["pcmanfm", "--desktop"])
    x, y = desktop_icons(desk.screen)["Terminal"]

    def drawn():  # both sticky windows are up and the first icon's pixel is no longer background
        titles = [t for _, ws, t in list_windows(desk) if ws == -1]
        px = ImageGrab.grab(bbox=(x, y, x + 1, y + 1)).getpixel((0, 0))
        return {"pcmanfm", "tint2"} <= set(titles) and "#%02x%02x%02x" % px[:3] != BG_COLOUR
    _wait(drawn, "the desktop icons")


# -------------------------------------------------------------------------------------------------
# HOME, and the whole desktop


def restore_home(desk: Desktop) -> None:
    def force(func, path, _exc):  # a task may have made something read-only: open it up, retry
        os.chmod(os.path.dirname(path), 0o755)
        if os.path.isdir(path):
            os.chmod(path, 0o755)
        func(path)
    if os.path.exists(desk.home):
        shutil.rmtree(desk.home, onerror=force)
    shutil.copytree(os.path.join(desk.tmp, "template"), desk.home, symlinks=True)


def local_desktop(screen: tuple[int, int], allow: frozenset) -> Desktop:
    """--xvfb: a display, a HOME copied from a fresh template, and a session on it."""
    missing = [p for p in ("Xvfb", "openbox", "tint2", "pcmanfm", "wmctrl", "mousepad") if not shutil.which(p)]
    if missing:
        sys.exit(f"vm_server: {', '.join(missing)} not installed; install the desktop with `bash setup.sh`.")
    tmp = tempfile.mkdtemp(prefix="vm_server-")
    for rel, text in template_files().items():
        os.makedirs(os.path.dirname(os.path.join(tmp, "template", rel)), exist_ok=True)
        with open(os.path.join(tmp, "template", rel), "w") as f:
            f.write(text)
    os.makedirs(os.path.join(tmp, "run"), mode=0o700)
    xvfb, display = start_xvfb(screen)
    home = os.path.join(tmp, "home")
    # Our own HOME and XDG dirs, and no session bus: parallel desktops must never share files,
    # settings, or single-instance apps (a second mousepad would open in the first one's window).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "DBUS_", "GTK_"))}
    env.update(DISPLAY=display, HOME=home, XDG_CONFIG_HOME=f"{home}/.config",
               XDG_DATA_HOME=f"{home}/.local/share", XDG_CACHE_HOME=f"{home}/.cache",
               XDG_RUNTIME_DIR=os.path.join(tmp, "run"), GSETTINGS_BACKEND="keyfile",
               NO_AT_BRIDGE="1", GTK_OVERLAY_SCROLLING="0", LANG="C.UTF-8", LC_ALL="C.UTF-8")
    os.environ["DISPLAY"] = display  # for pyautogui and ImageGrab in this process
    desk = Desktop(screen, home, env, allow, xvfb, tmp, display)
    restore_home(desk)
    start_session(desk)
    return desk
