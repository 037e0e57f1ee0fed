"""vm_server.py under hostile input: >= 500 generated bad requests against a real `--xvfb` desktop.

Run: python -m pytest -q tests/test_hostile_input.py      (~30 s; loopback only)

Every request below is one a well-behaved client never sends: malformed JSON, wrong types,
NaN/inf/huge/negative coordinates, 10 MB bodies, unknown action/step/check types and endpoints,
paths that leave HOME (../, absolute, ~/.., a symlink inside HOME that points out), programs and
arguments that would run code or touch files outside HOME through the allow-list (find -exec,
xterm -e, xdotool exec/type, sort --compress-program, date -f, diff --to-file, cp to /tmp, writes
to dot-files a shell or GTK would execute), header abuse (bad/negative/huge/non-ASCII
Content-Length, chunked bodies, short bodies, weird methods, broken request lines, oversized
headers) and missing or wrong tokens. Each goes over a fresh raw socket (so the bytes are exactly
what we wrote, not what `requests` would fix up) and must get a 4xx JSON {"error": "..."}.

Then nothing must have happened: the mouse is where we left it (xdotool on the desktop's DISPLAY),
HOME is byte-for-byte the same (a snapshot before and after), no new process runs under the
server, nothing appeared outside HOME, and /health answers as fast as before. A stalled client
(half a body, then silence) must not hold up anyone else. The generator is seeded: a failure
replays exactly. The long version (more requests, and waiting for the stalled client to be
dropped) is `python bench/hostile_vm.py`.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid

import pytest
import requests

from conftest import SERVER, start_vm_server, vm_call
from conftest import mouse

N_MIN = 500


# ------------------------------------------------------------------------------------------------
# Raw HTTP: the exact bytes, one connection per request


def http_bytes(method: str, path: str, body: bytes = b"", token: str | None = None, headers=(),
               content_length: str | None = "auto", version: str = "HTTP/1.1") -> bytes:
    lines = [f"{method} {path} {version}", "Host: 127.0.0.1", "Connection: close"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if content_length == "auto":
        content_length = str(len(body)) if body or method == "POST" else None
    if content_length is not None:
        lines.append(f"Content-Length: {content_length}")
    lines += list(headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def exchange(url: str, data: bytes, timeout: float = 15.0) -> list[tuple[int, dict, bytes]]:
    """Send `data`, read every response until the server closes -> [(status, headers, body)].
    The body goes out in chunks while we watch for an early answer (a 413 before a 10 MB body is
    all sent is correct; the server may then stop reading)."""
    host, port = url.split("//")[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        view = memoryview(data)
        try:
            for i in range(0, len(view), 1 << 16):
                s.sendall(view[i:i + (1 << 16)])
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed early; its answer is still in our buffer
        try:
            s.shutdown(socket.SHUT_WR)  # the request is complete: EOF after it
        except OSError:
            pass
        raw = b""
        try:
            while chunk := s.recv(1 << 16):
                raw += chunk
        except ConnectionResetError:
            pass  # whatever arrived before the reset is in `raw`
        return parse_responses(raw)
    finally:
        s.close()


def parse_responses(raw: bytes) -> list[tuple[int, dict, bytes]]:
    """Consecutive HTTP/1.x responses in `raw` (each with a Content-Length, as the server sends)."""
    out = []
    while raw.startswith(b"HTTP/"):
        head, sep, rest = raw.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
        n = int(headers.get("content-length", "0")) if headers.get("content-length", "0").isdigit() else 0
        out.append((int(lines[0].split()[1]), headers, rest[:n]))
        raw = rest[n:]
    return out


def is_json_4xx(resp: tuple[int, dict, bytes], head: bool = False) -> bool:
    status, headers, body = resp
    if not 400 <= status < 500 or not headers.get("content-type", "").startswith("application/json"):
        return False
    if head:
        return True
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, str) and err.endswith(".")


# ------------------------------------------------------------------------------------------------
# The generator: (name, bytes, is_head) for every hostile request


def hostile_requests(rng: random.Random, token: str, outside: str) -> list[tuple[str, bytes, bool]]:
    """`outside` is an empty folder outside HOME that must stay empty; HOME holds `out_link`
    (a symlink to it) and `etc_link` (a symlink to /etc), made by the caller."""
    reqs = []

    def post(name, path, body, **kw):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        reqs.append((name, http_bytes("POST", path, data, token, **kw), False))

    pwn = os.path.join(outside, "pwned")
    # -- valid bodies, the starting point of every mutation
    actions = [{"type": "move", "x": 10, "y": 10}, {"type": "click", "x": 10, "y": 10},
               {"type": "double_click", "x": 10, "y": 10}, {"type": "right_click", "x": 10, "y": 10},
               {"type": "drag", "x": 1, "y": 2, "x2": 3, "y2": 4}, {"type": "scroll", "direction": "up", "x": 5, "y": 5},
               {"type": "type", "text": "hello", "x": 5, "y": 5}, {"type": "key", "keys": ["ctrl", "a"]},
               {"type": "wait", "amount": 1}]
    steps = [{"type": "write_file", "path": "a.txt", "content": "x"}, {"type": "open", "path": "Documents"},
             {"type": "launch", "argv": ["xclock"]}, {"type": "command", "argv": ["ls"], "timeout": 5},
             {"type": "sleep", "seconds": 0.1}]
    checks = [{"type": "file_exists", "path": "notes.txt"}, {"type": "file_contains", "path": "notes.txt", "text": "x"},
              {"type": "window_exists", "title": "x"}, {"type": "command", "argv": ["ls"], "exit_code": 0}]

    # 1. malformed JSON (each cut checked to really be invalid)
    for path, body in [("/action", actions[0]), ("/setup", {"steps": steps[:2]}), ("/evaluate", {"checks": checks[:2]}),
                       ("/reset", {})]:
        text = json.dumps(body).encode()
        cuts = set()
        while len(cuts) < min(12, len(text) - 1):
            cuts.add(rng.randrange(1, len(text)))
        for c in sorted(cuts):
            try:
                json.loads(text[:c])
            except ValueError:
                post(f"json-cut {path} @{c}", path, text[:c])
        for junk in (b"{not json", b"\xff\xfe\x00garbage", b'{"type": "move\xff", "x": 1, "y": 1}', b"[" * 60000,
                     b'{"a":' * 30000, b"1" * 5000, b"'single'", b"{'type': 'move'}", b'{"type": "move",}', b"\x00" * 64):
            post(f"json-junk {path} {junk[:12]!r}", path, junk)

    # 2. wrong types, one field at a time
    wrong = {"x": ["5", 5.5, True, [], {}, 1e3], "y": ["5", 2.5, False, [1]], "x2": ["3", 3.5, True],
             "y2": ["4", [], 4.5], "text": [1, [], {}, True, "", "a\0b", "x" * 2001],
             "keys": ["ctrl", [], [1], [["a"]], ["a"] * 9, ["nokey"], [True]],
             "direction": ["in", 1, [], {}, "UP"], "amount": [0, 51, 1.5, "5", True, -1, 10**30],
             "type": [[], {}, 1, True, "MOVE", "move ", "Click"]}
    for a in actions:
        for k in a:
            for v in wrong.get(k, []):
                if a["type"] == "wait" and k == "amount" and v in (0,):
                    continue  # wait 0 s is valid
                post(f"wrong-type action {a['type']}.{k}={v!r:.20}", "/action", {**a, k: v})
        post(f"extra-field action {a['type']}", "/action", {**a, "button": "middle"})
    swrong = {"path": [1, [], {}, "", "a\0b", True], "content": [1, [], {}, True], "argv": ["ls -la", [], [1], [["ls"]],
              ["ls", 1], ["ls"] * 65, ["ls\0"], ["x" * 5000]], "seconds": ["1", -1, 31, True, [], 1e308],
              "timeout": [0, 121, "5", True, -1]}
    for s in steps:
        for k in s:
            for v in swrong.get(k, []):
                post(f"wrong-type step {s['type']}.{k}={v!r:.20}", "/setup", {"steps": [steps[0], {**s, k: v}]})
    cwrong = {"exists": ["yes", 1, []], "text": [1, [], ""], "title": [1, "(", "[a-", []], "exit_code": [-1, 256, "0", 1.5],
              "stdout": [1, []], "path": [1, [], ""]}
    for c in checks:
        for k in c:
            for v in cwrong.get(k, []):
                post(f"wrong-type check {c['type']}.{k}={v!r:.20}", "/evaluate", {"checks": [checks[0], {**c, k: v}]})
    for path, body in [("/setup", {"steps": "x"}), ("/setup", {"steps": {}}), ("/setup", {"steps": [1]}),
                       ("/setup", {"steps": []}), ("/setup", {"steps": [steps[4]] * 65}), ("/setup", []),
                       ("/setup", "steps"), ("/setup", 1), ("/setup", None), ("/setup", {"steps": steps[:1], "x": 1}),
                       ("/evaluate", {"checks": checks[:1], "conj": "xor"}), ("/evaluate", {"checks": checks[:1], "conj": []}),
                       ("/evaluate", {"checks": checks[:1], "conj": {}}), ("/evaluate", {"checks": checks[:1], "conj": 0}),
                       ("/evaluate", {"checks": []}), ("/evaluate", {"checks": [checks[0]] * 65}),
                       ("/evaluate", None), ("/evaluate", [checks[0]]), ("/action", None), ("/action", []),
                       ("/action", "move"), ("/action", 1), ("/reset", []), ("/reset", {"hard": True}), ("/reset", "x")]:
        post(f"wrong-body {path} {json.dumps(body)[:30]}", path, body)

    # 3. coordinates: NaN, inf, huge, negative, off screen (raw JSON, so NaN/Infinity go out as is)
    for t in ("move", "click", "double_click", "right_click", "drag", "scroll", "type"):
        for v in ("NaN", "Infinity", "-Infinity", "1e309", "-1", "-99999", "1280", "99999999999999999999999",
                  "9223372036854775808", "-9223372036854775809", "1.5", "1e2", "-0.0"):
            for k in ("x", "y") if t != "drag" else ("x", "x2", "y2"):
                a = dict(next(a for a in actions if a["type"] == t))
                body = json.dumps({**a, k: 0}).replace(f'"{k}": 0', f'"{k}": {v}').encode()
                post(f"coord {t}.{k}={v}", "/action", body)
    post("coord y=720", "/action", {"type": "click", "x": 0, "y": 720})

    # 4. 10 MB bodies (honest Content-Length), and one just over the limit
    big = b'{"type": "type", "text": "' + b"a" * (10 << 20) + b'"}'
    for path in ("/action", "/setup", "/evaluate", "/reset"):
        post(f"10MB {path}", path, big)
    post("1MiB+1", "/setup", b" " * ((1 << 20) + 1))

    # 5. unknown types and endpoints
    for t in ("rm", "exec", "eval", "shell", "python", "", " move", "move\u0000", "__proto__", "keydown", "Move", "screenshot"):
        post(f"unknown action {t!r}", "/action", {"type": t})
    for t in ("eval", "exec", "shell", "python", "download", "chmod", "symlink", "delete", "copy", "http", ""):
        post(f"unknown step {t!r}", "/setup", {"steps": [{"type": t, "argv": ["ls"], "path": "x", "code": "1"}]})
    for t in ("eval", "python", "url", "file_hash", "exec", ""):
        post(f"unknown check {t!r}", "/evaluate", {"checks": [{"type": t, "path": "x", "code": "1"}]})
    for p in ("/exec", "/eval", "/../etc/passwd", "/health/../action", "/ACTION", "/action/",
              "/screenshot.png", "/setup%00", "/%2e%2e/etc/passwd", "/shell", "/run", "/"):
        post(f"unknown endpoint {p}", p, actions[0])
        reqs.append((f"unknown endpoint GET {p}", http_bytes("GET", p, token=token), False))

    for q in ("format=gif", "format=png%00", "quality=0&format=jpeg", "format=jpeg&quality=96",
              "format=jpeg&quality=-1", "format=jpeg&quality=%C2%B2", "format=jpeg&quality=1e1",
              "format=jpeg&quality=%EF%BC%95", "format=jpeg&quality=5.5", "format=bmp&format=gif"):
        reqs.append((f"screenshot query {q}", http_bytes("GET", "/screenshot?" + q, token=token), False))

    # 6. paths that leave HOME, and writes a shell or GTK would execute
    escapes = ["../x", "../../etc/passwd", "/etc/passwd", pwn, "~/../x", "~/../../etc/shadow", "Documents/../../x",
               "out_link/x", "out_link", "etc_link/passwd", "./../x", "..", "/", "/tmp", "~/..", "Documents/../../../tmp/x"]
    for p in escapes:
        post(f"path write_file {p}", "/setup", {"steps": [{"type": "write_file", "path": p, "content": "pwned"}]})
        post(f"path open {p}", "/setup", {"steps": [{"type": "open", "path": p}]})
        post(f"path file_exists {p}", "/evaluate", {"checks": [{"type": "file_exists", "path": p}]})
        post(f"path file_contains {p}", "/evaluate", {"checks": [{"type": "file_contains", "path": p, "text": "root"}]})
    for p in (".bashrc", ".profile", ".config/gtk-3.0/settings.ini", ".config/openbox/rc.xml", "Documents/.hidden/x",
              ".local/share/applications/x.desktop", "~/.bashrc"):
        post(f"hidden write_file {p}", "/setup", {"steps": [{"type": "write_file", "path": p, "content": "touch " + pwn}]})
        post(f"hidden open {p}", "/setup", {"steps": [{"type": "open", "path": p}]})
    # `date -s` only without its argument: a `date -s 2000-01-01` that got through would set this
    # machine's clock (the server runs as whoever starts it, root on CI).
    argvs = [
        ["cat", "/etc/passwd"], ["cat", "../../../etc/passwd"], ["cat", "out_link/x"], ["head", "etc_link/passwd"],
        ["ls", "/"], ["ls", ".."], ["ls", "etc_link"], ["grep", "-r", "root", "/etc"], ["grep", "--file=/etc/passwd", "notes.txt"],
        ["grep", "-f", "/etc/passwd", "notes.txt"], ["grep", "-R", "x", "."], ["find", ".", "-exec", "touch", pwn, ";"],
        ["find", ".", "-execdir", "touch", "x", ";"], ["find", "/", "-name", "x"], ["find", ".", "-fprint", pwn],
        ["find", "-L", "."], ["find", ".", "-ok", "rm", "{}", ";"], ["xterm", "-e", "touch", pwn],
        ["xterm", "-xrm", "*VT100.translations: #override <Key>a: spawn-new-terminal()"], ["xterm", "/bin/sh"],
        ["xterm", "-ls"], ["xterm", "-hold", "-e", "sh", "-c", "touch " + pwn], ["xterm", "-e", "xterm", "-e", "sh"],
        ["xterm", "-e", "cat", "/etc/passwd"], ["xterm", "-T"], ["xdotool", "exec", "touch", pwn], ["xdotool", "search", "--name", "x", "exec", "touch", pwn],
        ["xdotool", "type", "touch x\n"], ["xdotool", "key", "ctrl+alt+t"], ["xdotool", "mousemove", "5", "5", "click", "1"],
        ["xdotool", "behave", "%1", "focus", "exec", "touch", pwn], ["xdotool", "notes.txt"], ["xdotool", "-"],
        ["sort", "--compress-program=touch", "notes.txt"], ["sort", "-o", pwn, "notes.txt"], ["sort", "-T", "/tmp", "notes.txt"],
        ["sort", "--files0-from=/etc/passwd"], ["date", "-f", "/etc/passwd"], ["date", "--file=/etc/shadow"],
        ["date", "-s"], ["date", "--set"], ["diff", "--to-file=/etc/passwd", "notes.txt"],
        ["diff", "/etc/passwd", "notes.txt"], ["cmp", "/etc/passwd", "notes.txt"], ["cp", "notes.txt", pwn],
        ["cp", "/etc/passwd", "x"], ["mv", "notes.txt", pwn], ["cp", "-s", "/etc", "x"], ["cp", "--symbolic-link", "notes.txt", "y"],
        ["cp", "--backup", "-S", "/../../../tmp/x", "notes.txt", "Documents/todo.txt"], ["mv", "notes.txt", ".bashrc"],
        ["cp", "notes.txt", ".config/autostart/x.desktop"], ["mousepad", "--gtk-module=/tmp/x.so"], ["mousepad", "/etc/passwd"],
        ["pcmanfm", "/etc"], ["pcmanfm", "--desktop-pref"], ["pcmanfm", "-w", "/etc/x.png"], ["galculator", "--gtk-module=x"],
        ["xclock", "-display", ":0"], ["xeyes", "-xrm", "*x: y"], ["xcalc", "-display", ":0"], ["stat", "/etc/shadow"],
        ["wc", "/etc/shadow"], ["sha256sum", "/etc/shadow"], ["md5sum", "etc_link/shadow"], ["tail", "-f", "/var/log/syslog"],
        ["tail", "--pid=1", "notes.txt"], ["test", "-e", "/etc/shadow"], ["bc", "/etc/passwd"], ["uniq", "notes.txt", pwn],
        ["touch", pwn], ["mkdir", pwn], ["mkdir", ".config/x"], ["touch", ".bashrc"], ["/usr/bin/cat", "notes.txt"],
        ["./cat"], ["../bin/cat"], ["rm", "-rf", "/"], ["sh", "-c", "touch " + pwn], ["python3", "-c", "1"], ["bash"],
        ["env", "touch", pwn], ["nice", "cat"], ["timeout", "1", "sh"], ["xargs"], ["perl", "-e", "1"], ["ln", "-s", "/", "x"],
        ["chmod", "777", "/"], ["cat", "--", "/etc/passwd"], ["sha256sum", "-c", "notes.txt"], ["md5sum", "--check", "x"],
        ["diff", "-r", "Documents", "out_link"], ["diff", "-r", "Documents", "Pictures"], ["head", "-n", "1", "/etc/passwd"], ["ls", "-la", "/root"],
    ]
    for argv in argvs:
        post(f"argv command {argv}", "/setup", {"steps": [{"type": "command", "argv": argv, "timeout": 5}]})
        post(f"argv launch {argv}", "/setup", {"steps": [{"type": "launch", "argv": argv}]})
        post(f"argv check {argv}", "/evaluate", {"checks": [{"type": "command", "argv": argv, "timeout": 5}]})

    # 7. header abuse (raw lines; Content-Length exactly as written)
    move = json.dumps(actions[0]).encode()
    for cl in ("abc", "-1", "\u00b2", "1e3", "0x10", "99999999999999999999", "+5", "5, 5", "", " "):
        reqs.append((f"content-length {cl!r}", http_bytes("POST", "/action", move, token, content_length=cl), False))
    reqs.append(("chunked", http_bytes("POST", "/action", b"%x\r\n%s\r\n0\r\n\r\n" % (len(move), move), token,
                                       headers=["Transfer-Encoding: chunked"], content_length=None), False))
    reqs.append(("chunked+cl", http_bytes("POST", "/action", move, token, headers=["Transfer-Encoding: chunked"]), False))
    reqs.append(("te gzip", http_bytes("POST", "/action", move, token, headers=["Transfer-Encoding: gzip"]), False))
    reqs.append(("no content-length", http_bytes("POST", "/action", move, token, content_length=None), False))
    reqs.append(("short content-length", http_bytes("POST", "/action", move, token, content_length="5"), False))
    for m in ("PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "FOO", "get", "post", "PROPFIND", "HEAD"):
        for p in ("/health", "/action", "/setup", "/nope"):
            reqs.append((f"method {m} {p}", http_bytes(m, p, move if m != "HEAD" else b"", token), m == "HEAD"))
    for line in (b"GARBAGE", b"GET", b"GET /health HTTP/9.9", b"GET /health HTTP/2.0", b"GET /health HTTP/1.1 extra",
                 b"\x00\x01\x02\x03", b"GET /health?" + b"a" * 70000 + b" HTTP/1.1", b"GET /health HTTP/1.x",
                 b"GET  HTTP/1.1", b"GET /health HTTP/0.1"):
        reqs.append((f"request line {line[:24]!r}", line + b"\r\nHost: x\r\nAuthorization: Bearer " + token.encode() + b"\r\n\r\n", False))
    base = f"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {token}\r\n".encode()
    reqs.append(("header too long", base + b"X-Long: " + b"a" * 70000 + b"\r\n\r\n", False))
    reqs.append(("too many headers", base + b"".join(b"X-%d: a\r\n" % i for i in range(150)) + b"\r\n", False))

    # 8. missing and wrong tokens, on every endpoint, with bodies that would act if let through
    for auth in (None, "Bearer wrong", f"Bearer {token}x", f"Bearer {token[:-1]}", f"bearer {token}", f"Bearer  {token}",
                 f"Basic {token}", token, f"Bearer {token} ", "Bearer", f"Bearer {token.upper()}", "Bearer \u00e9"):
        hdr = [] if auth is None else [f"Authorization: {auth}"]
        for method, path, body in (("GET", "/health", b""), ("GET", "/screenshot", b""), ("GET", "/windows", b""),
                                   ("POST", "/action", move),
                                   ("POST", "/setup", json.dumps({"steps": [{"type": "write_file", "path": "tok.txt",
                                                                             "content": "x"}]}).encode()),
                                   ("POST", "/reset", b"{}"), ("POST", "/evaluate", json.dumps({"checks": checks[:1]}).encode())):
            reqs.append((f"token {auth!r:.20} {path}", http_bytes(method, path, body, None, headers=hdr), False))
    return reqs


# ------------------------------------------------------------------------------------------------
# Observing that nothing happened


def home_snapshot(home: str) -> dict:
    """Relative path -> (kind, size, sha256 of content or link target) of everything in HOME."""
    snap = {}
    for root, dirs, files in os.walk(home):
        for name in dirs + files:
            p = os.path.join(root, name)
            rel = os.path.relpath(p, home)
            if os.path.islink(p):
                snap[rel] = ("link", os.readlink(p))
            elif os.path.isdir(p):
                snap[rel] = ("dir",)
            else:
                with open(p, "rb") as f:
                    snap[rel] = ("file", hashlib.sha256(f.read()).hexdigest())
    return snap


def processes_under(pid: int) -> set[tuple[int, str]]:
    children = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                comm, rest = f.read().rsplit(")", 1)
            if rest.split()[0] != "Z":
                children.setdefault(int(rest.split()[1]), []).append((int(name), comm.split("(", 1)[1]))
        except (OSError, IndexError):
            continue
    out, todo = set(), [pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            out.add(kid)
            todo.append(kid[0])
    return out


def health_ms(vm, n: int = 15) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        assert vm_call(vm, "GET", "/health").status_code == 200
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


@pytest.fixture
def armed(vm_desktop, tmp_path):
    """A clean desktop with the two traps in HOME, the mouse at a known spot; cleaned up after."""
    vm = vm_desktop
    assert vm_call(vm, "POST", "/reset").status_code == 200
    outside = tmp_path / f"outside-{uuid.uuid4().hex[:8]}"
    outside.mkdir()
    os.symlink(str(outside), os.path.join(vm.home, "out_link"))
    os.symlink("/etc", os.path.join(vm.home, "etc_link"))
    assert vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123}).status_code == 200
    time.sleep(1.0)  # let the freshly reset desktop settle (pcmanfm writes its config once)
    yield vm, str(outside)
    vm_call(vm, "POST", "/reset")
    shutil.rmtree(outside, ignore_errors=True)


def test_500_hostile_requests_get_4xx_json_and_change_nothing(armed):
    vm, outside = armed
    reqs = hostile_requests(random.Random(6), vm.token, outside)
    assert len(reqs) >= N_MIN, len(reqs)
    before_ms = health_ms(vm)
    home0, procs0, mouse0 = home_snapshot(vm.home), processes_under(vm.proc.pid), mouse(vm)
    assert mouse0 == (321, 123)
    t0 = time.perf_counter()
    failures = []
    for name, data, head in reqs:
        resps = exchange(vm.url, data)
        # Every answer on the connection is a 4xx JSON error (a short Content-Length leaves the
        # rest of the body to be read as a second, malformed request: that one too).
        if not resps or not all(is_json_4xx(r, head) for r in resps):
            failures.append((name, [(s, b[:150]) for s, _, b in resps] or "no answer"))
    elapsed = time.perf_counter() - t0
    after_ms = health_ms(vm)
    print(f"{len(reqs)} hostile requests in {elapsed:.1f} s; health {before_ms:.1f} ms before, {after_ms:.1f} ms after")
    assert not failures, f"{len(failures)} of {len(reqs)} not answered with a 4xx JSON error: {failures[:12]}"
    # nothing ran, nothing was written, nothing was started
    assert vm.proc.poll() is None
    assert mouse(vm) == mouse0
    assert home_snapshot(vm.home) == home0
    assert os.listdir(outside) == []
    new = processes_under(vm.proc.pid) - procs0
    assert not new, new
    # A server left busy by the attack (a spinning thread, a lock never released) answers far slower;
    # a loaded machine's noise stays well inside this. bench/hostile_vm.py measures the latencies.
    assert after_ms < 10 * before_ms + 250, (before_ms, after_ms)


def test_a_stalled_client_does_not_block_others(armed):
    """Half a body, then silence: other clients (health, actions, setup) go on meanwhile, and a few
    dozen stalled connections do not stop the server either. (The server drops a stalled connection
    after its socket timeout; bench/hostile_vm.py waits for that.)"""
    vm, _ = armed
    host, port = vm.url.split("//")[1].split(":")
    stalled = []
    for i in range(24):
        s = socket.create_connection((host, int(port)))
        body = json.dumps({"steps": [{"type": "write_file", "path": "stalled.txt", "content": "x" * 500}]}).encode()
        if i % 3 == 0:    # headers only, no body
            s.sendall(http_bytes("POST", "/setup", b"", vm.token, content_length=str(len(body))))
        elif i % 3 == 1:  # half the body
            s.sendall(http_bytes("POST", "/setup", body, vm.token)[:-len(body) // 2])
        else:             # half a header line
            s.sendall(b"POST /setup HTTP/1.1\r\nHost: x\r\nAuthori")
        stalled.append(s)
    try:
        # Blocked behind a stalled connection, a call would wait out that connection's deadline
        # (vm_server's REQUEST_TIMEOUT, 120 s); each call gets half of it
        wait = 60
        assert vm_call(vm, "GET", "/health", timeout=wait).status_code == 200
        assert vm_call(vm, "POST", "/action", {"type": "move", "x": 222, "y": 111}, timeout=wait).status_code == 200
        r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "other.txt", "content": "y"}]}, timeout=wait)
        assert r.status_code == 200
        assert mouse(vm) == (222, 111)
        assert open(os.path.join(vm.home, "other.txt")).read() == "y"
        assert not os.path.exists(os.path.join(vm.home, "stalled.txt"))  # a half body never runs
    finally:
        for s in stalled:
            s.close()
    time.sleep(0.3)
    assert not os.path.exists(os.path.join(vm.home, "stalled.txt"))  # nor once the client gives up
    assert vm_call(vm, "GET", "/health", timeout=5).status_code == 200


def test_paths_in_argv_still_work_inside_home(armed):
    """The argv rules refuse what leaves HOME, not ordinary task commands."""
    vm, _ = armed
    r = vm_call(vm, "POST", "/evaluate", {"checks": [
        {"type": "command", "argv": ["grep", "-c", "rent", "Documents/budget.csv"], "regex": "^1$"},
        {"type": "command", "argv": ["ls", "-la", "Documents"], "regex": "todo.txt"},
        {"type": "command", "argv": ["find", ".", "-name", "*.csv", "-type", "f"], "regex": "budget.csv"},
        {"type": "command", "argv": ["sort", "-r", "Documents/todo.txt"], "regex": "^write report"},
        {"type": "command", "argv": ["test", "-f", "notes.txt"]},
        {"type": "command", "argv": ["head", "-n", "1", "notes.txt"], "stdout": "Welcome"},
        {"type": "command", "argv": ["date", "+%Y"], "regex": r"^\d{4}$"},
        {"type": "command", "argv": ["echo", "/anything/at/all"], "stdout": "/anything"},
        {"type": "command", "argv": ["xdotool", "getdisplaygeometry"], "stdout": "1280 720"}]})
    assert r.status_code == 200, r.text
    assert r.json()["score"] == 1.0, r.json()
    r = vm_call(vm, "POST", "/setup", {"steps": [
        {"type": "command", "argv": ["mkdir", "-p", "a/b"]}, {"type": "command", "argv": ["cp", "notes.txt", "a/b/n.txt"]},
        {"type": "command", "argv": ["mv", "a/b/n.txt", "a/m.txt"]}, {"type": "command", "argv": ["touch", "a/t.txt"]},
        {"type": "launch", "argv": ["pcmanfm", "a"]}]})
    assert r.status_code == 200, r.text
    assert sorted(os.listdir(os.path.join(vm.home, "a"))) == ["b", "m.txt", "t.txt"]


def test_a_path_is_checked_again_when_its_step_runs(armed):
    """A folder holds a symlink that points out of HOME (the agent can make one with its terminal;
    the test plays the agent). Moving that folder is refused when the request is checked (cp/mv
    move no symlinks), so nothing runs. If the agent's own process moves it while a request runs,
    the write (and a check) through the moved symlink is refused when its step comes to run."""
    vm, outside = armed
    os.makedirs(os.path.join(vm.home, "box"))
    os.symlink(outside, os.path.join(vm.home, "box", "inner"))
    r = vm_call(vm, "POST", "/setup", {"steps": [
        {"type": "command", "argv": ["mv", "box", "trap"]},
        {"type": "write_file", "path": "trap/inner/escaped.txt", "content": "pwned"}]})
    assert 400 <= r.status_code < 500 and "symlink" in r.json()["error"], r.text
    assert os.path.isdir(os.path.join(vm.home, "box")) and not os.path.exists(os.path.join(vm.home, "trap"))
    # the agent's background `sleep 0.5; mv box trap`, racing a request that passed its checks
    mover = threading.Timer(0.5, os.rename, (os.path.join(vm.home, "box"), os.path.join(vm.home, "trap")))
    mover.start()
    r = vm_call(vm, "POST", "/setup", {"steps": [
        {"type": "sleep", "seconds": 1.5}, {"type": "write_file", "path": "trap/inner/escaped.txt", "content": "pwned"}]})
    mover.join()
    assert 400 <= r.status_code < 500 and "outside" in r.json()["error"] and "steps 1-1 ran" in r.json()["error"], r.text
    assert os.listdir(outside) == []
    open(os.path.join(outside, "secret.txt"), "w").write("root:x:0:0")
    os.rename(os.path.join(vm.home, "trap"), os.path.join(vm.home, "box"))
    mover = threading.Timer(0.5, os.rename, (os.path.join(vm.home, "box"), os.path.join(vm.home, "trap")))
    mover.start()
    r = vm_call(vm, "POST", "/evaluate", {"checks": [
        {"type": "command", "argv": ["sleep", "1.5"]}, {"type": "file_contains", "path": "trap/inner/secret.txt", "text": "root"}]})
    mover.join()
    assert 400 <= r.status_code < 500 and "outside" in r.json()["error"], r.text  # no oracle on files outside


def test_requests_library_sees_the_413_of_a_10mb_body(vm_desktop):
    """An ordinary client that sends the whole 10 MB before reading still gets the JSON error (the
    server reads the rest away before closing, instead of resetting the connection on it)."""
    for _ in range(5):
        r = requests.post(vm_desktop.url + "/setup", data=b"x" * (10 << 20), timeout=30,
                          headers={"Authorization": f"Bearer {vm_desktop.token}"})
        assert r.status_code == 413 and r.json()["error"].endswith(".")
        r = requests.post(vm_desktop.url + "/setup", data=b"x" * (200 << 10), timeout=30, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401


def test_a_fifo_in_home_cannot_hang_the_server(armed):
    """The agent can make a FIFO with its terminal (mkfifo result.txt). Writing to one blocks until
    a reader comes, and the server runs one request at a time: a write_file that opened it would hold
    the request lock forever (only /health would answer). It is refused without opening the FIFO, and
    checks on it end: the file check fails, the command is killed at its timeout. A call that hung
    would never return; each gets 60 s."""
    vm, _ = armed
    os.mkfifo(os.path.join(vm.home, "result.txt"))
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "result.txt", "content": "x"}]}, timeout=60)
    assert 400 <= r.status_code < 500 and "regular file" in r.json()["error"], r.text
    r = vm_call(vm, "POST", "/evaluate", {"checks": [{"type": "file_contains", "path": "result.txt", "text": "x"},
                                                     {"type": "command", "argv": ["cat", "result.txt"], "timeout": 1}]}, timeout=60)
    assert r.status_code == 200 and r.json()["score"] == 0.0, r.text
    assert [d["passed"] for d in r.json()["details"]] == [False, False], r.text
    assert vm_call(vm, "POST", "/action", {"type": "move", "x": 5, "y": 5}, timeout=5).status_code == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com", "127.0.0.1.nip.io", "::ffff:0.0.0.0"])
def test_a_non_loopback_bind_needs_a_token(host):
    env = {k: v for k, v in os.environ.items() if k != "VM_TOKEN"}
    for token in ([], ["--token", ""]):
        r = subprocess.run([sys.executable, SERVER, "--host", host, "--port", "0", *token], env=env,
                           capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "without a token" in r.stderr, (host, r.stderr)


def test_a_client_that_hangs_up_leaves_no_traceback(vm_desktop, tmp_path):
    """A trainer that times out (or dies) closes its connection before the answer: the server must
    shrug, not print a BrokenPipeError traceback into its log for every such request."""
    own = start_vm_server(xvfb=False, token="t0k", env={**os.environ, "HOME": str(tmp_path)}, display_of=vm_desktop)
    try:
        url = own.url
        host, port = url.split("//")[1].split(":")
        for _ in range(10):
            s = socket.create_connection((host, int(port)))
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # close = RST
            s.sendall(http_bytes("GET", "/screenshot", token="t0k"))
            s.close()
        time.sleep(1.0)
        assert requests.get(url + "/health", headers={"Authorization": "Bearer t0k"}, timeout=10).status_code == 200
    finally:
        own.stop()
    assert "Traceback" not in own.stderr(), own.stderr()[-1500:]


def test_every_default_program_has_an_argument_rule():
    sys.path.insert(0, os.path.dirname(SERVER))
    from vm import rules as vm_rules
    assert set(vm_rules.ARGV_RULES) == set(vm_rules.DEFAULT_ALLOW)
