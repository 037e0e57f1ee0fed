"""vm/tasks.py: POST /setup and POST /evaluate on a desktop: typed steps and checks, checked and run.

A task file (tasks/*.json) prepares the desktop with typed setup steps (launch, open, sleep,
write_file, command) and scores an episode with typed checks (file_exists, file_contains,
window_exists, command). STEP_FIELDS and CHECK_FIELDS are the one schema of both: every field each
type takes, its JSON type, and whether it is required. The server checks requests against them
here, and env.load_tasks checks task files against them before a run starts.

Every step and check passes vm/rules.py (the allow-list, each program's arguments, paths inside
HOME) when the request arrives; on top of that a request is checked whole before anything runs:
every step, the sum of its sleeps and command timeouts (REQUEST_SECONDS) and HOME's worst-case size
after every step (HOME_QUOTA). A step is refused when it comes to run only if something outside
the request changed HOME meanwhile; the error then says which steps ran.
vm_server.py imports this file; copy it into your VM with vm/rules.py and vm/procs.py (nothing here
runs on its own). Tested by tests/test_task_rules.py, tests/test_hostile_input.py, tests/test_tasks.py.

Where this departs from OSWorld: its setup/evaluate run arbitrary shell commands and per-app Python
getters; ours are a handful of generic, checked steps, so task files stay small and readable.
"""

from __future__ import annotations

import contextlib
import mimetypes
import os
import re
import select
import signal
import stat
import subprocess
import tempfile
import time

from vm.procs import DesktopState, app_windows, spawn
from vm.settle import watcher
from vm.rules import (ENTRY_BYTES, HOME_QUOTA, MAX_BODY, BadRequest, all_unicode, check_number, check_object,
                      check_program, check_regex, check_str, desktop_entry, harmless, inside, resolve, runnable,
                      visible_in_home, writes)

# -------------------------------------------------------------------------------------------------
# Limits

MAX_MATCH = 2000         # longest 'text' / 'stdout' a check looks for
MAX_ITEMS = 64           # setup steps / evaluator checks per request
MAX_READ = 10 << 20      # file_contains reads at most this much of a file
MAX_OUTPUT = 64 << 10    # command stdout kept (it goes to a temp file, never into our memory)
REGEX_SECONDS = 2.0      # an evaluator regex that runs longer than this fails its check (see _search)
REQUEST_SECONDS = 120.0  # one /setup's sleeps and command timeouts together (and one /evaluate's run time)
TEXT_EXTS = (".txt", ".md", ".csv", ".json", ".log", ".py", ".sh", ".conf", ".ini", ".xml", ".html")


# -------------------------------------------------------------------------------------------------
# POST /setup and POST /evaluate

NUMBER = (int, float)  # a JSON number; the checks refuse a bool, which Python counts as an int
# type -> {field: (JSON type(s), required)}: the schema of setup steps and evaluator checks.
STEP_FIELDS = {
    "launch": {"argv": (list, True)},
    "open": {"path": (str, True)},
    "sleep": {"seconds": (NUMBER, True)},
    "write_file": {"path": (str, True), "content": (str, True)},
    "command": {"argv": (list, True), "timeout": (NUMBER, False)},
}
CHECK_FIELDS = {
    "file_exists": {"path": (str, True), "exists": (bool, False)},
    "file_contains": {"path": (str, True), "text": (str, False), "regex": (str, False)},
    "window_exists": {"title": (str, True), "exists": (bool, False)},
    "command": {"argv": (list, True), "stdout": (str, False), "regex": (str, False),
                "exit_code": (int, False), "timeout": (NUMBER, False)},
}


def _items(body, what: str, key: str, optional=()) -> list:
    body = check_object(body, f"the {what} body", None, (key,), optional)
    if not isinstance(body[key], list) or not 0 < len(body[key]) <= MAX_ITEMS:
        raise BadRequest(f"'{key}' must be a list of 1 to {MAX_ITEMS} items.")
    all_unicode(body)
    return body[key]


def check_step(desk: DesktopState, s) -> dict:
    s = check_object(s, "setup step", STEP_FIELDS)
    if s["type"] in ("launch", "command"):
        s["argv"] = check_program(desk, s)
        s["timeout"] = check_number(s, "timeout", 0.1, REQUEST_SECONDS, default=30, integer=False)
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
        s["path"], s["content"] = resolve(desk, given), check_str(s, "content", MAX_BODY, empty=True)
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
        check_number(s, "seconds", 0, 30, integer=False)
    return s


def run_step(desk: DesktopState, s: dict, deadline: float = float("inf")) -> dict:
    t = s["type"]
    if "path" in s:  # again: an earlier step may have moved a symlink that points out onto its way
        s["path"] = harmless(desk, resolve(desk, s["path"]))
    if t == "open":  # decided now, after the steps before it ran
        s["argv"] = ["pcmanfm" if os.path.isdir(s["path"]) else "mousepad", s["path"]]
    if t in ("launch", "open"):
        return {"type": t, "pid": spawn(desk, runnable(desk, s["argv"])).pid}
    if t == "write_file":
        write_file(desk, s["path"], s["content"].encode())
        return {"type": t, "bytes": len(s["content"].encode())}
    if t == "sleep":
        time.sleep(max(0.0, min(s["seconds"], deadline - time.monotonic())))
        return {"type": t}
    code, out = run_command(desk, s["argv"], max(0.1, min(s["timeout"], deadline - time.monotonic())))
    return {"type": t, "exit_code": code, "stdout": out[:4096]}  # exit_code None = timed out


def write_file(desk: DesktopState, path: str, data: bytes) -> None:
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


def _growth(desk: DesktopState, item: dict, carried: int) -> tuple[int, int]:
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


def plan(desk: DesktopState, items: list[dict], what: str) -> None:
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


def _sort_output(desk: DesktopState, argv: list[str]) -> list[str]:
    """[the real path `sort` writes to], as getopt reads -o: the rest of its token (-roout), or else
    the next argument."""
    for i, a in enumerate(argv[1:], 1):
        if a[:1] == "-" and a[1:2] != "-" and "o" in a:
            out = a[a.index("o") + 1:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return [visible_in_home(desk, out) or os.path.realpath(desk.home)] if out else []
    return []


def _in_the_way(desk: DesktopState, items: list[dict], what: str) -> None:
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
        while inside(p, home) and p != home:
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


def _guarded(desk: DesktopState, item: dict, k: int, what: str, run):
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


def setup(desk: DesktopState, body) -> dict:
    """POST /setup: every step checked, and the request as a whole planned, before any step runs."""
    steps = [check_step(desk, s) for s in _items(body, "/setup", "steps")]
    plan(desk, steps, "step")
    apps = any(s["type"] in ("launch", "open") for s in steps)
    if apps:
        watcher(desk).arm()
    started = time.monotonic()
    deadline = started + REQUEST_SECONDS
    results = [_guarded(desk, s, k, "step", lambda s=s: run_step(desk, s, deadline)) for k, s in enumerate(steps)]
    if not apps:
        return {"ok": True, "results": results}
    # A mapped window is not yet a ready one: the file manager lists its folder and takes the
    # keyboard focus a moment later. The episode (and its first screenshot) should start with the
    # app as a person would find it, so a setup that started one returns once the desktop has
    # settled (vm/settle.py; this was a fixed second). (Without it, a file name typed at once can
    # land in a pcmanfm whose listing is still empty.)
    return {"ok": True, "results": results, "settle": watcher(desk).settle(started)}


def run_command(desk: DesktopState, argv: list[str], timeout: float) -> tuple[int | None, str]:
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


def check_check(desk: DesktopState, c) -> dict:
    c = check_object(c, "check", CHECK_FIELDS)
    if "path" in c:
        c["path"] = resolve(desk, c["path"])
    if c["type"] == "file_contains" and ("text" in c) == ("regex" in c):
        raise BadRequest("a 'file_contains' check needs exactly one of 'text' or 'regex'.")
    if "text" in c:
        check_str(c, "text", MAX_MATCH)
    if "stdout" in c:
        check_str(c, "stdout", MAX_MATCH, empty=True)
    for key in ("regex", "title"):
        if key in c:
            c[key] = check_regex(c, key)
    if not isinstance(c.get("exists", True), bool):
        raise BadRequest("'exists' must be true or false.")
    if c["type"] == "command":
        c["argv"] = check_program(desk, c)
        c["timeout"] = check_number(c, "timeout", 0.1, 60, default=10, integer=False)
        if "exit_code" in c:
            check_number(c, "exit_code", 0, 255)
    return c


def _search(pattern: re.Pattern, texts: list[str]) -> bool | None:
    """Does `pattern` occur in any of `texts`? None if it did not finish within REGEX_SECONDS.

    Python's re can take exponential time on patterns like `(a+)+$`, and a running match cannot be
    interrupted: one such regex in a task file would freeze this server (and its desktop) for good.
    So the match runs in a forked child that we kill when time is up. Forking shares the text
    without copying it and is cheap; the child touches nothing but the pattern and the
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


def run_check(desk: DesktopState, c: dict, deadline: float = float("inf")) -> tuple[bool, str]:
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
        titles = [title for _, title in app_windows(desk)]
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


def evaluate(desk: DesktopState, body) -> dict:
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

