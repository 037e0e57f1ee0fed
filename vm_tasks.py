"""vm_tasks.py: what POST /setup and POST /evaluate may do on a desktop, checked and run.

vm_server.py imports it at its top; copy both files into your VM (nothing here runs on its own).
A task file (tasks/*.json) prepares the desktop with typed setup steps (launch, open, sleep,
write_file, command) and scores an episode with typed checks (file_exists, file_contains,
window_exists, command); STEP_FIELDS and CHECK_FIELDS list every field each one takes.

Threat model: whoever writes a task file, or holds the server's token, sends these requests. They
may drive the desktop (that is the point), but no step or check may run code or reach outside the
desktop's HOME on its own:
  - programs come from an allow-list (DEFAULT_ALLOW plus the operator's --allow-exec), looked up
    by bare name on PATH without HOME entries, so a file written into HOME never becomes one;
  - each default program's arguments follow ARGV_RULES (no `find -exec`, `xterm -e sh`,
    `xdotool type`, `cat /etc/shadow`), checked when the request arrives AND right before the
    program starts;
  - every path resolves (symlinks too) inside HOME, and no step writes, opens or passes a hidden
    file (.bashrc, .config/...): shells and GTK run code from those;
  - nor a visible file that an app runs code from: launchers (*.desktop, any case, or content
    with a [Desktop Entry] header), X resource files (~/XTerm ...), anything in Desktop/; cp/mv
    move no symlinks; pcmanfm is handed folders only;
  - xdotool runs exactly one window command, `date` only prints;
  - a request is checked whole before anything runs: every step, the sum of its sleeps and command
    timeouts (REQUEST_SECONDS) and HOME's worst-case size after every step (HOME_QUOTA). A step is
    refused when it comes to run only if something outside the request changed HOME meanwhile;
    the error then says which steps ran.
Where this departs from OSWorld: its setup/evaluate run arbitrary shell commands and per-app Python
getters; ours are a handful of generic, checked steps, so task files stay small and readable.
"""

from __future__ import annotations

import contextlib
import mimetypes
import os
import re
import select
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vm_server imports us at its top; we import it only when a step runs (_server)
    from vm_server import Desktop

# -------------------------------------------------------------------------------------------------
# Limits and the allow-list

MAX_BODY = 1 << 20       # 1 MiB per request body: room for a write_file, not for abuse
MAX_TEXT = 2000          # longest `type` text (env.py turns longer model output into a format failure)
MAX_ITEMS = 64           # setup steps / evaluator checks per request
MAX_READ = 10 << 20      # file_contains reads at most this much of a file
MAX_OUTPUT = 64 << 10    # command stdout kept (it goes to a temp file, never into our memory)
APP_SETTLE = 1.0         # seconds /setup waits at its end when it started an app
REGEX_SECONDS = 2.0      # an evaluator regex that runs longer than this fails its check (see _search)
REQUEST_SECONDS = 120.0  # one /setup's sleeps and command timeouts together (and one /evaluate's run time)
HOME_QUOTA = 64 << 20    # what HOME may hold after any step of setup/evaluate (see usage())
ENTRY_BYTES = 4096       # what each file, folder or link costs against HOME_QUOTA besides its bytes
MAX_TREE = HOME_QUOTA // ENTRY_BYTES  # cp/mv refuse a folder with more entries (a HOME in quota has fewer)
DEFAULT_ALLOW = frozenset(
    "xterm mousepad galculator pcmanfm xclock xeyes xcalc ls cat grep wc head tail test stat "
    "sha256sum md5sum mkdir touch cp mv echo sleep true false xdotool wmctrl bc date basename "
    "dirname find sort uniq diff cmp".split())
TEXT_EXTS = (".txt", ".md", ".csv", ".json", ".log", ".py", ".sh", ".conf", ".ini", ".xml", ".html")
# What the arguments of each default program may be, so that setup/evaluate (a task file, or
# anyone with the token) cannot run code or reach outside HOME THROUGH the allow-list: `find -exec`,
# `xterm -e`, `xdotool exec`/`type`, `sort --compress-program`, GTK's `--gtk-module`, `date -s`,
# `cat /etc/shadow` and `cp x /tmp` are all refused.
#   "none"  no arguments (GTK apps take --gtk-module=LIB, Xt apps -xrm and -display);
#   "paths" only paths, handed over absolute (so 'file:///etc' stays a file name inside HOME);
#   "free"  anything (these programs open no files);
#   "-a -b ..."  these options (one-letter ones combine: -la); every other argument (an option's
#           value too) must be a path inside HOME -- on the safe side, a grep pattern like '/usr' is
#           refused as well.
# No path may name a hidden file or folder (.bashrc, .config/...): shells and GTK run code from them;
# nor a file some app reads code from (code_name(): launchers, X resource files), nor anything in
# Desktop/ (its icons are launchers). pcmanfm takes folders only: given a file it launches it.
# Left out on purpose: sha256sum/md5sum -c (reads the files its list names, anywhere), diff -r
# (follows symlinks), find -L, grep -R, cp -s.
# xdotool runs exactly one window command (XDOTOOL_COMMANDS), date prints only (see _date_args).
# xterm takes -T/-title/-geometry/-hold and `-e PROG ARGS` with PROG allow-listed and ARGS under
# PROG's rule. Programs that write files (writes()) run only as `command`, never detached.
# A program added with --allow-exec is the operator's choice and takes any arguments.
ARGV_RULES = {
    **dict.fromkeys(("galculator", "xclock", "xeyes", "xcalc"), "none"), "xterm": "xterm",
    **dict.fromkeys(("mousepad", "pcmanfm"), "paths"),
    **dict.fromkeys(("echo", "sleep", "true", "false", "basename", "dirname", "wmctrl"), "free"),
    "ls": "-l -a -A -1 -R -h -t -r -S -d -F", "cat": "-n -b -s -A -E -T", "wc": "-l -w -c -m -L",
    "grep": "-q -c -i -v -n -l -L -w -x -E -F -o -s -h -H -r -e -m", "head": "-n -c -q", "tail": "-n -c -q",
    "test": "-e -f -d -s -r -w -x -L -h -n -z -nt -ot -eq -ne -lt -le -gt -ge -a -o", "stat": "-c -t",
    "sha256sum": "-b -t", "md5sum": "-b -t", "mkdir": "-p -v", "touch": "-c -a -m", "bc": "-l -q",
    "cp": "-r -R -a -f -n -p -v -T -u", "mv": "-f -n -v -T -u", "date": "date", "uniq": "-c -d -u -i",
    "find": "-name -iname -type -maxdepth -mindepth -path -ipath -size -empty -print -newer -mtime -mmin -not -a -o",
    "sort": "-r -n -u -f -b -h -V -s -k -t -o", "diff": "-u -q -N -i -w -b -B -s", "cmp": "-s -l -b",
    "xdotool": "xdotool",
}
# xdotool runs every command it finds in its argv, one after another, and matches command names
# without regard to case (`Exec`, `TYPE`); a command's arguments end where the next command's name
# begins. So its rule is a grammar, not a deny list: exactly one of these commands (any case), then
# only its listed flags and number-valued options (exact spellings: no --sy abbreviations, no
# --opt=value), then exactly its positional arguments -- nothing is left over to start a second
# command. command -> (flags, options taking an integer, positionals): "window?" an optional
# window (id or %N/%@ from the window stack), "int" an integer, "seconds" a duration, "pattern" a
# search regex. Read off the command sources of xdotool 3.20160805 (Debian's); later releases add
# commands (XDOTOOL_NAMES lists them) but parse these the same way.
XDOTOOL_COMMANDS = {
    "search": (("--onlyvisible", "--name", "--class", "--classname", "--title", "--sync", "--all", "--any"),
               ("--maxdepth", "--pid", "--screen", "--desktop", "--limit"), ("pattern",)),
    "getactivewindow": ((), (), ()), "getwindowfocus": (("-f",), (), ()),
    "getwindowname": ((), (), ("window?",)), "getwindowpid": ((), (), ("window?",)),
    "getwindowgeometry": (("--shell",), (), ("window?",)), "getdisplaygeometry": (("--shell",), (), ()),
    "getmouselocation": (("--shell",), (), ()), "get_desktop": ((), (), ()), "get_num_desktops": ((), (), ()),
    "get_desktop_for_window": ((), (), ("window?",)), "get_desktop_viewport": (("--shell",), (), ()),
    **dict.fromkeys(("windowactivate", "windowfocus", "windowminimize", "windowmap", "windowunmap"),
                    (("--sync",), (), ("window?",))),
    "windowraise": ((), (), ("window?",)), "windowclose": ((), (), ("window?",)),
    "windowmove": (("--sync", "--relative"), (), ("window?", "int", "int")),
    "windowsize": (("--sync", "--usehints"), (), ("window?", "int", "int")),
    "sleep": ((), (), ("seconds",)),
}
# Every command name any xdotool release knows: no argument may spell one, in any case, so that
# even an xdotool that parsed some argument differently from the grammar above finds no second
# command to run.
XDOTOOL_NAMES = frozenset(XDOTOOL_COMMANDS) | frozenset(
    "exec behave behave_screen_edge key keydown keyup type click mousedown mouseup mousemove "
    "mousemove_relative selectwindow set_window windowkill windowquit windowlower windowreparent windowstate "
    "set_desktop set_num_desktops set_desktop_for_window set_desktop_viewport getwindowclassname help "
    "version".split())
_XDO_SHAPES = {"window?": r"%(@|-?[1-9][0-9]{0,3})|[1-9][0-9]{0,9}|0x[0-9a-fA-F]{1,8}", "int": r"-?[0-9]{1,5}",
               "seconds": r"[0-9]{1,3}(\.[0-9]{1,3})?", "pattern": r"[^-].{0,499}"}
# Files apps read code from although their names are not hidden:
#   - launchers: GIO calls a file application/x-desktop by its name (*.desktop, *.kdelnk, any case)
#     or, when the name says nothing certain (no or an unknown extension: `x`, `x.foo`,
#     `x.desktop ` with a trailing space or dot), by its first bytes ("[Desktop Entry]" ...);
#     pcmanfm then runs its Exec= line when the file is opened, without asking (libfm's quick_exec).
#     So no name containing ".desktop"/".kdelnk" anywhere, and no content with a desktop-entry header.
#   - X resource files: Xt apps (xterm, xcalc, xclock, xeyes) read $HOME/<Class>, $HOME/<lang>/<Class>
#     (and <Class>-color ...) when XUSERFILESEARCHPATH/XAPPLRESDIR are unset, and xterm's
#     `translations` resource types commands into its shell. So no file or folder whose name
#     starts with one of their class names, in any case, at any depth.
LAUNCHER_MARKS = (".desktop", ".kdelnk")
XT_CLASSES = ("xterm", "uxterm", "koi8rxterm", "xcalc", "xclock", "xeyes")
DESKTOP_ENTRY = ("desktop entry", "desktop action")  # key-file groups a launcher needs (case ignored)
# Programs that create or change files; their growth of HOME is predicted before they run
# (_growth), so they run only as `command` steps or checks, which the server waits for.
WRITERS = frozenset("cp mv mkdir touch".split())


class BadRequest(Exception):
    """A client mistake: answered with `status` and the message; the server keeps serving."""
    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


# -------------------------------------------------------------------------------------------------
# Validation: every field of a request is checked before anything runs


def _obj(d, what: str, table: dict | None = None, required=(), optional=()) -> dict:
    """A JSON object with exactly these fields (null counts as absent). With `table`, its "type"
    picks (required, optional) from the table."""
    if not isinstance(d, dict):
        raise BadRequest(f"{what} must be a JSON object.")
    if table is not None:
        if not isinstance(d.get("type"), str) or d["type"] not in table:  # a list/dict is unhashable
            raise BadRequest(f"{what} 'type' must be one of {list(table)}, got {d.get('type')!r}.")
        what, required, optional = f"a {d['type']!r} {what}", ("type",) + table[d["type"]][0], table[d["type"]][1]
    d = {k: v for k, v in d.items() if v is not None}
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise BadRequest(f"{what} does not take {unknown}; its fields are {sorted({*required, *optional})}.")
    missing = [k for k in required if k not in d]
    if missing:
        raise BadRequest(f"{what} needs {missing}.")
    return d


def _number(d: dict, key: str, lo, hi, default=None, integer=True):
    v = d.get(key, default)  # bool is an int in Python, NaN/inf fail the range test
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)) or not lo <= v <= hi:
        raise BadRequest(f"'{key}' must be {'an integer' if integer else 'a number'} in [{lo}, {hi}], got {v!r}.")
    return v


def _unicode(s: str) -> bool:
    """Is `s` text that UTF-8 can carry? JSON lets a lone surrogate ("\\ud800") through, and it
    would fail only when written, or be written as a stray byte into a file name."""
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _all_unicode(body) -> None:
    """BadRequest if any string in the JSON value `body`, keys included, is not _unicode()."""
    todo = [body]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, str) and not _unicode(v):
            raise BadRequest("the request holds a string that is not valid Unicode text (a lone surrogate such as \\ud800).")


def _str(d: dict, key: str, max_len: int, empty=False) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > max_len or (not v and not empty) or "\0" in v or not _unicode(v):
        raise BadRequest(f"'{key}' must be a {'' if empty else 'non-empty '}string of at most {max_len} characters.")
    return v


def _regex(d: dict, key: str) -> re.Pattern:
    try:
        return re.compile(_str(d, key, 500))
    except re.error as e:
        raise BadRequest(f"'{key}' is not a valid regular expression ({e}).")


def _argv(desk: Desktop, d: dict) -> list[str]:
    argv = d.get("argv")
    if not (isinstance(argv, list) and 0 < len(argv) <= 64
            and all(isinstance(a, str) and "\0" not in a and len(a) <= 4096 and _unicode(a) for a in argv)):
        raise BadRequest("'argv' must be a non-empty list of strings: the program and its arguments.")
    # A bare name only: '/tmp/x/ls' would pass a basename check and run anything.
    if argv[0] not in desk.allow:
        raise BadRequest(f"program {argv[0]!r} is not allowed; use one of {sorted(desk.allow)} or start the server with --allow-exec {argv[0]}.")
    runnable(desk, argv)  # refused now if it would be refused when it runs
    return argv


def program(desk: Desktop, name: str) -> str | None:
    """The absolute path `name` runs as, found on PATH without relative or HOME entries: a file
    written into HOME (~/bin/ls, ./ls) must never become an allow-listed program."""
    home = os.path.realpath(desk.home)
    dirs = [d for d in desk.env.get("PATH", os.defpath).split(os.pathsep)
            if os.path.isabs(d) and not _under(os.path.realpath(d), home)]
    return shutil.which(name, path=os.pathsep.join(dirs))


def _under(real: str, home: str) -> bool:
    return real == home or real.startswith(home + os.sep)


def visible_in_home(desk: Desktop, p: str) -> str | None:
    """The real path of `p` (relative to HOME) if it lies inside HOME and no part of it below HOME
    is hidden (starts with '.'); else None."""
    home = os.path.realpath(desk.home)
    real = os.path.realpath(os.path.join(home, p))
    rel = os.path.relpath(real, home)
    if not _under(real, home) or (rel != "." and any(c.startswith(".") for c in rel.split(os.sep))):
        return None
    return real


def code_name(name: str) -> str | None:
    """Why an app would read code from a file or folder called `name` (see LAUNCHER_MARKS and
    XT_CLASSES), or None. Case is ignored: GIO's globs ignore it, and refusing more costs nothing."""
    low = name.lower()
    if any(m in low for m in LAUNCHER_MARKS):
        return "a launcher name (.desktop/.kdelnk): the file manager runs such files"
    if low.startswith(XT_CLASSES):
        return "an X resource file name (XTerm, XCalc, ...): Xt apps read those from HOME"
    return None


def harmless(desk: Desktop, real: str, given: str = "") -> str:
    """`real` (a resolved path inside HOME, reached as `given`) if no app reads code from it:
    not in Desktop/ (every file there is an icon the agent double-clicks), and no part of either
    spelling named like a launcher or an X resource file. BadRequest otherwise."""
    rel = os.path.relpath(real, os.path.realpath(desk.home))
    parts = [c for c in rel.split(os.sep) + given.split("/") if c not in ("", ".", "~")]
    if rel.split(os.sep)[0].lower() == "desktop":
        raise BadRequest(f"{given or rel!r} is in Desktop/: setup/evaluate leave the desktop's icons alone.")
    for c in parts:
        if code_name(c):
            raise BadRequest(f"{given or rel!r} has {code_name(c)}; setup/evaluate never make or pass one.")
    return real


def desktop_entry(text: str) -> bool:
    """Does `text` carry a launcher's key-file group? GIO takes a file whose name says nothing
    certain for a launcher when its first bytes are such a header; refusing it anywhere, in any
    case, leaves no spelling that a launcher could use."""
    low = text.lower()
    return any(g in low for g in DESKTOP_ENTRY)


def _xdotool_args(argv: list[str]) -> None:
    """BadRequest unless argv is `xdotool COMMAND [options] [positionals]` per XDOTOOL_COMMANDS."""
    cmd = argv[1].lower() if len(argv) > 1 and argv[1].isascii() else ""
    refuse = BadRequest(f"xdotool runs exactly one window command here ({', '.join(sorted(XDOTOOL_COMMANDS))}) "
                        "with its own options: no input, no exec, no behave, no chains.")
    if cmd not in XDOTOOL_COMMANDS or any(a.isascii() and a.lower() in XDOTOOL_NAMES for a in argv[2:]):
        raise refuse
    flags, valued, shapes = XDOTOOL_COMMANDS[cmd]
    rest = argv[2:]
    while rest and rest[0].startswith("-") and rest[0] not in ("-",):
        if rest[0] in flags:
            rest = rest[1:]
        elif rest[0] in valued and len(rest) > 1 and re.fullmatch(r"[0-9]{1,9}", rest[1]):
            rest = rest[2:]
        else:
            raise refuse
    if shapes[:1] == ("window?",) and len(rest) == len(shapes) - 1:
        shapes = shapes[1:]  # the window is optional: %1, the last search's first window, by default
    if len(rest) != len(shapes) or not all(re.fullmatch(_XDO_SHAPES[s], a, re.S) for s, a in zip(shapes, rest)):
        raise refuse


def _date_args(argv: list[str]) -> None:
    """BadRequest unless date only prints: `+FORMAT` and `-d VALUE` (plus -u, -R, -I), each at most
    once. Refused: a positional MMDDhhmm[[CC]YY] (that SETS the clock), -s, -f/-r FILE (read any
    file), and TZ="..." inside the -d value (parse_datetime opens that zone file: any path)."""
    seen, i = set(), 1
    while i < len(argv):
        a = argv[i]
        if a in ("-u", "-R", "-I") or (a.startswith("+") and "+" not in seen):
            seen.add(a[0] if a.startswith("+") else a)
        elif a == "-d" and "-d" not in seen and i + 1 < len(argv) and "tz" not in argv[i + 1].lower():
            seen.add(a)
            i += 1
        else:
            raise BadRequest(f"date only prints here: '+FORMAT' and one plain '-d VALUE' (no TZ= in it), "
                             f"plus -u/-R/-I; not {a!r}.")
        i += 1


def writes(argv: list[str]) -> bool:
    """Does this allow-listed command create or change files? (sort -o and uniq IN OUT do too.)"""
    plain = [a for a in argv[1:] if not a.startswith("-") or a == "-"]
    return (argv[0] in WRITERS or argv[0] == "sort" and any(a[:1] == "-" and a[1:2] != "-" and "o" in a for a in argv[1:])
            or argv[0] == "uniq" and len(plain) > 1)


def _tree(desk: Desktop, top: str) -> None:
    """BadRequest if the folder `top` (which cp/mv would copy or move) holds a symlink (moved or
    copied, a link can point out of HOME from its new place), a file with a code_name, or more than
    MAX_TREE entries."""
    n = 0
    for root, dirs, files in os.walk(top):  # does not follow symlinks: they are listed, and refused
        for name in dirs + files:
            n += 1
            why = "it holds more than %d entries" % MAX_TREE if n > MAX_TREE else (
                "it holds a symlink" if os.path.islink(os.path.join(root, name)) else code_name(name))
            if why:
                raise BadRequest(f"cannot copy or move {os.path.relpath(top, desk.home)!r}: {why}.")


def check_args(desk: Desktop, argv: list[str]) -> list[str]:
    """argv as it will run, per ARGV_RULES (GUI paths made absolute); BadRequest if refused. Applied
    to the request's argv when it is checked AND right before the program starts: an earlier step
    may have put a symlink where a path pointed."""
    # --allow-exec extras are free; a default program without a rule would take no arguments
    rule, name, out = ARGV_RULES.get(argv[0], "none" if argv[0] in DEFAULT_ALLOW else "free"), argv[0], argv[:1]
    if rule == "free":
        return list(argv)
    if rule == "none" and len(argv) > 1:
        raise BadRequest(f"{name} takes no arguments in setup/evaluate; start it bare.")
    if rule == "xterm":  # a terminal that shows an allow-listed command: xterm -T t -hold -e cat f
        i = 1
        while i < len(argv) and argv[i] != "-e":
            if argv[i] not in ("-T", "-title", "-geometry", "-hold") or (argv[i] != "-hold" and i + 1 == len(argv)):
                raise BadRequest(f"xterm takes only -T/-title/-geometry/-hold and -e PROGRAM here, not {argv[i]!r}.")
            i += 1 if argv[i] == "-hold" else 2
        if i + 1 >= len(argv):
            return list(argv[:i])
        if argv[i + 1] not in desk.allow or argv[i + 1] == "xterm":
            raise BadRequest(f"xterm -e runs only allow-listed programs, not {argv[i + 1]!r}.")
        if writes(argv[i + 1:]):
            raise BadRequest(f"xterm -e shows a command; {argv[i + 1]} writes files, so run it as a 'command' step.")
        return list(argv[:i + 1]) + runnable(desk, argv[i + 1:])
    if rule == "xdotool":
        _xdotool_args(argv)
        return list(argv)
    if rule == "date":
        _date_args(argv)
        return list(argv)
    options = set(rule.split()) if rule.startswith("-") else set()
    paths = []
    for a in argv[1:]:
        if a.startswith("-") and a != "-":
            if not (a in options or (a[1] != "-" and all(f"-{c}" in options for c in a[1:]))):
                raise BadRequest(f"option {a!r} of {name} is not allowed in setup/evaluate; it takes {rule if options else 'no options'}.")
            out.append(a)
            continue
        real = visible_in_home(desk, a) if a else desk.home
        if real is None:
            raise BadRequest(f"argument {a!r} of {name} leaves HOME or names a hidden file; setup/evaluate "
                             "programs only touch visible files inside HOME.")
        harmless(desk, real, a)
        paths.append((a, real))
        out.append(real if rule == "paths" else a)
    if name == "pcmanfm" and any(os.path.lexists(r) and not os.path.isdir(r) for _, r in paths):
        raise BadRequest("pcmanfm opens folders here; given a file it would launch it (open it with an 'open' step).")
    if name in ("cp", "mv"):
        for a, real in paths:
            if os.path.islink(os.path.join(desk.home, a)):
                raise BadRequest(f"cannot copy or move {a!r}: it is a symlink, which could point out of HOME from its new place.")
        if paths and paths[-1][1] == os.path.realpath(desk.home):
            raise BadRequest(f"{name} into HOME itself is refused (it could bring hidden files there); name the target.")
        for a, real in paths[:-1]:  # the sources (the last path is the target)
            _tree(desk, real)
    return out


def resolve(desk: Desktop, p) -> str:
    """'rel' and '~/rel' are under HOME; absolute paths must resolve (symlinks too) inside HOME."""
    if not isinstance(p, str) or not p or len(p) > 4096 or "\0" in p or not _unicode(p):
        raise BadRequest("'path' must be a non-empty string of Unicode text.")
    full = desk.home if p == "~" else os.path.join(desk.home, p[2:] if p.startswith("~/") else p)
    real, home = os.path.realpath(full), os.path.realpath(desk.home)
    if not _under(real, home):
        raise BadRequest(f"path {p!r} is outside the desktop's home {home}; use a path inside it.")
    return real


# -------------------------------------------------------------------------------------------------
# POST /setup and POST /evaluate

STEP_FIELDS = {"launch": (("argv",), ()), "open": (("path",), ()), "sleep": (("seconds",), ()),
               "write_file": (("path", "content"), ()), "command": (("argv",), ("timeout",))}
CHECK_FIELDS = {"file_exists": (("path",), ("exists",)), "file_contains": (("path",), ("text", "regex")),
                "window_exists": (("title",), ("exists",)),
                "command": (("argv",), ("stdout", "regex", "exit_code", "timeout"))}


def _items(body, what: str, key: str, optional=()) -> list:
    body = _obj(body, f"the {what} body", None, (key,), optional)
    if not isinstance(body[key], list) or not 0 < len(body[key]) <= MAX_ITEMS:
        raise BadRequest(f"'{key}' must be a list of 1 to {MAX_ITEMS} items.")
    _all_unicode(body)
    return body[key]


def check_step(desk: Desktop, s) -> dict:
    s = _obj(s, "setup step", STEP_FIELDS)
    if s["type"] in ("launch", "command"):
        s["argv"] = _argv(desk, s)
        s["timeout"] = _number(s, "timeout", 0.1, REQUEST_SECONDS, default=30, integer=False)
        if s["type"] == "launch" and writes(s["argv"]):  # nobody would wait for it, or count what it wrote
            raise BadRequest(f"{s['argv'][0]} writes files: run it as a 'command' step, not 'launch'.")
    elif s["type"] == "open":  # a folder -> the file manager, a text file -> the editor
        given, s["path"] = s["path"], resolve(desk, s["path"])
        path = s["path"]
        # Judged by name, not by existence: an earlier write_file step may create it.
        text = (mimetypes.guess_type(path)[0] or "").startswith("text/") or path.lower().endswith(TEXT_EXTS)
        if not (text or os.path.isdir(path) or os.path.isfile(path) and "." not in os.path.basename(path)):
            raise BadRequest(f"cannot open {path!r}: open a folder or a text file ({', '.join(TEXT_EXTS)}).")
        if visible_in_home(desk, path) is None:  # the editor and file manager take visible paths only
            raise BadRequest(f"cannot open {path!r}: setup opens no hidden files or folders.")
        harmless(desk, path, given)
    elif s["type"] == "write_file":
        given = s["path"]
        s["path"], s["content"] = resolve(desk, given), _str(s, "content", MAX_BODY, empty=True)
        if os.path.isdir(s["path"]):
            raise BadRequest(f"cannot write {s['path']!r}: it is a folder.")
        if visible_in_home(desk, s["path"]) is None:  # ~/.bashrc, ~/.config/...: code other programs run
            raise BadRequest(f"cannot write {s['path']!r}: setup writes no hidden files or folders.")
        harmless(desk, s["path"], given)
        if len(s["path"].encode()) > 4000 or any(len(c.encode()) > 255 for c in s["path"].split(os.sep)):
            raise BadRequest(f"cannot write {given!r}: a name longer than 255 bytes, or a path longer than 4000.")
        if desktop_entry(s["content"]):
            raise BadRequest(f"cannot write {given!r}: its content has a [Desktop Entry] header, which makes "
                             "a file the file manager runs.")
    else:
        _number(s, "seconds", 0, 30, integer=False)
    return s


def run_step(desk: Desktop, s: dict, deadline: float = float("inf")) -> dict:
    t = s["type"]
    if "path" in s:  # again: an earlier step may have moved a symlink that points out onto its way
        s["path"] = harmless(desk, resolve(desk, s["path"]))
    if t == "open":  # decided now, after the steps before it ran
        s["argv"] = ["pcmanfm" if os.path.isdir(s["path"]) else "mousepad", s["path"]]
    if t in ("launch", "open"):
        return {"type": t, "pid": _server().spawn(desk, runnable(desk, s["argv"])).pid}
    if t == "write_file":
        write_file(desk, s["path"], s["content"].encode())
        return {"type": t, "bytes": len(s["content"].encode())}
    if t == "sleep":
        time.sleep(max(0.0, min(s["seconds"], deadline - time.monotonic())))
        return {"type": t}
    code, out = run_command(desk, s["argv"], max(0.1, min(s["timeout"], deadline - time.monotonic())))
    return {"type": t, "exit_code": code, "stdout": out[:4096]}  # exit_code None = timed out


def write_file(desk: Desktop, path: str, data: bytes) -> None:
    """Write `data` to `path` (checked inside HOME) whole or not at all: into a new file beside
    it, then renamed over it, so a failure (a full disk, a folder in the way) never leaves the
    target truncated. A symlink put at `path` since the check is replaced by the file, never
    followed; a folder or FIFO there is refused, as when the request was checked."""
    if visible_in_home(desk, path) is None:
        raise BadRequest(f"cannot write {path!r}: setup writes no hidden files or folders.")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise BadRequest(f"cannot write {path!r}: it is not a regular file.")
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".write-")  # O_EXCL, mode 0600
        with open(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as e:
        if tmp:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise BadRequest(f"cannot write {path!r} ({e.strerror}).")


# -------------------------------------------------------------------------------------------------
# The whole request: checked before anything runs (time, HOME quota), then run


def usage(path: str, limit: int = HOME_QUOTA) -> int:
    """What `path` and everything below it count against HOME_QUOTA: the bytes of every regular
    file plus ENTRY_BYTES per entry (so a million empty files count too), symlinks not followed.
    Counting stops once it passes `limit`, so a huge HOME costs no more than a full one to measure."""
    total, todo = 0, [path]
    while todo and total <= limit:
        p = todo.pop()
        try:
            st = os.lstat(p)
        except OSError:
            continue
        total += ENTRY_BYTES + (st.st_size if stat.S_ISREG(st.st_mode) else 0)
        if stat.S_ISDIR(st.st_mode):
            with contextlib.suppress(OSError):
                todo += [os.path.join(p, n) for n in os.listdir(p)]
    return total


def _growth(desk: Desktop, item: dict, carried: int) -> tuple[int, int]:
    """(The most this step can add to HOME, what it moves), judged from the files as they are now
    plus `carried` (what earlier steps of the request may have added or moved: all of it may have
    landed in this step's sources). cp copies its sources, sort -o and uniq write at most their
    inputs, mkdir/touch add entries, write_file adds its bytes plus an entry per path part; mv adds
    nothing but can move data into a later step's source."""
    def entries(p: str) -> int:
        return ENTRY_BYTES * len(os.path.normpath(p).split(os.sep))
    if item["type"] == "write_file":
        return len(item["content"].encode()) + entries(os.path.relpath(item["path"], os.path.realpath(desk.home))), 0
    argv = item.get("argv") or ["none"]
    if item["type"] != "command" or not writes(argv):
        return 0, 0
    plain = [a for a in argv[1:] if not a.startswith("-") or a == "-"]
    if argv[0] in ("mkdir", "touch"):
        return sum(entries(a) for a in plain), 0
    sources = sum(usage(os.path.join(desk.home, a)) for a in (plain[:-1] if argv[0] in ("cp", "mv") else plain))
    return (0, sources) if argv[0] == "mv" else (sources + carried + ENTRY_BYTES, 0)


def plan(desk: Desktop, items: list[dict], what: str) -> None:
    """BadRequest unless the whole request fits: its sleeps and command timeouts within
    REQUEST_SECONDS (setup), and HOME within HOME_QUOTA after every step, counting each step's
    worst case (so `cp -r a b`, `cp -r b a`, ... which grows HOME like the Fibonacci numbers, is
    refused before the first copy)."""
    if what == "step":
        seconds = sum(s.get("seconds", 0) + (s["timeout"] if s["type"] == "command" else 0) for s in items)
        if seconds > REQUEST_SECONDS:
            raise BadRequest(f"this setup's sleeps and command timeouts add up to {seconds:g} s; one request "
                             f"may take at most {REQUEST_SECONDS:g} s (give its commands shorter timeouts).")
    _in_the_way(desk, items, what)
    total, carried = None, 0
    for k, item in enumerate(items):
        grow, moved = _growth(desk, item, carried)
        if not grow and not moved:
            continue
        total = usage(desk.home) if total is None else total
        total, carried = total + grow, carried + grow + moved
        if total > HOME_QUOTA:
            raise BadRequest(f"{what} {k + 1} could take HOME to {total / 2**20:.1f} MiB, past its quota of "
                             f"{HOME_QUOTA >> 20} MiB; nothing was run.", 413)


def _sort_output(desk: Desktop, argv: list[str]) -> list[str]:
    """[the real path `sort` writes to], as getopt reads -o: the rest of its token (-roout), or else
    the next argument."""
    for i, a in enumerate(argv[1:], 1):
        if a[:1] == "-" and a[1:2] != "-" and "o" in a:
            out = a[a.index("o") + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return [visible_in_home(desk, out) or os.path.realpath(desk.home)] if out else []
    return []


def _in_the_way(desk: Desktop, items: list[dict], what: str) -> None:
    """BadRequest if a step would find, when it runs, a file where it needs a folder (or the other
    way round) that an earlier step of the same request made: write_file a, then write_file a/b;
    mkdir x.txt, then write_file x.txt; touch d, then pcmanfm d. Follows what each step leaves
    (write_file, mkdir, touch, cp/mv targets, sort -o/uniq outputs), so such a request is refused
    before anything runs instead of stopping halfway."""
    home, kind = os.path.realpath(desk.home), {}  # real path -> "file" | "dir", as earlier steps leave it

    def is_dir(p: str) -> bool:
        return kind[p] == "dir" if p in kind else os.path.isdir(p)

    def is_file(p: str) -> bool:
        return kind[p] == "file" if p in kind else os.path.lexists(p) and not os.path.isdir(p)

    def parents(p: str) -> list[str]:
        out = []
        while _under(p, home) and p != home:
            p = os.path.dirname(p)
            out.append(p)
        return out

    def make(p: str, k: str) -> None:
        kind.update(dict.fromkeys(parents(p), "dir"))
        kind[p] = k
    for n, item in enumerate(items, 1):
        argv = item.get("argv") or [""]
        flags = "".join(a[1:] for a in argv[1:] if a[:1] == "-" and a[1:2] != "-")
        plain = [visible_in_home(desk, a) or home for a in argv[1:] if not a.startswith("-") or a == "-"]
        if item["type"] == "write_file":
            targets, need = [(item["path"], "file")], None
        elif argv[0] == "pcmanfm" and item["type"] == "launch":
            targets, need = [], next((p for p in plain if is_file(p)), None)
        elif item["type"] != "command" or not writes(argv):
            continue
        elif argv[0] in ("cp", "mv") and plain:
            dest, need = plain[-1], None
            targets = [(dest if "T" in flags or not is_dir(dest) else os.path.join(dest, os.path.basename(s)),
                        "dir" if is_dir(s) else "file") for s in plain[:-1]]
        else:  # mkdir, touch, sort -o, uniq IN OUT
            outs = plain if argv[0] in ("mkdir", "touch") else plain[1:2] if argv[0] == "uniq" else _sort_output(desk, argv)
            targets, need = [(p, "dir" if argv[0] == "mkdir" else "file") for p in outs if not is_dir(p)], None
        for p, k in targets:
            if (k == "file" and is_dir(p)) or any(is_file(a) for a in parents(p)):
                need = p
                break
            make(p, k)
        if need:
            raise BadRequest(f"{what} {n} would find a file where it needs a folder, or a folder where it "
                             f"writes a file: {os.path.relpath(need, home)!r}; nothing was run.")


def _guarded(desk: Desktop, item: dict, k: int, what: str, run):
    """Run one step or check whose worst case plan() accepted; measure HOME again around a writing
    one (plan() cannot see what processes outside this request do meanwhile), and say which step
    stopped the request if it is refused now."""
    try:
        grow, _ = _growth(desk, item, 0)
        if grow and usage(desk.home) + grow > HOME_QUOTA:
            raise BadRequest(f"it could take HOME past its quota of {HOME_QUOTA >> 20} MiB", 413)
        result = run()
        if grow and usage(desk.home) > HOME_QUOTA:
            raise BadRequest(f"HOME went past its quota of {HOME_QUOTA >> 20} MiB", 413)
        return result
    except BadRequest as e:
        ran = f"{what}s 1-{k} ran" if k else f"no {what} ran"
        raise BadRequest(f"{what} {k + 1} was refused when it came to run ({str(e).rstrip('.')}); {ran}.", e.status)


def setup(desk: Desktop, body) -> dict:
    """POST /setup: every step checked, and the request as a whole planned, before any step runs."""
    steps = [check_step(desk, s) for s in _items(body, "/setup", "steps")]
    plan(desk, steps, "step")
    deadline = time.monotonic() + REQUEST_SECONDS
    results = [_guarded(desk, s, k, "step", lambda s=s: run_step(desk, s, deadline)) for k, s in enumerate(steps)]
    if any(s["type"] in ("launch", "open") for s in steps):
        # A mapped window is not yet a ready one: the file manager lists its folder and takes
        # the keyboard focus a moment later. The episode (and its first screenshot) should
        # start with the app as a person would find it. (Without this, CI once typed a file
        # name into a pcmanfm whose listing was still empty.)
        time.sleep(APP_SETTLE)
    return {"ok": True, "results": results}


def runnable(desk: Desktop, argv: list[str]) -> list[str]:
    """argv checked once more right before it starts, its program as an absolute path."""
    argv, exe = check_args(desk, argv), program(desk, argv[0])
    if exe is None:
        raise BadRequest(f"program {argv[0]!r} is not installed on this VM.")
    return [exe] + argv[1:]


def run_command(desk: Desktop, argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Run argv (no shell) in HOME -> (exit code, or None on timeout; the start of stdout)."""
    argv = runnable(desk, argv)
    with tempfile.TemporaryFile() as out:
        try:
            code = subprocess.run(argv, cwd=desk.home, env=desk.env, stdin=subprocess.DEVNULL,
                                  stdout=out, stderr=subprocess.DEVNULL, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = None
        out.seek(0)
        return code, out.read(MAX_OUTPUT).decode("utf-8", "replace")


def check_check(desk: Desktop, c) -> dict:
    c = _obj(c, "check", CHECK_FIELDS)
    if "path" in c:
        c["path"] = resolve(desk, c["path"])
    if c["type"] == "file_contains" and ("text" in c) == ("regex" in c):
        raise BadRequest("a 'file_contains' check needs exactly one of 'text' or 'regex'.")
    if "text" in c:
        _str(c, "text", MAX_TEXT)
    if "stdout" in c:
        _str(c, "stdout", MAX_TEXT, empty=True)
    for key in ("regex", "title"):
        if key in c:
            c[key] = _regex(c, key)
    if not isinstance(c.get("exists", True), bool):
        raise BadRequest("'exists' must be true or false.")
    if c["type"] == "command":
        c["argv"] = _argv(desk, c)
        c["timeout"] = _number(c, "timeout", 0.1, 60, default=10, integer=False)
        if "exit_code" in c:
            _number(c, "exit_code", 0, 255)
    return c


def _search(pattern: re.Pattern, texts: list[str]) -> bool | None:
    """Does `pattern` occur in any of `texts`? None if it did not finish within REGEX_SECONDS.

    Python's re can take exponential time on patterns like `(a+)+$`, and a running match cannot be
    interrupted: one such regex in a task file would freeze this server (and its desktop) for good.
    So the match runs in a forked child that we kill when time is up. Forking shares the text
    without copying it and costs about 2 ms; the child touches nothing but the pattern and the
    texts, and leaves with os._exit (no cleanup of the parent's X connection or sockets). Forking
    from this threaded server is safe because every request but /health holds the server's lock,
    and /health forks nothing.
    """
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # out of processes or memory: the check cannot be run, so it fails
        os.close(r)
        os.close(w)
        return None
    if pid == 0:  # the child
        try:
            os.close(r)
            os.write(w, b"1" if any(pattern.search(t) for t in texts) else b"0")
        finally:
            os._exit(0)
    os.close(w)
    answer = b""
    try:
        poll = select.poll()  # not select(): it breaks on descriptors >= 1024
        poll.register(r, select.POLLIN)
        if poll.poll(REGEX_SECONDS * 1000):
            answer = os.read(r, 1)  # b"" if the child died without answering
    finally:
        os.close(r)
        if not answer:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return None if not answer else answer == b"1"


def _regex_info(found: bool | None) -> str:
    return f"the regex did not finish within {REGEX_SECONDS:g} s and was stopped" if found is None else ""


def run_check(desk: Desktop, c: dict, deadline: float = float("inf")) -> tuple[bool, str]:
    """-> (passed, a short human-readable reason)."""
    t, exists = c["type"], c.get("exists", True)
    if "path" in c:  # again, as in run_step: a command check before this one may have moved things
        c["path"] = resolve(desk, c["path"])
    if t == "file_exists":
        found = os.path.exists(c["path"])
        return found == exists, "exists" if found else "does not exist"
    if t == "file_contains":
        if not os.path.isfile(c["path"]):
            return False, "the file does not exist"
        with open(c["path"], "rb") as f:
            text = f.read(MAX_READ).decode("utf-8", "replace")
        found = c["text"] in text if "text" in c else _search(c["regex"], [text])
        return bool(found), _regex_info(found) or f"{'found' if found else 'not found'} in {len(text)} characters"
    if t == "window_exists":
        titles = [title for _, title in _server().app_windows(desk)]
        found = _search(c["title"], titles)
        return found is not None and found == exists, (_regex_info(found) or f"windows: {titles}")[:500]
    code, out = run_command(desk, c["argv"], max(0.1, min(c["timeout"], deadline - time.monotonic())))
    if code is None:
        return False, "timed out"
    # The exit code must be `exit_code`; when not given, 0 -- unless the check is about stdout.
    want = c.get("exit_code", None if ("stdout" in c or "regex" in c) else 0)
    ok = want in (None, code) and c.get("stdout", "") in out
    found = _search(c["regex"], [out]) if ("regex" in c and ok) else True
    return ok and bool(found), _regex_info(found) or f"exit {code}, stdout {out[:200]!r}"


def evaluate(desk: Desktop, body) -> dict:
    checks = [check_check(desk, c) for c in _items(body, "/evaluate", "checks", ("conj",))]
    conj = "and" if body.get("conj") is None else body["conj"]  # null counts as absent; [] or 0 do not
    if conj not in ("and", "or"):
        raise BadRequest("'conj' must be 'and' or 'or'.")
    plan(desk, checks, "check")  # the HOME quota, for checks that run cp/mv/mkdir/touch
    # Checks only look (their writers aside), so a request past its time budget is not refused but
    # cut short: the checks left fail and say why, and the desktop is free again.
    deadline, details = time.monotonic() + REQUEST_SECONDS, []
    for k, c in enumerate(checks):
        passed, info = (_guarded(desk, c, k, "check", lambda c=c: run_check(desk, c, deadline))
                        if time.monotonic() < deadline else (False, f"not run: the request's {REQUEST_SECONDS:g} s were spent"))
        details.append({"type": c["type"], "passed": passed, "info": info})
    passed = [d["passed"] for d in details]
    # ALGO: the OSWorld-style task score: "and" = 1 iff every check passes, "or" = 1 iff any does.
    return {"score": float(all(passed) if conj == "and" else any(passed)), "details": details}


def _server():
    """vm_server, imported on first use: it imports this file at its top, so we cannot import it
    at ours. (Run as a script it registers itself as `vm_server` first, so this is that same copy.)"""
    import vm_server
    return vm_server
