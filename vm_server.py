"""vm_server.py: one desktop served over HTTP (screenshot, action, reset, setup, evaluate).

It runs INSIDE each VM, or as a local desktop of its own on this machine:

    python vm_server.py --xvfb [--screen 1280x720] [--port 8000]   # own Xvfb + openbox + icons
    VM_TOKEN=<its token> python vm_server.py --host 0.0.0.0       # inside your VM, on its DISPLAY
    VM_TOKEN=<secret> python vm_server.py --token-for URL         # the token of the VM at URL

Endpoints (JSON; errors are 4xx/5xx {"error": "<one sentence>"}; see docs/vm.md):
    GET /health, GET /screenshot[?format=png|jpeg&quality=Q], GET /windows,
    POST /action[?settle=watch|SECONDS][&screenshot=png|jpeg&quality=Q] (the settled screen as the
    answer: one round trip per step; header X-Settle), POST /reset,
    POST /setup {"steps": [...]}, POST /evaluate {"conj": "and"|"or", "checks": [...]}.
With a token every endpoint needs `Authorization: Bearer <token>`; binding to anything but loopback
without one is refused, and a server without one answers only requests with a loopback Host and
no foreign Origin (a web page in a local browser, or DNS rebinding, cannot reach the desktop). Requests execute one at a time
(there is one mouse and one keyboard). Each request must arrive whole within --request-timeout
seconds of its first byte, a connection idle for as long is closed without an answer, a GET may
not carry a body, and at most MAX_CONNECTIONS connections are open (the one waiting longest for
its request makes room for a new one). `--port 0` picks a free port; the first stdout line is
`vm_server: serving http://HOST:PORT ...`. With --xvfb the whole desktop,
this server included, runs inside bubblewrap (vm/sandbox.py; --no-sandbox turns it off): the
port is bound outside and the socket handed in (--listen-fd), the token through a pipe
(--token-fd), and the server makes itself non-dumpable, so nothing on the desktop can read the
token or reach the port. Each VM has a token of its own: the trainer derives it from one secret and
the VM's URL (vm.rules.vm_token; --token-for prints it).

Where this departs from OSWorld's in-VM server (the papers' environment):
  - No endpoint runs code sent by the client: setup/evaluate are a handful of typed steps, the
    programs they may start are an allow-list, and each program's arguments are checked
    (ARGV_RULES, in vm/rules.py), so no step can run code or touch a file outside HOME. The token is still the
    security boundary of the desktop itself: its holder drives the mouse and keyboard, and the
    desktop's terminal runs anything typed into it.
  - Evaluators are generic checks (files, window titles, a command's output) instead of
    per-application getters, so task files stay small and readable.
  - `--xvfb` builds a whole desktop (Xvfb, openbox, tint2 taskbar, pcmanfm icons) per server, with
    its own HOME copied from a template, so N local desktops stand in for N VMs.
  - After an action the papers' clients sleep a fixed time before the next screenshot; here
    `?settle=watch` waits until the desktop has settled, watched from inside (vm/settle.py), and
    answers with the settled screen.

What to copy into your VM: vm.FILES, that is this file, actions.py (the action schema POST /action
takes; stdlib only) and the folder vm/ (its steps, checks, request rules, processes, settle; vm/__init__.py
lists them). vm/desktop.py and vm/sandbox.py are the `--xvfb` desktop and its sandbox, imported only
with --xvfb. Nothing imports this file: it is the program you run.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import io
import ipaddress
import json
import os
import pwd
import re
import signal
import socket
import struct
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from PIL import ImageGrab

from vm.procs import DesktopState, app_windows, kill_tree, prctl, reap
from vm.settle import watcher
from vm.act import check_action, do_action
from vm.rules import DEFAULT_ALLOW, MAX_BODY, BadRequest, check_object, vm_token
from vm.tasks import evaluate, setup

# -------------------------------------------------------------------------------------------------
# Limits (a request's body, the allow-list and its argv rules are in vm/rules.py; the type-text
# and hotkey limits are the action schema's, in actions.py, checked in vm/act.py)

PNG_LEVEL = 1            # zlib level: 1 is the fastest that still squeezes flat screen colours well
REQUEST_TIMEOUT = 120.0  # s from a request's first byte to its last; also the longest idle wait (--request-timeout)
MAX_CONNECTIONS = 64     # open connections; past it the longest-waiting unanswered one is closed
LISTEN_BACKLOG = 1024    # connections the kernel queues before we accept them (the kernel may cap it)
THREAD_WAIT = 5.0        # s a new connection waits for its thread while the desktop may not fork (Server)


# -------------------------------------------------------------------------------------------------
# The desktop: /reset (the programs on it and our process tree are in vm/procs.py, the --xvfb desktop
# itself -- Xvfb, session, icons, HOME template -- in vm/desktop.py)


def _desktop(name: str = "desktop"):
    """vm/desktop.py (the --xvfb desktop) or vm/sandbox.py (its bubblewrap), imported only when a --xvfb
    server needs it: a VM serving its own display runs without either file."""
    try:
        from vm import desktop, limits, sandbox
    except ModuleNotFoundError as e:
        if e.name not in ("vm.desktop", "vm.limits", "vm.sandbox"):
            raise
        sys.exit(f"vm_server: --xvfb needs {e.name.replace('.', '/')}.py beside vm_server.py; copy it too, or serve "
                 "an existing display without --xvfb.")
    return {"desktop": desktop, "limits": limits, "sandbox": sandbox}[name]


def reap_always(every: float = 0.2) -> None:
    """Reap finished children (and the orphans we adopt as a subreaper) all the time, not only
    during requests: an agent that makes orphans fast would otherwise fill the desktop's process
    table with zombies between two requests. Only between requests (the request lock free): reaping
    beside a running setup command would steal its exit status."""
    while True:
        time.sleep(every)
        if Handler.lock.acquire(blocking=False):
            try:
                reap()
            finally:
                Handler.lock.release()


def reset(desk: DesktopState) -> dict[str, float]:
    """Close every app started since the desktop came up, restore HOME, mouse to the centre.
    -> seconds per phase (see desktop.reset_desktop)."""
    import pyautogui
    if desk.xvfb is not None:
        # Stopping every client but Xvfb and starting the session again is simpler and surer than
        # closing windows one by one (a file manager window lives inside the desktop process).
        phases = _desktop().reset_desktop(desk)
    else:  # a real VM: close what we launched; its files are yours (restore them with a snapshot)
        t = time.monotonic()
        kill_tree(keep=set())
        phases = {"kill": round(time.monotonic() - t, 3)}
    t = time.monotonic()
    pyautogui.moveTo(desk.screen[0] // 2, desk.screen[1] // 2, _pause=False)  # no app left to see it in order
    return {**phases, "mouse": round(time.monotonic() - t, 3)}

# -------------------------------------------------------------------------------------------------
# HTTP


def encode_png(img) -> bytes:
    """The screen as a PNG with no row filters, deflated at PNG_LEVEL.

    Pillow's PNG encoder always tries several filters per row and keeps the best. On a screenshot
    that search costs more than the compression, and un-filtering slows every decode too. Flat
    desktop colours compress almost as well unfiltered, so we write the few PNG chunks ourselves:
    faster to encode and to decode (bench/screenshot.py measures both against Pillow's).
    """
    img = img if img.mode == "RGB" else img.convert("RGB")
    (w, h), raw = img.size, memoryview(img.tobytes())
    rows = b"".join(b"\0" + raw[i:i + 3 * w] for i in range(0, len(raw), 3 * w))  # filter 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))  # 8-bit RGB
            + chunk(b"IDAT", zlib.compress(rows, PNG_LEVEL)) + chunk(b"IEND", b""))


def image_query(query: dict, key: str = "format") -> tuple[str, int]:
    """The image format and JPEG quality a request asks for (`?format=` for /screenshot,
    `?screenshot=` for /action, `&quality=` for both), checked."""
    fmt, q = query.get(key, ["png"])[-1], query.get("quality", ["80"])[-1]
    if fmt not in ("png", "jpeg", "jpg"):
        raise BadRequest(f"'{key}' must be png or jpeg.")
    if not re.fullmatch(r"[0-9]{1,2}", q) or not 1 <= int(q) <= 95:  # not isdigit(): '²' is a digit to it
        raise BadRequest("'quality' must be an integer in [1, 95].")
    return fmt, int(q)


def screenshot(fmt: str = "png", quality: int = 80) -> tuple[bytes, dict]:
    """The screen now -> (image bytes, headers)."""
    img = ImageGrab.grab()  # X11 GetImage through Pillow's XCB binding
    if fmt == "png":
        return encode_png(img), {"Content-Type": "image/png"}
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=quality)
    return buf.getvalue(), {"Content-Type": "image/jpeg"}


def handle(desk: DesktopState, method: str, path: str, query: dict, body) -> tuple[int, object, dict]:
    """Route one authenticated request -> (status, JSON object or bytes, extra headers)."""
    routes = {"/health": "GET", "/screenshot": "GET", "/windows": "GET", "/action": "POST", "/reset": "POST",
              "/setup": "POST", "/evaluate": "POST"}
    if path not in routes:
        return 404, {"error": f"no endpoint {path}; see docs/vm.md for the protocol."}, {}
    if routes[path] != method:
        return 405, {"error": f"{path} takes {routes[path]}, not {method}."}, {}
    if desk.xvfb is not None and desk.xvfb.poll() is not None:
        return 503, {"error": "this desktop's X server died; restart vm_server.py."}, {}
    if path == "/health":
        return 200, {"ok": True, "screen": list(desk.screen)}, {}
    if path == "/screenshot":
        return (200, *screenshot(*image_query(query)))
    if path == "/windows":  # the application windows, oldest first (the window manager's list)
        return 200, {"windows": [{"id": i, "title": t, "class": c} for i, t, c in app_windows(desk, wm_class=True)]}, {}
    if path == "/action":  # the query and the action are checked before anything runs
        image = image_query(query, "screenshot") if "screenshot" in query else None
        return act(desk, check_action(desk, body), settle_query(query), image)
    if path == "/reset":
        check_object({} if body is None else body, "the /reset body")
        return 200, {"ok": True, "seconds": reset(desk)}, {}
    if path == "/setup":  # every step checked and the whole request planned before any runs
        return 200, setup(desk, body), {}
    return 200, evaluate(desk, body), {}


# -------------------------------------------------------------------------------------------------
# POST /action?settle=watch|SECONDS&screenshot=png|jpeg: the action, the settle, the settled screen

MAX_FIXED_SETTLE = 10.0  # s: the longest fixed settle a request may ask for


def settle_query(query: dict) -> str | float | None:
    """?settle=watch (vm/settle.py's rule), ?settle=SECONDS (a fixed sleep), or absent (None)."""
    if "settle" not in query:
        return None
    v = query["settle"][-1]
    if v == "watch":
        return v
    if re.fullmatch(r"[0-9]{1,2}(\.[0-9]{1,3})?", v) and float(v) <= MAX_FIXED_SETTLE:  # ASCII digits only
        return float(v)
    raise BadRequest(f"'settle' must be watch or seconds in [0, {MAX_FIXED_SETTLE:g}] (e.g. 0.5).")


def act(desk: DesktopState, a: dict, how: str | float | None, image: tuple[str, int] | None) -> tuple[int, object, dict]:
    """Run one checked action, settle as asked, answer with the settled screen (`image`: its
    format and quality) or {"ok": true, "settle": ...}; either way the X-Settle header says how
    the settle went (see settle.Watcher.settle)."""
    if how == "watch":
        watcher(desk).arm()
    started = time.monotonic()
    do_action(desk, a)
    if how == "watch":
        info = watcher(desk).settle(started)
    elif how is not None:
        time.sleep(how)
        info = {"seconds": how, "until": "fixed", "first_change": None}
    else:
        info = {"seconds": 0.0, "until": "none", "first_change": None}
    headers = {"X-Settle": json.dumps(info, separators=(",", ":"))}
    if image is None:
        return 200, {"ok": True, "settle": info}, headers
    data, more = screenshot(*image)
    return 200, data, {**headers, **more}


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each allowed only the time left until the handler's deadline (the
    idle wait's, then the request's: Handler.handle_one_request), so a client that trickles one
    byte every few seconds is still cut off at it (a socket timeout alone restarts at every byte)."""

    def __init__(self, handler: "Handler"):
        self.handler = handler

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        left = self.handler.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {self.handler.request_timeout:g} s")
        self.handler.connection.settimeout(left)
        return self.handler.connection.recv_into(buf)


def local_names(host: str, port: int) -> frozenset[str]:
    """The Host header values a token-less server answers: loopback names with our port. A web page
    the user visits can make the browser send requests to 127.0.0.1, but with its own name in
    Host (DNS rebinding) or its own Origin; neither is in here."""
    names = {"127.0.0.1", "localhost", "[::1]", host.lower() if ":" not in host else f"[{host.lower()}]"}
    return frozenset({f"{n}:{port}" for n in names} | (names if port == 80 else set()))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: a screenshot loop skips the TCP handshake
    disable_nagle_algorithm = True  # headers and body go out at once, no 40 ms delayed-ACK stall
    request_timeout = REQUEST_TIMEOUT  # from a request's first byte to its last; also the longest idle wait
    timeout = REQUEST_TIMEOUT       # sending an answer: at most this long
    desk: DesktopState = None
    token: str | None = None
    names: frozenset = frozenset()  # local_names() of the server: Host values allowed without a token
    lock = threading.Lock()         # one mouse, one keyboard: one request at a time
    verbose = False

    def setup(self):
        super().setup()
        self.rfile = io.BufferedReader(_DeadlineReader(self))  # every read counts against the deadline

    def handle(self):
        try:
            super().handle()
        except (ConnectionResetError, BrokenPipeError):
            pass  # the client hung up (it timed out, or died): nobody to answer, nothing to log

    def handle_one_request(self):
        # Two clocks of request_timeout each: the idle wait for a request's first byte, then the
        # request's own, from that byte to its last. One clock from the previous answer to the
        # whole request (as this was) made a keep-alive client lose a race it cannot see: a request
        # sent on a connection idle for nearly the timeout got 408 although its own bytes took
        # milliseconds (the headers read just in time, the body a moment after the deadline). An
        # idle connection is closed silently: nothing was asked, so nothing is answered, and a
        # client that sent into that close had its request never read (env.VMClient sends it
        # again on a new connection). Attackers gain nothing: an idle holder is closed after one
        # timeout, a trickler at most one timeout after its first byte, and past MAX_CONNECTIONS
        # the longest waiting of either makes room (Server).
        self.server.waiting(self.connection)  # idle or half-read: may be closed to make room
        self.deadline = time.monotonic() + self.request_timeout
        try:
            first = self.rfile.peek(1)  # the next request's first bytes (already buffered, or waited for)
        except TimeoutError:
            first = b""
        if not first:  # idle too long, the client hung up, or we closed it to make room
            self.close_connection = True
            return
        self.deadline = time.monotonic() + self.request_timeout
        super().handle_one_request()

    def do_GET(self):
        self._serve("GET")

    def do_POST(self):
        self._serve("POST")

    def log_message(self, fmt, *args):
        if self.verbose:
            super().log_message(fmt, *args)

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if self.request_version not in ("HTTP/1.0", "HTTP/1.1"):  # HTTP/0.9 answers carry no status line
            self.send_error(400, f"{self.request_version} is not spoken here; send HTTP/1.1")
            return False
        return True

    def send_response(self, code, message=None):
        self.connection.settimeout(self.timeout)  # the read deadline may have left it at nothing
        super().send_response(code, message)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a broken request line, oversized headers, a method we do not
        serve, an HTTP version we do not speak) as our JSON errors, and 4xx: each is the client's
        mistake (http.server says 501 for an unknown method and 505 for a version, and uses HTML)."""
        code = {501: 405, 505: 400}.get(int(code), int(code))
        if code == 405:
            message = f"method {self.command!r} is not served; use GET or POST"
        self.request_version = "HTTP/1.1"  # a request line that did not parse left "HTTP/0.9"
        self.close_connection = True
        data = json.dumps({"error": f"{(message or 'bad request').rstrip('.')}; see docs/vm.md for the protocol."}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _admit(self, method: str) -> None:
        """Who may ask, and whether the request is whole. Every refusal closes the connection: an
        unread body must never be parsed as the next request."""
        if self.token:
            if not hmac.compare_digest(  # constant time: no guessing byte by byte
                    self.headers.get("Authorization", "").encode(), f"Bearer {self.token}".encode()):
                self.close_connection = True
                raise BadRequest("missing or wrong token; send 'Authorization: Bearer <token>'.", 401)
        else:
            # No token: only this machine may drive the desktop, and not through a web page in
            # its browser. A browser always sends Host, and Origin on every cross-site POST.
            hosts, origin = self.headers.get_all("Host", []), self.headers.get("Origin")
            if len(hosts) != 1 or hosts[0].strip().lower() not in self.names:
                self.close_connection = True
                raise BadRequest("without a token only a loopback Host (127.0.0.1, localhost, [::1]) with the "
                                 "server's port is served; start the server with --token to serve other names.", 403)
            if (origin is not None and origin.strip().lower().removeprefix("http://") not in self.names) \
                    or self.headers.get("Sec-Fetch-Site", "same-origin") not in ("same-origin", "none"):
                self.close_connection = True
                raise BadRequest("cross-origin requests (from a web page) are refused; start the server with --token "
                                 "if a browser must reach it.", 403)
        if method != "POST" and (self.headers.get("Transfer-Encoding") is not None
                                 or self.headers.get_all("Content-Length", ["0"]) != ["0"]):
            self.close_connection = True
            raise BadRequest(f"{method} takes no body; send one only with POST.")

    def _serve(self, method: str):
        url = urlsplit(self.path)
        try:
            self._admit(method)
            body = self._body() if method == "POST" else None
            self.server.busy(self.connection)  # read whole: never closed to make room
            health = url.path == "/health"  # answers even while a long /setup holds the lock
            with contextlib.nullcontext() if health else self.lock:
                if not health:
                    reap()  # never beside a running setup command: that would steal its exit status
                status, payload, headers = handle(self.desk, method, url.path, parse_qs(url.query), body)
        except BadRequest as e:
            status, payload, headers = e.status, {"error": str(e)}, {}
        except Exception as e:  # a bug or a broken desktop: say so, keep serving
            print(f"vm_server: {method} {url.path} failed: {e!r}", file=sys.stderr, flush=True)
            status, payload, headers = 500, {"error": f"the VM failed: {type(e).__name__}: {e}"[:500]}, {}
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        for k, v in {"Content-Type": "application/json", **headers}.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _body(self):
        n = self.headers.get("Content-Length", "0")
        # ASCII digits only ('²'.isdigit() is True, int('²') raises), and only one Content-Length.
        if self.headers.get("Transfer-Encoding") or not re.fullmatch(r"[0-9]{1,9}", n) or int(n) > MAX_BODY \
                or len(self.headers.get_all("Content-Length", [])) > 1:
            self.close_connection = True
            raise BadRequest(f"send a JSON body of at most {MAX_BODY} bytes with a Content-Length.", 413)
        try:
            raw = self.rfile.read(int(n))
        except TimeoutError:
            self.close_connection = True
            raise BadRequest(f"the request did not arrive whole within {self.request_timeout:g} s.", 408)
        if len(raw) < int(n):  # the client closed early (or we closed it to make room)
            self.close_connection = True
            raise BadRequest("the body ended before its Content-Length.")
        try:
            return json.loads(raw) if raw else None
        except (ValueError, RecursionError):
            raise BadRequest("the body is not valid JSON.")


class Server(ThreadingHTTPServer):
    """One thread per connection, at most MAX_CONNECTIONS of them. At the cap, a new connection
    makes room by closing the open one that has waited longest for its request (idle keep-alive,
    or a client trickling bytes); connections whose request is being answered are never closed.
    So hundreds of idle sockets cost at most MAX_CONNECTIONS threads, and the trainer's next
    connection is always let in."""
    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, sock: socket.socket):
        """Serve on `sock`, bound already (by us, or outside the sandbox: see listening_socket)."""
        self._conns: dict = {}    # socket -> when it began waiting for its request; None: being answered
        self._conns_lock = threading.Lock()
        super().__init__(sock.getsockname()[:2], Handler, bind_and_activate=False)
        self.socket.close()  # the unbound one socketserver made
        self.socket, self.server_address = sock, sock.getsockname()
        self.server_activate()  # listen(LISTEN_BACKLOG)

    def waiting(self, sock) -> None:
        with self._conns_lock:
            if sock in self._conns:
                self._conns[sock] = time.monotonic()

    def busy(self, sock) -> None:
        with self._conns_lock:
            if sock in self._conns:
                self._conns[sock] = None

    def process_request(self, request, client_address):
        with self._conns_lock:
            if len(self._conns) >= MAX_CONNECTIONS:
                waiting = [(t, id(s), s) for s, t in self._conns.items() if t is not None]
                if not waiting:  # every connection is being answered: no room, refuse this one
                    self.shutdown_request(request)
                    return
                oldest = min(waiting)[2]
                del self._conns[oldest]
                with contextlib.suppress(OSError):
                    oldest.shutdown(socket.SHUT_RDWR)  # its thread reads EOF and ends
            self._conns[request] = time.monotonic()
        # The thread may not start at once: this server counts in its desktop's process limit, and a
        # reset's kill stops every fork of the desktop for a moment (vm/limits.py: Box.kill sets
        # pids.max to 0), ours included. A connection arriving then (a trainer's health check beside
        # the /reset it started ahead) waits for room instead of being closed unanswered; past
        # THREAD_WAIT (the limit stays full: the agent's own processes fill it) it is closed.
        deadline = time.monotonic() + THREAD_WAIT
        while True:
            try:
                return super().process_request(request, client_address)
            except RuntimeError:  # "can't start new thread"
                if time.monotonic() > deadline:
                    raise  # socketserver logs it and closes the connection
                time.sleep(0.005)

    def shutdown_request(self, request):
        with self._conns_lock:
            self._conns.pop(request, None)
        super().shutdown_request(request)


def exit_with_parent(pid: int) -> None:
    """SIGTERM ourselves (a clean exit: apps, Xvfb and the temp HOME go too) once `pid` is no longer
    our parent, i.e. it died and we were re-parented."""
    while os.getppid() == pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def read_token(args) -> str | None:
    """The bearer token: from --token-fd (a pipe or a file the caller hands over: in no argv, and in
    no environment a process of the desktop could read), else --token, else $VM_TOKEN. The
    environment's copy is dropped, so no program we start inherits it."""
    env = os.environ.pop("VM_TOKEN", None)
    if args.token_fd is None:
        return args.token or env or None
    try:
        with os.fdopen(args.token_fd, "rb") as f:
            return f.read(4096).decode().strip() or None
    except (OSError, UnicodeDecodeError) as e:
        sys.exit(f"vm_server: cannot read the token from --token-fd {args.token_fd} ({e}); hand over a readable pipe or file.")


def listening_socket(args) -> socket.socket:
    """The socket to serve on: the one handed over with --listen-fd (the sandbox's launcher, or a
    trainer, bound it on the host's network), else a new one bound to --host:--port."""
    if args.listen_fd is None:
        try:  # bind first: a taken port fails at once, not after the desktop has started
            family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
            return socket.create_server((args.host, args.port), family=family, backlog=LISTEN_BACKLOG)
        except OSError as e:
            sys.exit(f"vm_server: cannot listen on {args.host}:{args.port} ({e.strerror}); pick another --port.")
    try:
        sock = socket.socket(fileno=args.listen_fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise OSError(0, "not a listening TCP socket")
        return sock
    except OSError as e:
        sys.exit(f"vm_server: --listen-fd {args.listen_fd} is no listening TCP socket ({e.strerror}); "
                 f"hand over a bound, listening one, or use --host and --port.")


def is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> None:
    # PR_SET_DUMPABLE (4) = 0: our memory (which holds the token), environment and open files are
    # out of reach of every process without CAP_SYS_PTRACE, the desktop's own (same user) included:
    # /proc/<pid>/environ, mem and fd answer "permission denied", ptrace too.
    prctl(4, 0)
    p = argparse.ArgumentParser(description="Serve one desktop over HTTP (docs/vm.md has the protocol).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    p.add_argument("--port", type=int, default=8000, help="port; 0 picks a free one (printed at start)")
    p.add_argument("--listen-fd", type=int, help="serve on this inherited, listening socket instead of --host/--port")
    p.add_argument("--token", default=None, help="the bearer token (default: $VM_TOKEN)")
    p.add_argument("--token-fd", type=int, help="read the token from this file descriptor (e.g. `--token-fd 3 3<file`)")
    p.add_argument("--token-for", metavar="URL", help="print the token the trainer sends to the VM at URL, derived "
                   "from the secret given as the token, and exit")
    p.add_argument("--xvfb", action="store_true", help="start a desktop of our own on a new Xvfb display")
    p.add_argument("--screen", default="1280x720", help="WxH of the --xvfb screen")
    p.add_argument("--no-sandbox", action="store_true",
                   help="--xvfb: run the desktop unconfined, not inside bubblewrap (for machines without bwrap)")
    p.add_argument("--request-timeout", type=float, default=REQUEST_TIMEOUT,
                   help="seconds a client has to send each whole request, counted from its first byte; an idle "
                   "connection is closed (without an answer) after as long")
    p.add_argument("--allow-exec", default="", help="comma-separated extra programs setup/evaluate may run")
    p.add_argument("--verbose", action="store_true", help="log every request")
    p.add_argument("--limits", default="", help="--xvfb: the desktop's bounds, comma-separated name=value of memory, "
                   "pids, cpus, disk, tmp (e.g. memory=1g,pids=512,cpus=1,disk=256m,tmp=256m; docs/vm.md); "
                   "the ones not given keep their defaults")
    p.add_argument("--reset-fd", type=int, help=argparse.SUPPRESS)  # the launcher's socket for a reset's kill
    args = p.parse_args(argv)
    token = read_token(args)
    if args.token_for:
        if not token:
            sys.exit("vm_server: --token-for derives a VM's token from your secret; give the secret as $VM_TOKEN or --token.")
        print(vm_token(token, args.token_for))
        return
    if args.listen_fd is None and not is_loopback(args.host) and not token:
        sys.exit(f"vm_server: refusing to listen on {args.host} without a token; pass --token T (or set VM_TOKEN), or use --host 127.0.0.1.")
    m = re.fullmatch(r"(\d{3,4})x(\d{3,4})", args.screen)
    if not m or not (640 <= int(m[1]) <= 7680 and 480 <= int(m[2]) <= 4320):
        sys.exit(f"vm_server: --screen must look like 1280x720 (at least 640x480), got {args.screen!r}.")
    if not 0 < args.request_timeout <= 3600:
        sys.exit(f"vm_server: --request-timeout must be in (0, 3600] seconds, got {args.request_timeout:g}.")
    allow = DEFAULT_ALLOW | {a for a in args.allow_exec.split(",") if a}
    try:
        limits = _desktop("limits").parse(args.limits) if args.xvfb else None
    except ValueError as e:
        sys.exit(f"vm_server: --limits: {e}.")
    # Inside the sandbox bubblewrap hands us the folder it made for the desktop (see sandbox.launch).
    sandbox_tmp = os.environ.pop("VM_SERVER_SANDBOX", "")

    # SIGTERM/SIGHUP unwind like Ctrl-C, so the `finally` below stops every process we started.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: sys.exit(0))
    # env.launch_local_vms names its own pid here: a desktop it started then goes away with the
    # trainer, even a trainer killed with SIGKILL (its atexit cleanup never runs). Not set for a
    # server you start yourself, which outlives its shell.
    parent = os.environ.pop("VM_SERVER_PARENT", "")
    if parent.isdigit():
        threading.Thread(target=exit_with_parent, args=(int(parent),), daemon=True).start()
    sock = listening_socket(args)
    host, port = sock.getsockname()[:2]
    if not is_loopback(host) and not token:
        sys.exit(f"vm_server: refusing to serve on {host} without a token; pass --token T (or set VM_TOKEN).")
    if args.xvfb and not sandbox_tmp:
        if not args.no_sandbox:  # the desktop and this server again, inside bubblewrap; we wait and clean up
            inner = ["--xvfb", "--screen", args.screen, "--request-timeout", repr(args.request_timeout),
                     *(["--allow-exec", args.allow_exec] if args.allow_exec else []), *(["--verbose"] if args.verbose else [])]
            sys.exit(_desktop("sandbox").launch(inner, sock, token, limits))
        try:
            user = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:  # a uid without a passwd entry
            user = f"uid {os.getuid()}"
        print(f"vm_server: sandbox: off (--no-sandbox): the desktop's programs, its terminal included, run "
              f"unconfined on this machine as {user}", file=sys.stderr, flush=True)
    # PR_SET_CHILD_SUBREAPER (36): programs that double-fork (GLib's app launching does) are
    # re-parented to us instead of init, so /reset and exit still find them.
    prctl(36, 1)
    threading.Thread(target=reap_always, daemon=True).start()
    desk = None
    try:
        server = Server(sock)
        if args.xvfb:
            try:
                resets = socket.socket(fileno=args.reset_fd) if args.reset_fd is not None else None
                desk = _desktop().local_desktop((int(m[1]), int(m[2])), allow, sandbox_tmp or None, resets)
            except RuntimeError as e:  # a session part that never came up (see desktop._wait)
                sys.exit(f"vm_server: {e}; check that `bash setup.sh` ran on this machine.")
        elif not os.environ.get("DISPLAY"):
            sys.exit("vm_server: no DISPLAY; run it inside the VM's graphical session, or pass --xvfb.")
        import pyautogui  # only now: it opens $DISPLAY at import time
        # pyautogui's FAILSAFE aborts when the mouse reaches a screen corner. On a desktop a corner
        # is a legitimate target (a menu, a close button), and every coordinate is validated to lie
        # on the screen, so we turn it off on purpose.
        pyautogui.FAILSAFE = False
        pyautogui.PAUSE = 0.02  # a short breath after each input event, so apps see them in order
        if desk is None:
            desk = DesktopState(tuple(pyautogui.size()), os.path.expanduser("~"), dict(os.environ), allow,
                           display=os.environ["DISPLAY"])
        Handler.desk, Handler.token, Handler.verbose = desk, token, args.verbose
        Handler.request_timeout, Handler.names = args.request_timeout, local_names(host, port)
        print(f"vm_server: serving http://{host if ':' not in host else f'[{host}]'}:{port} display {desk.display} "
              f"screen {desk.screen[0]}x{desk.screen[1]} home {desk.home}", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:  # stop everything we started (apps, session, Xvfb) and remove the temp HOME
        kill_tree(keep=set())
        if desk is not None and desk.tmp and not sandbox_tmp:  # in the sandbox, the launcher outside removes it
            _desktop().remove_tree(desk.tmp)


if __name__ == "__main__":
    main()
