"""vm_server.py's HTTP layer against the attacks a network (or a web page) can send, each on a real
server on loopback, over raw sockets so the bytes are exactly the attack's.

Run: python -m pytest -q tests/test_http_hardening.py     (~70 s)

- A request has one total deadline (--request-timeout), not one per read: a client trickling a
  byte every half second, or a body, or nothing at all, is cut off at the deadline and its thread
  ends; a well-behaved keep-alive connection gets a fresh deadline for every request, counted
  from its first byte, so env.VMClient never loses a request sent as its idle connection closes.
- A GET that carries a body is refused and its connection closed: the body (here a whole request
  that would move the mouse) is never parsed as the next request.
- Without a token only a loopback Host with the server's port is served, and no cross-origin
  browser request: DNS rebinding and a web page posting to 127.0.0.1 get 403 and nothing runs.
  With a token the bearer check stays the gate (a browser cannot attach it cross-origin).
- Hundreds of idle connections cost at most MAX_CONNECTIONS threads, and /health still answers.

The servers here drive the shared test desktop's display without --xvfb (they start in a second),
from inside its network namespace with its X cookie, and use a HOME of their own in tmp_path.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from conftest import SERVER, start_vm_server, vm_call
from conftest import mouse

sys.path.insert(0, os.path.dirname(SERVER))
import vm_server  # noqa: E402

DEADLINE = 2.0
SILENCE = 30.0  # how long a read waits for a close that should come at DEADLINE (a close ends it at once)


@pytest.fixture
def served(vm_desktop, tmp_path):
    """served(*args, token=...) -> a vm_server.py on the shared desktop's display, HOME = tmp_path."""
    started = []

    def start(*args, token=""):
        env = {k: v for k, v in os.environ.items() if k != "VM_TOKEN"}
        env.update(HOME=str(tmp_path))
        started.append(start_vm_server(*args, xvfb=False, token=token, env=env, timeout=30, display_of=vm_desktop))
        return started[-1]
    yield start
    for vm in started:
        vm.stop()


def connect(vm, timeout: float = 10) -> socket.socket:
    host, port = vm.url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def port_of(vm) -> int:
    return int(vm.url.rsplit(":", 1)[1])


def request(method: str, path: str, host: str, body: bytes = b"", headers: list[str] = (), token=None,
            content_length: bool | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", *([f"Host: {host}"] if host is not None else [])]
    lines += [f"Authorization: Bearer {token}"] if token else []
    if content_length or (content_length is None and (body or method == "POST")):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join([*lines, *headers]) + "\r\n\r\n").encode("latin-1") + body


def read_all(s: socket.socket, timeout: float = 5) -> tuple[bytes, bool]:
    """Bytes until the server closes the connection or `timeout` passes in silence -> (data, closed)."""
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return data, False
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk


def parse(data: bytes) -> list[tuple[int, dict, bytes]]:
    """Raw bytes -> [(status, headers, body)], one per response."""
    out = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        hdrs = dict((k.strip().lower(), v.strip()) for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln))
        n = int(hdrs.get("content-length", 0))
        out.append((int(lines[0].split()[1]), hdrs, rest[:n]))
        data = rest[n:]
    return out


def read_responses(s: socket.socket, timeout: float = 5) -> tuple[list[tuple[int, dict, bytes]], bool]:
    """Every response on the connection until it closes or `timeout` passes in silence -> (responses, closed)."""
    data, closed = read_all(s, timeout)
    return parse(data), closed


def read_one(s: socket.socket, timeout: float = 5) -> tuple[int, dict, bytes]:
    """One whole response (headers, then Content-Length bytes of body) on a kept-alive connection."""
    s.settimeout(timeout)
    data = b""
    while True:
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep and len(body) >= int(parse(head + sep)[0][1].get("content-length", 0)):
            return parse(data)[0]
        chunk = s.recv(65536)
        assert chunk, f"the server closed the connection after {data[:80]!r}"
        data += chunk


def eof(s: socket.socket) -> bool:
    """Has the server closed this connection?"""
    s.settimeout(0.01)
    try:
        return s.recv(1) == b""
    except socket.timeout:
        return False
    except ConnectionResetError:
        return True


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def wait_threads(pid: int, most: int, timeout: float = 5) -> int:
    deadline = time.time() + timeout
    while threads(pid) > most and time.time() < deadline:
        time.sleep(0.05)
    return threads(pid)


def is_json_error(resp, status: int) -> bool:
    code, hdrs, body = resp
    return code == status and hdrs.get("content-type") == "application/json" and json.loads(body)["error"].endswith(".")


# ------------------------------------------------------------------------------------------------
# One deadline per request


def test_a_trickled_request_is_cut_off_at_its_deadline(served, vm_desktop):
    vm = served("--request-timeout", str(DEADLINE))
    host = f"127.0.0.1:{port_of(vm)}"
    base = threads(vm.proc.pid)

    # 1. A header byte every 0.5 s: each read is quick, the request never ends. Cut at the deadline:
    #    not before it, and long before the ~80 s the client needs to send it all.
    s = connect(vm)
    s.settimeout(0.5)
    t0, closed = time.monotonic(), False
    slow = request("GET", "/health", host, token=vm.token)[:-4] + b"X-Slow: " + b"a" * 100
    for sent, b in enumerate(slow):
        try:
            s.sendall(bytes([b]))
            if s.recv(1) == b"":
                closed = True
                break
        except socket.timeout:
            pass
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
    took = time.monotonic() - t0
    s.close()
    assert closed and sent < len(slow) - 1 and took > DEADLINE - 0.3, (closed, sent, took)
    assert wait_threads(vm.proc.pid, base) <= base  # its thread is gone, not parked

    # 2. Whole headers, then the body a byte every 0.5 s: a 408 JSON error at the deadline, nothing ran.
    vm_call(vm, "POST", "/action", {"type": "move", "x": 300, "y": 300})
    body = json.dumps({"type": "move", "x": 17, "y": 13}).encode()
    s = connect(vm)
    s.sendall(request("POST", "/action", host, body, token=vm.token)[:-len(body)])
    got = b""
    s.settimeout(0.5)
    for sent, b in enumerate(body):
        try:
            s.sendall(bytes([b]))
            got = s.recv(65536)
        except socket.timeout:
            continue
        except (BrokenPipeError, ConnectionResetError):
            pass
        break
    rest, closed = read_all(s, SILENCE)
    s.close()
    resps = parse(got + rest)
    assert len(resps) == 1 and is_json_error(resps[0], 408) and closed, resps
    assert sent < len(body) - 1 and mouse(vm_desktop) == (300, 300)  # the 408 came before the body did

    # 3. An idle connection (a keep-alive one nobody uses, or a connect and nothing else) is closed
    #    too, at its deadline.
    s = connect(vm)
    t0 = time.monotonic()
    resps, closed = read_responses(s, timeout=SILENCE)
    took = time.monotonic() - t0
    assert closed and resps == [] and took > DEADLINE - 0.3, (closed, resps, took)
    s.close()

    # 4. A keep-alive client that sends whole requests gets a new deadline for each one: three
    #    requests over 1.5 x the deadline on one connection are all answered.
    s = connect(vm)
    for _ in range(3):
        s.sendall(request("GET", "/health", host, token=vm.token))
        assert read_one(s)[0] == 200
        time.sleep(DEADLINE / 2)
    s.close()
    assert wait_threads(vm.proc.pid, base) <= base


def test_the_deadline_starts_at_the_requests_first_byte(served, vm_desktop):
    """The idle wait before a request and the request itself have a clock each. The old single
    clock ran from the previous answer, so a request begun late in an idle connection's life got
    408 although its own bytes took milliseconds (a tester's bug). Raw sockets: exact timing."""
    vm = served("--request-timeout", str(DEADLINE))
    host = f"127.0.0.1:{port_of(vm)}"
    vm_call(vm, "POST", "/action", {"type": "move", "x": 300, "y": 300})

    # 1. Idle 0.6 x the deadline, then a POST whose body follows its headers 0.6 x the deadline
    #    later: 1.2 x from the connection, 0.6 x from the first byte. Answered, and it ran. Then the
    #    same again on that kept-alive connection, counted from the first answer.
    s = connect(vm)
    for x in (17, 19):
        body = json.dumps({"type": "move", "x": x, "y": 13}).encode()
        time.sleep(0.6 * DEADLINE)
        s.sendall(request("POST", "/action", host, body, token=vm.token)[:-len(body)])
        time.sleep(0.6 * DEADLINE)
        s.sendall(body)
        assert read_one(s)[0] == 200 and mouse(vm_desktop) == (x, 13)
    s.close()

    # 2. Idle 0.6 x the deadline, then headers and a body that never comes whole: 408 one deadline
    #    after the first byte (not 0.4 x after it), nothing ran, the connection closed.
    s = connect(vm)
    time.sleep(0.6 * DEADLINE)
    t0 = time.monotonic()
    s.sendall(request("POST", "/action", host, b"{}", token=vm.token)[:-1])  # one byte short
    resps, closed = read_responses(s, timeout=SILENCE)
    took = time.monotonic() - t0
    s.close()
    assert len(resps) == 1 and is_json_error(resps[0], 408) and closed, resps
    assert DEADLINE - 0.3 < took < DEADLINE + 1.0, took
    assert mouse(vm_desktop) == (19, 13)


def test_a_keep_alive_client_never_loses_a_request_to_the_idle_close(served):
    """env.VMClient (pooled keep-alive) sends requests after idle gaps right around the server's
    --request-timeout: just before, at and just after the moment the server closes the idle
    connection, in 0.2 ms steps (the race is a fraction of a millisecond wide), and longer. Every
    request is answered, and every action ran exactly once (the server's log counts them).
    Before the fix 2 of these 37 got 408 in each of two runs (a connection error is rarer)."""
    from env import VMClient, VMError
    timeout = 1.0
    vm = served("--request-timeout", str(timeout), "--verbose")
    client = VMClient(vm.url, vm.token, timeout=10)
    client.health()
    gaps = [timeout + k * 0.0002 for k in range(-15, 16)]  # the server's idle close, +-3 ms
    gaps += [timeout - 0.1, timeout - 0.02, timeout + 0.02, timeout + 0.1, 1.5 * timeout, 2.5 * timeout]
    failed, acts = [], 0
    t0 = time.monotonic()
    for i, gap in enumerate(gaps):
        time.sleep(gap)
        try:
            if i % 3:  # mostly POST /action, never retried by VMClient on an ordinary connection error
                client.act({"type": "move", "x": 100 + i, "y": 100})
                acts += 1
            else:
                client.health()
        except VMError as e:
            failed.append((round(gap - timeout, 4), str(e)))
    client.close()
    print(f"\n{len(gaps)} requests after idle gaps around {timeout:g} s in {time.monotonic() - t0:.0f} s: "
          f"{len(failed)} failed")
    assert failed == [], failed
    ran = vm.stderr().count('"POST /action HTTP/1.1" 200')
    assert ran == acts, (ran, acts)  # none lost, none run twice by a retry


def test_request_timeout_must_be_sane():
    for bad in ("0", "-1", "1e9"):
        r = subprocess.run([sys.executable, SERVER, "--request-timeout", bad], capture_output=True, text=True, timeout=30)
        assert r.returncode != 0 and "--request-timeout" in r.stderr and r.stderr.count("\n") == 1, r.stderr


# ------------------------------------------------------------------------------------------------
# A GET's body is never the next request


def test_a_get_with_a_body_is_refused_not_smuggled(served, vm_desktop):
    vm = served()
    host = f"127.0.0.1:{port_of(vm)}"
    vm_call(vm, "POST", "/action", {"type": "move", "x": 300, "y": 300})
    inner = request("POST", "/action", host, json.dumps({"type": "move", "x": 13, "y": 17}).encode(), token=vm.token)
    for method, path in (("GET", "/health"), ("GET", "/screenshot")):
        for framing in (["Content-Length"], ["Transfer-Encoding"]):
            if framing == ["Content-Length"]:
                outer = request(method, path, host, inner, token=vm.token)  # Content-Length: len(inner)
            else:
                chunk = b"%x\r\n" % len(inner) + inner + b"\r\n0\r\n\r\n"
                outer = request(method, path, host, chunk, token=vm.token, headers=["Transfer-Encoding: chunked"],
                                content_length=False)
            s = connect(vm)
            s.sendall(outer)  # keep-alive (HTTP/1.1, no Connection: close): a second answer would come
            resps, closed = read_responses(s, timeout=3)
            s.close()
            assert len(resps) == 1 and is_json_error(resps[0], 400) and closed, (method, framing, resps)
            assert b"takes no body" in resps[0][2]
    assert mouse(vm_desktop) == (300, 300)  # the smuggled move never ran
    # a GET without a body, and an explicit empty one, still work on a kept-alive connection
    s = connect(vm)
    s.sendall(request("GET", "/health", host, token=vm.token) + request("GET", "/health", host, token=vm.token,
                                                                         content_length=True))
    resps, _ = read_responses(s, timeout=1)
    s.close()
    assert [r[0] for r in resps] == [200, 200]


# ------------------------------------------------------------------------------------------------
# No token: loopback names only, no browser from another origin


def test_without_a_token_only_loopback_hosts_and_same_origin(served, vm_desktop, tmp_path):
    vm = served(token=None)
    port = port_of(vm)
    write = json.dumps({"steps": [{"type": "write_file", "path": "pwned.txt", "content": "x"}]}).encode()
    vm_call(vm, "POST", "/action", {"type": "move", "x": 300, "y": 300})
    move = json.dumps({"type": "move", "x": 13, "y": 17}).encode()

    def answer(host, headers=(), path="/setup", body=write):
        s = connect(vm)
        s.sendall(request("POST" if body else "GET", path, host, body, headers=[*headers, "Connection: close"]))
        resps, _ = read_responses(s, timeout=3)
        s.close()
        return resps

    refused = [
        (f"evil.example:{port}", []),                       # DNS rebinding: a foreign name, our address
        ("evil.example", []),
        (f"127.0.0.1:{port + 1}", []),                       # another port
        (f"127.0.0.1.evil.example:{port}", []),
        (f"localhost.:{port}", []),
        (None, []),                                          # no Host at all
        (f"127.0.0.1:{port}", [f"Host: evil.example:{port}"]),  # two Hosts
        (f"127.0.0.1:{port}", ["Origin: http://evil.example"]),  # a web page POSTing to us
        (f"127.0.0.1:{port}", ["Origin: null"]),             # a sandboxed iframe or a file:// page
        (f"127.0.0.1:{port}", [f"Origin: http://127.0.0.1:{port + 1}"]),  # another local web server
        (f"127.0.0.1:{port}", [f"Origin: https://127.0.0.1:{port}"]),
        (f"127.0.0.1:{port}", ["Sec-Fetch-Site: cross-site"]),
        (f"127.0.0.1:{port}", ["Sec-Fetch-Site: same-site"]),
    ]
    for host, headers in refused:
        for path, body in (("/setup", write), ("/action", move), ("/health", b"")):
            resps = answer(host, headers, path, body)
            assert len(resps) == 1 and is_json_error(resps[0], 403), (host, headers, path, resps)
    assert not (tmp_path / "pwned.txt").exists() and mouse(vm_desktop) == (300, 300)

    allowed = [(f"127.0.0.1:{port}", []), (f"localhost:{port}", []), (f"LOCALHOST:{port}", []), (f"[::1]:{port}", []),
               (f"127.0.0.1:{port}", [f"Origin: http://127.0.0.1:{port}"]),
               (f"localhost:{port}", [f"Origin: http://localhost:{port}", "Sec-Fetch-Site: same-origin"]),
               (f"127.0.0.1:{port}", ["Sec-Fetch-Site: none"])]  # typed into the address bar
    for host, headers in allowed:
        resps = answer(host, headers, "/health", b"")
        assert [r[0] for r in resps] == [200], (host, headers, resps)
    assert [r[0] for r in answer(f"127.0.0.1:{port}")] == [200] and (tmp_path / "pwned.txt").read_text() == "x"


def test_with_a_token_the_bearer_check_is_the_gate(served, vm_desktop):
    vm = served()
    vm_call(vm, "POST", "/action", {"type": "move", "x": 300, "y": 300})
    move = json.dumps({"type": "move", "x": 13, "y": 17}).encode()
    for token, status in ((None, 401), ("wrong", 401), (vm.token, 200)):
        s = connect(vm)
        s.sendall(request("POST", "/action", "vm1.internal:8000", move, token=token,
                          headers=["Origin: http://evil.example", "Connection: close"]))
        resps, _ = read_responses(s, timeout=2)
        s.close()
        assert [r[0] for r in resps] == [status], (token, resps)
        assert mouse(vm_desktop) == ((13, 17) if status == 200 else (300, 300))


def test_local_names():
    assert vm_server.local_names("127.0.0.1", 8000) == {"127.0.0.1:8000", "localhost:8000", "[::1]:8000"}
    assert "127.0.0.2:81" in vm_server.local_names("127.0.0.2", 81)
    assert "localhost" in vm_server.local_names("127.0.0.1", 80)  # a browser leaves out port 80


# ------------------------------------------------------------------------------------------------
# Idle connections cannot starve the server


def test_hundreds_of_idle_connections_do_not_starve_health(served):
    vm = served()
    base = threads(vm.proc.pid)
    idle = []
    try:
        for _ in range(400):
            idle.append(connect(vm))
        time.sleep(1.0)
        # Starved, /health would wait for an idle connection's deadline (REQUEST_TIMEOUT, 120 s)
        t0 = time.monotonic()
        assert vm_call(vm, "GET", "/health", timeout=vm_server.REQUEST_TIMEOUT / 2).status_code == 200
        health_s = time.monotonic() - t0
        assert vm_call(vm, "POST", "/action", {"type": "move", "x": 5, "y": 5}, timeout=10).status_code == 200
        held = threads(vm.proc.pid) - base
        closed = sum(map(eof, idle))  # the server closed most of them to make room
    finally:
        for s in idle:
            s.close()
    print(f"\n400 idle connections: /health answered in {1000 * health_s:.0f} ms, {held} threads held, {closed} closed by the server")
    assert held <= vm_server.MAX_CONNECTIONS + 2, held
    assert closed >= 400 - vm_server.MAX_CONNECTIONS - 2, closed


def test_a_connection_made_during_a_resets_kill_is_answered(vm_desktop):
    """A reset's kill stops every fork of the desktop for a moment (pids.max 0: vm/limits.py
    Box.kill), the server's own threads included. A trainer's /health on a new connection beside
    the /reset it started ahead (rollout: the next episode's revive) used to be closed unanswered
    then (1 in 16 of those sent within 30 ms of the /reset), and the desktop counted as dead (a
    lost eval episode in CI). Each check here is a new connection, sent while a /reset runs (the
    old server failed 2 of 1783); every one is answered."""
    import threading
    failed, checks = [], 0
    for _ in range(10):
        done = threading.Event()
        reset = threading.Thread(target=lambda: (vm_call(vm_desktop, "POST", "/reset", {}), done.set()))
        reset.start()
        while not done.is_set():
            checks += 1
            try:
                assert vm_call(vm_desktop, "GET", "/health", timeout=10).status_code == 200
            except Exception as e:  # noqa: BLE001 -- counted, shown below
                failed.append(f"{type(e).__name__}: {e}")
        reset.join()
    assert checks >= 50 and not failed, (checks, failed[:3])
