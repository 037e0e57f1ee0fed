"""vm/rules.py: what a request may ask of a desktop, who may ask it, and the checks that say so.

Who: `vm_token`, each VM's bearer token derived from the trainer's one secret and the VM's URL.
What: the request's JSON (`check_object`, `check_number`, `check_str`, `check_regex`: exact fields, typed
values, Unicode text), the paths it names (`resolve`, `visible_in_home`, `harmless`) and the
programs it may run with which arguments (DEFAULT_ALLOW, ARGV_RULES, `check_args`, `runnable`).
vm/tasks.py runs the steps and checks these rules let through, and vm_server.py checks POST
/action's body with the same JSON checks; copy this file into your VM beside them (nothing here
runs on its own). Tested by tests/test_task_rules.py and tests/test_hostile_input.py.

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
  - xdotool runs exactly one window command, `date` only prints.
(vm/tasks.py adds the request as a whole: its time budget and HOME's quota after every step.)
Where this departs from OSWorld: its setup/evaluate run arbitrary shell commands; ours run
allow-listed programs whose every argument is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import shutil
from urllib.parse import urlsplit

from vm.procs import DesktopState

# -------------------------------------------------------------------------------------------------
# Who may ask: one token per VM


def vm_token(secret: str, url: str) -> str:
    """The bearer token of the VM at `url`: HMAC-SHA256 of its URL under the trainer's secret, hex.

    The trainer holds one secret (--token / $VM_TOKEN) and sends each VM its own token, so a VM
    (or an agent inside it that reads its server's token) holds nothing that opens another VM.
    `python vm_server.py --token-for URL` prints it for the VM you start. The URL counts as the
    trainer writes it in --vms, up to case of scheme and host and a trailing slash."""
    u = urlsplit(url.strip())
    canonical = f"{u.scheme.lower()}://{u.netloc.lower()}{u.path.rstrip('/')}"
    return hmac.new(secret.encode(), canonical.encode(), hashlib.sha256).hexdigest()


# -------------------------------------------------------------------------------------------------
# Limits, the allow-list and each program's argument rule

MAX_BODY = 1 << 20       # 1 MiB per request body: room for a write_file, not for abuse
HOME_QUOTA = 64 << 20    # what HOME may hold after any step of setup/evaluate (see vm.tasks.usage())
ENTRY_BYTES = 4096       # what each file, folder or link costs against HOME_QUOTA besides its bytes
MAX_TREE = HOME_QUOTA // ENTRY_BYTES  # cp/mv refuse a folder with more entries (a HOME in quota has fewer)
DEFAULT_ALLOW = frozenset(
    "xterm mousepad galculator pcmanfm xclock xeyes xcalc ls cat grep wc head tail test stat "
    "sha256sum md5sum mkdir touch cp mv echo sleep true false xdotool wmctrl bc date basename "
    "dirname find sort uniq diff cmp".split())
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
# (vm.tasks.plan), so they run only as `command` steps or checks, which the server waits for.
WRITERS = frozenset("cp mv mkdir touch".split())


class BadRequest(Exception):
    """A client mistake: answered with `status` and the message; the server keeps serving."""
    def __init__(self, msg: str, status: int = 400):
        super().__init__(msg)
        self.status = status


# -------------------------------------------------------------------------------------------------
# Validation: every field of a request is checked before anything runs


def check_object(d, what: str, table: dict | None = None, required=(), optional=()) -> dict:
    """A JSON object with exactly these fields (null counts as absent). With `table` (type ->
    {field: (JSON types, required)}, as actions.ACTION_FIELDS and vm.tasks.STEP_FIELDS), its "type"
    picks the fields; their values are checked by the caller."""
    if not isinstance(d, dict):
        raise BadRequest(f"{what} must be a JSON object.")
    if table is not None:
        if not isinstance(d.get("type"), str) or d["type"] not in table:  # a list/dict is unhashable
            raise BadRequest(f"{what} 'type' must be one of {list(table)}, got {d.get('type')!r}.")
        fields = table[d["type"]]
        what, required = f"a {d['type']!r} {what}", ("type", *(k for k, (_, req) in fields.items() if req))
        optional = tuple(k for k, (_, req) in fields.items() if not req)
    d = {k: v for k, v in d.items() if v is not None}
    unknown = sorted(set(d) - set(required) - set(optional))
    if unknown:
        raise BadRequest(f"{what} does not take {unknown}; its fields are {sorted({*required, *optional})}.")
    missing = [k for k in required if k not in d]
    if missing:
        raise BadRequest(f"{what} needs {missing}.")
    return d


def check_number(d: dict, key: str, lo, hi, default=None, integer=True):
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


def all_unicode(body) -> None:
    """BadRequest if any string in the JSON value `body`, keys included, is not Unicode text."""
    todo = [body]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo += list(v.keys()) + list(v.values())
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, str) and not _unicode(v):
            raise BadRequest("the request holds a string that is not valid Unicode text (a lone surrogate such as \\ud800).")


def check_str(d: dict, key: str, max_len: int, empty=False) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > max_len or (not v and not empty) or "\0" in v or not _unicode(v):
        raise BadRequest(f"'{key}' must be a {'' if empty else 'non-empty '}string of at most {max_len} characters.")
    return v


def check_regex(d: dict, key: str) -> re.Pattern:
    try:
        return re.compile(check_str(d, key, 500))
    except re.error as e:
        raise BadRequest(f"'{key}' is not a valid regular expression ({e}).")


def check_program(desk: DesktopState, d: dict) -> list[str]:
    """d["argv"]: an allow-listed program and arguments its rule accepts (see check_args)."""
    argv = d.get("argv")
    if not (isinstance(argv, list) and 0 < len(argv) <= 64
            and all(isinstance(a, str) and "\0" not in a and len(a) <= 4096 and _unicode(a) for a in argv)):
        raise BadRequest("'argv' must be a non-empty list of strings: the program and its arguments.")
    # A bare name only: '/tmp/x/ls' would pass a basename check and run anything.
    if argv[0] not in desk.allow:
        raise BadRequest(f"program {argv[0]!r} is not allowed; use one of {sorted(desk.allow)} or start the server with --allow-exec {argv[0]}.")
    runnable(desk, argv)  # refused now if it would be refused when it runs
    return argv


# -------------------------------------------------------------------------------------------------
# Paths inside HOME, and the programs a request may start


def program(desk: DesktopState, name: str) -> str | None:
    """The absolute path `name` runs as, found on PATH without relative or HOME entries: a file
    written into HOME (~/bin/ls, ./ls) must never become an allow-listed program."""
    home = os.path.realpath(desk.home)
    dirs = [d for d in desk.env.get("PATH", os.defpath).split(os.pathsep)
            if os.path.isabs(d) and not inside(os.path.realpath(d), home)]
    return shutil.which(name, path=os.pathsep.join(dirs))


def inside(real: str, home: str) -> bool:
    """Is the real path `real` the folder `home` or below it?"""
    return real == home or real.startswith(home + os.sep)


def visible_in_home(desk: DesktopState, p: str) -> str | None:
    """The real path of `p` (relative to HOME) if it lies inside HOME and no part of it below HOME
    is hidden (starts with '.'); else None."""
    home = os.path.realpath(desk.home)
    real = os.path.realpath(os.path.join(home, p))
    rel = os.path.relpath(real, home)
    if not inside(real, home) or (rel != "." and any(c.startswith(".") for c in rel.split(os.sep))):
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


def harmless(desk: DesktopState, real: str, given: str = "") -> str:
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


def _tree(desk: DesktopState, top: str) -> None:
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


def check_args(desk: DesktopState, argv: list[str]) -> list[str]:
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


def resolve(desk: DesktopState, p) -> str:
    """'rel' and '~/rel' are under HOME; absolute paths must resolve (symlinks too) inside HOME."""
    if not isinstance(p, str) or not p or len(p) > 4096 or "\0" in p or not _unicode(p):
        raise BadRequest("'path' must be a non-empty string of Unicode text.")
    full = desk.home if p == "~" else os.path.join(desk.home, p[2:] if p.startswith("~/") else p)
    real, home = os.path.realpath(full), os.path.realpath(desk.home)
    if not inside(real, home):
        raise BadRequest(f"path {p!r} is outside the desktop's home {home}; use a path inside it.")
    return real


def runnable(desk: DesktopState, argv: list[str]) -> list[str]:
    """argv checked once more right before it starts, its program as an absolute path."""
    argv, exe = check_args(desk, argv), program(desk, argv[0])
    if exe is None:
        raise BadRequest(f"program {argv[0]!r} is not installed on this VM.")
    return [exe] + argv[1:]

