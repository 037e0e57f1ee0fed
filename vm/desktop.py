"""vm/desktop.py: the local desktop that `python vm_server.py --xvfb` serves.

One Xvfb display per server, with a real session on it: openbox (window manager), tint2 (taskbar)
and pcmanfm (desktop icons pinned to a fixed grid), and a HOME of its own, copied from a fresh
template before every episode. N servers are N independent desktops on one machine, standing in
for N VMs. Top to bottom: the icon layout (`desktop_icons`, `DESKTOP_APPS`), the HOME template
(`template_files`), `start_xvfb` and its cookie, `start_session` (up and settled, read off X
properties; openbox and tint2 configured so that no click or key ends the session: `openbox_config`,
`tint2_config`), `restore_home`, `reset_desktop` (POST /reset: a fresh desktop again), and
`local_desktop`, which puts them together. vm/sandbox.py runs all of it inside bubblewrap.

vm_server.py imports this file (and vm/sandbox.py) lazily, only when `--xvfb` is given, so a VM serving its own display
runs without it. The programs and windows on a desktop, and the process-tree cleanup (`spawn`,
`list_windows`, `kill_tree`, `reap`), are in vm/procs.py, because a real VM's /reset and the server's
exit need them too.
Tested through `python -m pytest -q tests/test_vm_server.py tests/test_sandbox.py tests/test_containment.py`
(real Xvfb desktops; the last types an agent's attacks into a desktop's terminal).

Where this departs from the papers' environment (OSWorld: one Ubuntu VM per episode, restored
from a snapshot): a local Xvfb desktop per server, reset by restarting its session, syncing its
HOME back to the template and its root window's properties back to the fresh X server's, instead
of restoring a VM. The icon layout is pinned (not pcmanfm's
auto-layout, which sorts by file time), so every desktop looks the same. A VM is its own sandbox;
a local desktop gets bubblewrap instead, because an exploring agent types anything into its
terminal, and without one that terminal is a shell on the trainer's machine.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from PIL import ImageGrab

from vm.procs import DesktopState, descendants, kill_tree, prctl, reap, spawn
from vm.settle import watcher

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
# What of the caller's environment the desktop's apps (and vm/sandbox.py's bubblewrap) get: no
# credentials, keys or tokens a caller happened to export (the agent's terminal can print its environment).
ENV_KEEP = frozenset({"PATH", "HOME", "SHELL", "TERM", "TZ", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE",
                      "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONDONTWRITEBYTECODE",
                      "PYTHONUNBUFFERED"})
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


def start_xvfb(screen: tuple[int, int], auth: str) -> tuple[subprocess.Popen, str]:
    """Xvfb on a free display, admitting only clients that show the cookie in the Xauthority file
    `auth`. -displayfd makes Xvfb choose the number and write it to us when it is ready, which
    stays race free when many servers start at once (probing locks would not)."""
    r, w = os.pipe()
    proc = subprocess.Popen(
        ["Xvfb", "-displayfd", str(w), "-screen", "0", f"{screen[0]}x{screen[1]}x24", "-nolisten",
         "tcp", "-noreset", "-auth", auth], pass_fds=(w,), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # PR_SET_PDEATHSIG (1): the kernel SIGTERMs Xvfb when our main thread ends, so even a
        # `kill -9` of the server leaves no orphan display (its clients then die with it).
        preexec_fn=lambda: prctl(1, signal.SIGTERM))
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


def write_xauthority(path: str) -> None:
    """A fresh random MIT-MAGIC-COOKIE-1 in an Xauthority file, libXau's format: per entry a 16-bit
    family, then address, display number, auth name and data, each a 16-bit length and bytes (all
    big-endian). Two entries with the same cookie: FamilyLocal with this host's name (what
    python-xlib, i.e. pyautogui, looks up) and FamilyWild (what libxcb clients also accept); an
    empty display number matches any display, so the file is written before Xvfb picks one."""
    cookie = os.urandom(16)

    def field(b: bytes) -> bytes:
        return struct.pack(">H", len(b)) + b
    data = b"".join(struct.pack(">H", family) + field(address) + field(b"") + field(b"MIT-MAGIC-COOKIE-1")
                    + field(cookie) for family, address in ((256, socket.gethostname().encode()), (0xFFFF, b"")))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _wait(cond, what: str, timeout: float = 30.0, every: float = 0.005) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise RuntimeError(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(every)


_displays: dict = {}
_fresh_root: dict[str, dict] = {}  # display -> its root window's properties before the first session


def _x(name: str):
    """A python-xlib connection to the desktop's display, for the session's checks (kept)."""
    if name not in _displays:
        from Xlib import display
        _displays[name] = display.Display(name)
    return _displays[name]


def _atom(x, name: str) -> int:
    return x.intern_atom(name)


def root_properties(name: str) -> dict:
    """The root window's properties: atom -> (type, format, value)."""
    from Xlib import X
    x = _x(name)
    root = x.screen().root
    out = {}
    for atom in root.list_properties():
        p = root.get_full_property(atom, X.AnyPropertyType)
        if p is not None:
            out[atom] = (p.property_type, p.format, p.value)
    return out


def restore_root(name: str, fresh: dict) -> None:
    """Make the root window's properties what they were on the fresh X server: the session's own
    (a window manager reads _NET_CURRENT_DESKTOP and keeps the workspace an agent switched to) and
    whatever an agent set (`xrdb` writes RESOURCE_MANAGER, which every Xt app reads) go."""
    from Xlib import X
    x = _x(name)
    root = x.screen().root
    now = root_properties(name)
    for atom, (kind, fmt, value) in now.items():
        if atom not in fresh:
            root.delete_property(atom)
    for atom, (kind, fmt, value) in fresh.items():
        if now.get(atom) != (kind, fmt, value):
            root.change_property(atom, kind, fmt, value, X.PropModeReplace)
    x.sync()


def _wm_gone(x) -> bool:
    """The X server has let the last window manager go (ICCCM: it owned the WM_S0 selection). A
    window manager that starts before then finds the screen taken and manages nothing."""
    from Xlib import X
    return x.get_selection_owner(_atom(x, "WM_S0")) == X.NONE


def _wm_ready(x) -> bool:
    """A window manager manages the screen: EWMH's check window names itself (set once the window
    manager has taken the screen's redirect), and the workspaces and work area are published. (tint2
    reads _NET_NUMBER_OF_DESKTOPS once at its start and, without it, sleeps a whole second.)"""
    from Xlib import X, error
    root = x.screen().root
    if any(root.get_full_property(_atom(x, n), X.AnyPropertyType) is None
           for n in ("_NET_NUMBER_OF_DESKTOPS", "_NET_WORKAREA")):
        return False
    check = _atom(x, "_NET_SUPPORTING_WM_CHECK")
    p = root.get_full_property(check, X.AnyPropertyType)
    if p is None or not len(p.value):
        return False
    try:
        q = x.create_resource_object("window", p.value[0]).get_full_property(check, X.AnyPropertyType)
    except error.XError:  # a check window that is gone
        return False
    return q is not None and len(q.value) > 0 and q.value[0] == p.value[0]


def _wm_listening(x) -> None:
    """Returns once the window manager answers a request. openbox publishes what _wm_ready checks
    before it enters its event loop, and drops what reaches it in between: a window mapped then is
    never managed. So tint2 and pcmanfm, started at once, now and then (about one session start in
    1000 on a loaded machine) came up unmapped, and the desktop waited 30 s for icons that never
    came. The question asked is EWMH's _NET_REQUEST_FRAME_EXTENTS about an unmapped, invisible
    window of ours (the answer is a property on it, nothing else changes), asked again until
    answered: the first ask right after _wm_ready is nearly always dropped."""
    from Xlib import X, protocol
    root = x.screen().root
    probe = root.create_window(0, 0, 1, 1, 0, 0, X.InputOnly, X.CopyFromParent)
    ask, answer = _atom(x, "_NET_REQUEST_FRAME_EXTENTS"), _atom(x, "_NET_FRAME_EXTENTS")

    def answered():
        if probe.get_full_property(answer, X.AnyPropertyType) is not None:
            return True
        root.send_event(protocol.event.ClientMessage(window=probe, client_type=ask, data=(32, [0] * 5)),
                        event_mask=X.SubstructureRedirectMask | X.SubstructureNotifyMask)
        x.flush()
        return False
    try:
        _wait(answered, "the window manager's answer", every=0.01)
    finally:
        probe.destroy()
        x.sync()


def _sticky(x) -> set[str]:
    """The names of the managed windows on every workspace (the taskbar, the desktop icons)."""
    from Xlib import X, error
    root = x.screen().root
    clients = root.get_full_property(_atom(x, "_NET_CLIENT_LIST"), X.AnyPropertyType)
    names = set()
    for wid in (clients.value if clients is not None else []):
        try:
            w = x.create_resource_object("window", wid)
            desktop = w.get_full_property(_atom(x, "_NET_WM_DESKTOP"), X.AnyPropertyType)
            if desktop is not None and len(desktop.value) and desktop.value[0] == 0xFFFFFFFF:
                names.add(w.get_wm_name() or "")
        except error.XError:  # closed meanwhile
            continue
    return names


# The openbox actions that end the session or step outside it: Exit and SessionLogout quit the
# window manager, Restart re-execs it (or, given a command, replaces it with another program),
# Reconfigure reloads its config from a folder the agent's terminal can write, Execute runs a
# program. openbox matches action names without regard to case.
OPENBOX_SESSION_ACTIONS = ("Execute", "Exit", "SessionLogout", "Restart", "Reconfigure")
_SESSION_ACTION = re.compile(r"""<action\s+name\s*=\s*["'](?:%s)["']""" % "|".join(OPENBOX_SESSION_ACTIONS), re.I)


def _system_config(*rel: str) -> str | None:
    """The system's copy of a config file (XDG_CONFIG_DIRS, then /etc/xdg), or None."""
    dirs = (os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":") + ["/etc/xdg"]
    return next((os.path.join(d, *rel) for d in dirs if os.path.isfile(os.path.join(d, *rel))), None)


def openbox_config(config_home: str) -> None:
    """openbox's rc.xml and menu.xml for this desktop (config_home/openbox/, which openbox reads
    before the system's): the system's rc.xml, with

    - the workspace popup switched off. A scroll on the empty desktop switches workspaces and
      openbox shows "desktop 2" in the middle of the screen for most of a second, on a timer of its
      own: the watched settle (vm/settle.py) answers before it goes, a fixed 1-2 s sleep after, so
      the popup was a screen only the watch ever saw (bench/settle.py --explore found it, on
      scrolls only). The workspace switch itself stays: the screen it leaves is the same with
      either settle.
    - no binding, key or mouse, that runs a session action (OPENBOX_SESSION_ACTIONS) or shows the
      root menu, and no menu file but ours, which defines no menu. An exploring agent
      right-clicked the taskbar's empty end (tint2 hands such clicks to the window manager), got
      openbox's root menu (Terminal, Web browser, Applications, ObConf, Reconfigure, Restart,
      Exit) and opened its "Exit Openbox" prompt: one more click, and no window manager for the
      rest of the episode. The stock keys ran programs too: Print and alt+Print start scrot (a
      PNG in HOME, or a pointer grab that eats the next clicks), super+e Konqueror.
      No root menu at all, rather than one of harmless entries: every entry one could keep
      (the apps) is already an icon on the desktop, and a menu is a new screen an exploring
      agent is paid for opening, so a menu that only repeats the icons is a place to farm
      novelty, not to learn the desktop. A right-click on the panel now does nothing.
      What stays is what windows need: decorations with their close buttons, focus, moving and
      resizing, alt+f4 and alt+tab, the window menu (alt+space, a right-click on a title bar:
      its "Close" closes one window) and the middle button's window list (workspaces and
      windows; the action schema has no middle button anyway). Both menus are built into
      openbox; no menu file can redefine them."""
    system = _system_config("openbox", "rc.xml")
    text = open(system).read() if system else "<openbox_config></openbox_config>"
    text, said = re.subn(r"<popupTime>\s*\d+\s*</popupTime>", "<popupTime>0</popupTime>", text)
    if not said:  # openbox's built-in default is 875 ms: say 0 inside <desktops> (made if missing)
        if "<desktops>" not in text:
            text = text.replace("</openbox_config>", "<desktops></desktops></openbox_config>", 1)
        text = text.replace("<desktops>", "<desktops><popupTime>0</popupTime>", 1)
    # Comments first: a commented-out binding must not pair with a real one below it.
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)

    def harmless(m: re.Match) -> str:
        bad = _SESSION_ACTION.search(m[0]) or re.search(r"<menu>\s*root-menu\s*</menu>", m[0])
        return "" if bad else m[0]
    # A binding holding no other binding (a key chain's inner keys are bindings in their own
    # right), dropped whole if any action in it, however deep inside an If, is a session action.
    text = re.sub(r"<(keybind|mousebind)\b[^>]*>(?:(?!<\1\b).)*?</\1>", harmless, text, flags=re.S)
    # With no <file> left openbox loads "menu.xml", and config_home's comes first: ours.
    text = re.sub(r"<file>.*?</file>", "", text, flags=re.S)
    if _SESSION_ACTION.search(text):  # a layout the patterns above did not foresee
        raise RuntimeError(f"could not remove openbox's session actions from {system}; "
                           "give the desktop an rc.xml without Execute, Exit, Restart and Reconfigure")
    os.makedirs(os.path.join(config_home, "openbox"), exist_ok=True)
    with open(os.path.join(config_home, "openbox", "rc.xml"), "w") as fh:
        fh.write(text)
    with open(os.path.join(config_home, "openbox", "menu.xml"), "w") as fh:
        fh.write('<?xml version="1.0" encoding="UTF-8"?>\n<openbox_menu xmlns="http://openbox.org/3.4/menu"/>\n')


def tint2_config(config_home: str) -> None:
    """tint2's config for this desktop (config_home/tint2/tint2rc, which tint2 reads instead of
    copying the system's there): the system's, with no launcher, button or executor on the panel
    (panel_items without L, B, E) and every command empty. The stock panel's launcher showed one
    icon, tint2conf, the panel's own configurator, at the panel's left end: one click opened it
    (explore runs found it; docs/log.md), and its OK rewrites this file and reloads the panel.
    The stock clock runs `orage` on a right-click, where installed. Written at every session
    start, like openbox's: the file is in the run folder, which only the sandbox's reset empties,
    so on a --no-sandbox desktop a panel changed in one episode used to be the next one's too.
    Kept: the taskbar (a right-click on a task closes that window), the clock, the system tray,
    and handing clicks on its empty parts to openbox, where they now find nothing."""
    system = _system_config("tint2", "tint2rc")
    if system is None:  # nothing to strip (every tint2 package ships one): tint2's own defaults
        return
    text = open(system).read()
    text = re.sub(r"(?m)^(\s*panel_items\s*=\s*)(\S*)", lambda m: m[1] + re.sub("[LBE]", "", m[2]), text)
    text = re.sub(r"(?m)^\s*launcher_item_app\s*=.*\n?", "", text)
    text = re.sub(r"(?m)^(\s*\w+_(?:command|cmd)\s*=).*$", r"\1 ", text)
    os.makedirs(os.path.join(config_home, "tint2"), exist_ok=True)
    with open(os.path.join(config_home, "tint2", "tint2rc"), "w") as fh:
        fh.write(text)


def start_session(desk: DesktopState) -> None:
    """Window manager, then taskbar and desktop icons; returns once the desktop has settled (every
    icon drawn, nothing busy: vm/settle.py). openbox and tint2 keep their caches (and tint2 its copy
    of the default config) in the desktop's run folder, not in HOME, so HOME is the template and
    nothing else."""
    x = _x(desk.display)
    run = os.path.join(desk.env.get("XDG_RUNTIME_DIR") or desk.tmp, "session")
    own = replace(desk, env={**desk.env, "XDG_CONFIG_HOME": os.path.join(run, "config"),
                             "XDG_CACHE_HOME": os.path.join(run, "cache")})
    if desk.display not in _fresh_root:  # the first start: the X server as it came up
        _fresh_root[desk.display] = root_properties(desk.display)
    watch = watcher(desk)
    watch.arm()
    started = time.monotonic()
    _wait(lambda: _wm_gone(x), "the last window manager's exit")
    openbox_config(own.env["XDG_CONFIG_HOME"])
    tint2_config(own.env["XDG_CONFIG_HOME"])
    spawn(own, ["openbox"])
    _wait(lambda: _wm_ready(x), "openbox")
    _wm_listening(x)  # before anything maps a window
    spawn(own, ["tint2"])
    spawn(desk, ["pcmanfm", "--desktop"])
    px, py = desktop_icons(desk.screen)["Terminal"]
    pixel = lambda: "#%02x%02x%02x" % ImageGrab.grab(bbox=(px, py, px + 1, py + 1),
                                                     xdisplay=desk.display).getpixel((0, 0))[:3]

    def drawn():  # both sticky windows are up and the first icon's pixel is no longer background
        return {"pcmanfm", "tint2"} <= _sticky(x) and pixel() != BG_COLOUR
    try:
        _wait(drawn, "the desktop icons")
    except RuntimeError as e:  # say what is missing
        raise RuntimeError(f"{e} (managed: {sorted(_sticky(x))}, the Terminal icon's pixel {pixel()})") from None
    watch.settle(started, first_change=0.0)


# -------------------------------------------------------------------------------------------------
# HOME, and the whole desktop


def remove_tree(path: str) -> None:
    """rmtree that also removes what a task or the agent made unreadable (chmod 000 folders): every
    folder of the tree is opened up first, top-down, so the walk can enter it (root could anyway;
    the user of a sandbox started by anyone else could not). Symlinks are never followed, and the
    folder holding `path` is never touched (for a desktop's folder that is /tmp). Runs when no
    process of the desktop is left to swap a folder for a link meanwhile (reset kills them first)."""
    def open_up(p: str) -> None:
        with contextlib.suppress(OSError):
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o755)
    open_up(path)
    for top, dirs, _ in os.walk(path):
        for d in dirs:
            open_up(os.path.join(top, d))
    shutil.rmtree(path, ignore_errors=True)


def restore_home(desk: DesktopState) -> None:
    """Make HOME the template again, touching only what differs: every entry of the template with
    its content, mode, mtime and symlink target, and nothing else. HOME itself stays (in the
    sandbox it is a mount point, the one writable place, which cannot be removed)."""
    os.makedirs(desk.home, exist_ok=True)
    os.chmod(desk.home, 0o755)  # the agent may have locked itself out (chmod 000 ~)
    _sync(os.path.join(desk.tmp, "template"), desk.home)


def _same(a: os.DirEntry, b: os.DirEntry) -> bool:
    """Is HOME's entry `b` the template's `a` (a folder of the same kind counts: its insides are
    synced on their own)? Contents are compared only when the sizes and mtimes agree."""
    sa, sb = a.stat(follow_symlinks=False), b.stat(follow_symlinks=False)
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a.path) == os.readlink(b.path)
    if a.is_dir() or b.is_dir():
        return a.is_dir() and b.is_dir()
    if (sa.st_mode, sa.st_size, sa.st_mtime_ns) != (sb.st_mode, sb.st_size, sb.st_mtime_ns) or sb.st_nlink != 1:
        return False  # (a second hard link would let an edit elsewhere change this file)
    with open(a.path, "rb") as fa, open(b.path, "rb") as fb:
        return fa.read() == fb.read()


def _sync(src: str, dst: str) -> None:
    """Make folder `dst` equal to the template folder `src` (see restore_home)."""
    os.chmod(dst, 0o700)  # readable and writable while we work in it; its own mode comes last
    want = {e.name: e for e in os.scandir(src)}
    for e in os.scandir(dst):
        if e.name not in want or not _same(want[e.name], e):
            if e.is_dir(follow_symlinks=False):
                remove_tree(e.path)
            else:
                os.unlink(e.path)
    for name, e in want.items():
        path = os.path.join(dst, name)
        if e.is_symlink():
            if not os.path.lexists(path):
                os.symlink(os.readlink(e.path), path)
        elif e.is_dir():
            if not os.path.lexists(path):
                os.mkdir(path)
            _sync(e.path, path)
        elif not os.path.lexists(path):
            shutil.copy2(e.path, path)
    shutil.copystat(src, dst)  # mode and mtime last: the changes above moved the mtime


def reset_desktop(desk: DesktopState) -> dict[str, float]:
    """POST /reset of an --xvfb desktop: stop every program but Xvfb (the session too: a file
    manager window, its clipboard and the icons' selection live in the desktop's process), make
    HOME the template and the root window's properties what the fresh X server had, start the
    session again. -> seconds per phase. A reset desktop looks exactly like a fresh one
    (tests/test_vm_server.py checks the pixels and HOME's bytes)."""
    t = [time.monotonic()]
    kill_all(desk)
    t.append(time.monotonic())
    clear_scratch(desk)
    restore_home(desk)
    t.append(time.monotonic())
    _wait(lambda: _wm_gone(_x(desk.display)), "the last window manager's exit")  # its last requests are done
    restore_root(desk.display, _fresh_root[desk.display])
    t.append(time.monotonic())
    start_session(desk)
    t.append(time.monotonic())
    return {k: round(b - a, 3) for k, a, b in zip(("kill", "home", "root", "session"), t, t[1:])}


def kill_all(desk: DesktopState) -> None:
    """Every program of the desktop but Xvfb and this server, gone. In the sandbox as root, at once:
    the launcher outside kills every process of the desktop's cgroup but those, with forks stopped
    first (vm/limits.py), so a program that ignores SIGTERM and takes a new PID every few
    milliseconds cannot outrun it. Otherwise one process at a time, as a real VM's reset does
    (vm/procs.py: kill_tree)."""
    if desk.resets is None:
        kill_tree(keep={desk.xvfb.pid})
        return
    f = desk.resets.makefile("rwb", buffering=0)
    f.write(b"reset %d %d\n" % (os.getpid(), desk.xvfb.pid))
    answer = f.readline()
    if not answer.startswith(b"ok"):
        raise RuntimeError(f"the launcher could not reset the desktop: {answer.decode(errors='replace').strip() or 'gone'}")
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and [p for p in descendants(os.getpid()) if p != desk.xvfb.pid]:
        time.sleep(0.005)  # SIGKILLed: gone within moments; reaped below
    reap()


def clear_scratch(desk: DesktopState) -> None:
    """The sandbox's /tmp, /var/tmp and /dev/shm and the desktop's XDG_RUNTIME_DIR, emptied as HOME
    is restored: a file there is memory (tmpfs) an episode must not leave to the next. The X
    server's socket and lock in /tmp stay."""
    run = desk.env.get("XDG_RUNTIME_DIR")
    for folder in (*desk.scratch, *([run] if run and desk.scratch else [])):
        for e in os.scandir(folder) if os.path.isdir(folder) else []:
            if folder == "/tmp" and (e.name == ".X11-unix" or re.fullmatch(r"\.X\d+-lock", e.name)):
                continue
            if e.is_dir(follow_symlinks=False):
                remove_tree(e.path)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(e.path)


def make_tmp(mount=None) -> str:
    """The desktop's folder: template/ (a fresh HOME), home/ (the HOME in use), run/
    (XDG_RUNTIME_DIR), Xauthority (the display's cookie). Made on the host, before the sandbox,
    which gets home/ and run/ writable and the rest read-only: the agent can read its display's
    cookie but not change the one the server's own X clients (wmctrl, xdotool) read. `mount(folder)`,
    if given, mounts the folder's own filesystem first (vm/limits.py: a sized tmpfs)."""
    tmp = tempfile.mkdtemp(prefix=f"vm_server-{os.getpid()}-")  # the launcher's PID: see limits.sweep
    if mount is not None:
        mount(tmp)
    for rel, text in template_files().items():
        os.makedirs(os.path.dirname(os.path.join(tmp, "template", rel)), exist_ok=True)
        with open(os.path.join(tmp, "template", rel), "w") as f:
            f.write(text)
    # Whatever our umask: the sandbox's user (not us, when we are root) reads the template and
    # passes through the folder, but may not list it.
    for top, dirs, files in os.walk(os.path.join(tmp, "template")):
        os.chmod(top, 0o755)
        for name in files:
            os.chmod(os.path.join(top, name), 0o644)
    os.chmod(tmp, 0o711)
    write_xauthority(os.path.join(tmp, "Xauthority"))
    os.makedirs(os.path.join(tmp, "run"), mode=0o700)
    os.makedirs(os.path.join(tmp, "home"))
    return tmp


def local_desktop(screen: tuple[int, int], allow: frozenset, tmp: str | None = None, resets=None) -> DesktopState:
    """--xvfb: a display, a HOME copied from a fresh template, and a session on it. `tmp` is the
    folder make_tmp() made (by the launcher outside the sandbox: then /tmp, /var/tmp and /dev/shm
    are the sandbox's own, emptied by a reset); None makes one here. `resets`: the launcher's
    socket for a reset's kill (kill_all), or None."""
    scratch = ("/tmp", "/var/tmp", "/dev/shm") if tmp else ()
    missing = [p for p in ("Xvfb", "openbox", "tint2", "pcmanfm", "wmctrl", "mousepad") if not shutil.which(p)]
    if missing:
        sys.exit(f"vm_server: {', '.join(missing)} not installed; install the desktop with `bash setup.sh`.")
    tmp = tmp or make_tmp()
    auth = os.path.join(tmp, "Xauthority")  # the display's cookie (make_tmp wrote it): only this desktop's clients get in
    xvfb, display = start_xvfb(screen, auth)
    home = os.path.join(tmp, "home")
    # The apps' environment is built, not inherited: whatever else the server's caller had in its
    # environment (API keys, cloud credentials, the token) must not reach a terminal the agent can
    # `env` in. Our own HOME and XDG dirs, and no session bus: parallel desktops must never share
    # files, settings, or single-instance apps (a second mousepad would open in the first one's window).
    env = {k: v for k, v in os.environ.items() if k in ENV_KEEP and k != "HOME"}
    env.update(DISPLAY=display, XAUTHORITY=auth, HOME=home, XDG_CONFIG_HOME=f"{home}/.config",
               XDG_DATA_HOME=f"{home}/.local/share", XDG_CACHE_HOME=f"{home}/.cache",
               XDG_RUNTIME_DIR=os.path.join(tmp, "run"), GSETTINGS_BACKEND="keyfile",
               NO_AT_BRIDGE="1", GTK_OVERLAY_SCROLLING="0", LANG="C.UTF-8", LC_ALL="C.UTF-8")
    # X resource files are code: a translations resource makes xterm type into its shell. Unset,
    # these make Xt (xterm, xcalc, xclock, xeyes) read $HOME/XTerm, $HOME/XCalc, ... and
    # $HOME/.Xdefaults-<host>, visible files a task or an earlier episode could have written.
    # /dev/null/... can never exist; /dev/null reads as empty.
    env.update(XUSERFILESEARCHPATH=f"{os.devnull}/%N", XAPPLRESDIR=os.devnull, XENVIRONMENT=os.devnull)
    os.environ.update(DISPLAY=display, XAUTHORITY=auth)  # for pyautogui and ImageGrab in this process
    desk = DesktopState(screen, home, env, allow, xvfb, tmp, display, resets, scratch)
    restore_home(desk)
    start_session(desk)
    return desk
