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
    file (.bashrc, .config/...): shells and GTK run code from those.
Where this departs from OSWorld: its setup/evaluate run arbitrary shell commands and per-app Python
getters; ours are a handful of generic, checked steps, so task files stay small and readable.
"""

from __future__ import annotations

import mimetypes
import os
import re
import select
import shutil
import signal
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
# No path may name a hidden file or folder (.bashrc, .config/...): shells and GTK run code from them.
# Left out on purpose: sha256sum/md5sum -c (reads the files its list names, anywhere), diff -r
# (follows symlinks), find -L, grep -R, cp -s.
# xdotool runs only window commands: no input (key, type, click), no exec, no behave. xterm takes
# -T/-title/-geometry/-hold and `-e PROG ARGS` with PROG allow-listed and ARGS under PROG's rule.
# A program added with --allow-exec is the operator's choice and takes any arguments.
ARGV_RULES = {
    **dict.fromkeys(("galculator", "xclock", "xeyes", "xcalc"), "none"), "xterm": "xterm",
    **dict.fromkeys(("mousepad", "pcmanfm"), "paths"),
    **dict.fromkeys(("echo", "sleep", "true", "false", "basename", "dirname", "wmctrl"), "free"),
    "ls": "-l -a -A -1 -R -h -t -r -S -d -F", "cat": "-n -b -s -A -E -T", "wc": "-l -w -c -m -L",
    "grep": "-q -c -i -v -n -l -L -w -x -E -F -o -s -h -H -r -e -m", "head": "-n -c -q", "tail": "-n -c -q",
    "test": "-e -f -d -s -r -w -x -L -h -n -z -nt -ot -eq -ne -lt -le -gt -ge -a -o", "stat": "-c -t",
    "sha256sum": "-b -t", "md5sum": "-b -t", "mkdir": "-p -v", "touch": "-c -a -m", "bc": "-l -q",
    "cp": "-r -R -a -f -n -p -v -T -u", "mv": "-f -n -v -T -u", "date": "-u -R -I -d", "uniq": "-c -d -u -i",
    "find": "-name -iname -type -maxdepth -mindepth -path -ipath -size -empty -print -newer -mtime -mmin -not -a -o",
    "sort": "-r -n -u -f -b -h -V -s -k -t -o", "diff": "-u -q -N -i -w -b -B -s", "cmp": "-s -l -b",
    "xdotool": "xdotool",
}
XDOTOOL_OK = frozenset("search getactivewindow getwindowfocus getwindowname getwindowpid getwindowgeometry "
                       "getdisplaygeometry getmouselocation windowactivate windowfocus windowraise windowmove "
                       "windowsize windowminimize windowmap windowunmap windowclose get_desktop get_num_desktops "
                       "get_desktop_for_window get_desktop_viewport sleep".split())
XDOTOOL_DENY = frozenset("exec behave behave_screen_edge key keydown keyup type click mousedown mouseup mousemove "
                         "mousemove_relative selectwindow set_window windowkill windowreparent set_desktop "
                         "set_num_desktops set_desktop_for_window set_desktop_viewport".split())


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


def _str(d: dict, key: str, max_len: int, empty=False) -> str:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > max_len or (not v and not empty) or "\0" in v:
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
            and all(isinstance(a, str) and "\0" not in a and len(a) <= 4096 for a in argv)):
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
        return list(argv[:i + 1]) + runnable(desk, argv[i + 1:])
    if rule == "xdotool":
        if len(argv) < 2 or argv[1] not in XDOTOOL_OK or XDOTOOL_DENY & set(argv):
            raise BadRequest(f"xdotool may only run window commands here ({', '.join(sorted(XDOTOOL_OK))}); "
                             "no input, no exec, no behave.")
        return list(argv)
    options = set(rule.split()) if rule.startswith("-") else set()
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
        out.append(real if rule == "paths" else a)
    return out


def resolve(desk: Desktop, p) -> str:
    """'rel' and '~/rel' are under HOME; absolute paths must resolve (symlinks too) inside HOME."""
    if not isinstance(p, str) or not p or len(p) > 4096 or "\0" in p:
        raise BadRequest("'path' must be a non-empty string.")
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
    return body[key]


def check_step(desk: Desktop, s) -> dict:
    s = _obj(s, "setup step", STEP_FIELDS)
    if s["type"] in ("launch", "command"):
        s["argv"] = _argv(desk, s)
        s["timeout"] = _number(s, "timeout", 0.1, 120, default=30, integer=False)
    elif s["type"] == "open":  # a folder -> the file manager, a text file -> the editor
        s["path"] = path = resolve(desk, s["path"])
        # Judged by name, not by existence: an earlier write_file step may create it.
        text = (mimetypes.guess_type(path)[0] or "").startswith("text/") or path.lower().endswith(TEXT_EXTS)
        if not (text or os.path.isdir(path) or os.path.isfile(path) and "." not in os.path.basename(path)):
            raise BadRequest(f"cannot open {path!r}: open a folder or a text file ({', '.join(TEXT_EXTS)}).")
        if visible_in_home(desk, path) is None:  # the editor and file manager take visible paths only
            raise BadRequest(f"cannot open {path!r}: setup opens no hidden files or folders.")
    elif s["type"] == "write_file":
        s["path"], s["content"] = resolve(desk, s["path"]), _str(s, "content", MAX_BODY, empty=True)
        if os.path.isdir(s["path"]):
            raise BadRequest(f"cannot write {s['path']!r}: it is a folder.")
        if visible_in_home(desk, s["path"]) is None:  # ~/.bashrc, ~/.config/...: code other programs run
            raise BadRequest(f"cannot write {s['path']!r}: setup writes no hidden files or folders.")
    else:
        _number(s, "seconds", 0, 30, integer=False)
    return s


def run_step(desk: Desktop, s: dict) -> dict:
    t = s["type"]
    if "path" in s:  # again: an earlier step may have moved a symlink that points out onto its way
        s["path"] = resolve(desk, s["path"])
    if t == "open":  # decided now, after the steps before it ran
        s["argv"] = ["pcmanfm" if os.path.isdir(s["path"]) else "mousepad", s["path"]]
    if t in ("launch", "open"):
        return {"type": t, "pid": _server().spawn(desk, runnable(desk, s["argv"])).pid}
    if t == "write_file":
        if visible_in_home(desk, s["path"]) is None:
            raise BadRequest(f"cannot write {s['path']!r}: setup writes no hidden files or folders.")
        if os.path.lexists(s["path"]) and not os.path.isfile(s["path"]):  # a FIFO would block us forever
            raise BadRequest(f"cannot write {s['path']!r}: it is not a regular file.")
        os.makedirs(os.path.dirname(s["path"]), exist_ok=True)
        # O_NOFOLLOW: a symlink put there since the check is refused, not followed; O_NONBLOCK: so
        # is a FIFO (no reader: ENXIO), instead of holding the request lock until one comes
        try:
            fd = os.open(s["path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise BadRequest(f"cannot write {s['path']!r} ({e.strerror}).")
        with open(fd, "w", encoding="utf-8") as f:
            f.write(s["content"])
        return {"type": t, "bytes": len(s["content"].encode())}
    if t == "sleep":
        time.sleep(s["seconds"])
        return {"type": t}
    code, out = run_command(desk, s["argv"], s["timeout"])  # exit_code None = timed out
    return {"type": t, "exit_code": code, "stdout": out[:4096]}


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


def run_check(desk: Desktop, c: dict) -> tuple[bool, str]:
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
    code, out = run_command(desk, c["argv"], c["timeout"])
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
    details = [dict(zip(("type", "passed", "info"), (c["type"], *run_check(desk, c)))) for c in checks]
    passed = [d["passed"] for d in details]
    # ALGO: the OSWorld-style task score: "and" = 1 iff every check passes, "or" = 1 iff any does.
    return {"score": float(all(passed) if conj == "and" else any(passed)), "details": details}


def _server():
    """vm_server, imported on first use: it imports this file at its top, so we cannot import it
    at ours. (Run as a script it registers itself as `vm_server` first, so this is that same copy.)"""
    import vm_server
    return vm_server
