"""env.py: the trainer's side of the desktops.

What is here, top to bottom:
  1. `VMClient` (one desktop over HTTP) and `VMPool` (N desktops: one call on all of them at once,
     a thread fan-out with a deadline, so one dead or frozen VM never stalls or kills a run; or one
     VM at a time from its own thread, `call` and `revive`, as rollout.py steps them).
  2. `launch_local_vms`: N local Xvfb desktops (`vm_server.py --xvfb`) as subprocesses.

The action schema and the model-text parser (`Action`, `Parsed`, `smart_resize`, `to_screen`,
`parse_action`) are in actions.py, ARPO's task files (`Task`, `load_tasks`) in env.py: one
concept per file; parsing needs no VM, and a task file is checked without one.

Used by train_explore.py / train_arpo.py; tested by `python -m pytest -q tests/test_env.py`
(and tests/test_parse_action.py for actions.py); `python bench/fanout.py` measures the lockstep
fan-out.

Where this departs from the papers / upstream code:
  - The paper setups use a fixed pool of VMs; here a VM that stops answering drops out of the step
    (its slot reports an error) and is restarted on the next `reset()`.
  - (Parsing departures: see actions.py.)
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import Any

import requests
from PIL import Image
from urllib3.exceptions import ProtocolError

from actions import Action
from vm.rules import vm_token
from vm.tasks import CHECK_FIELDS, STEP_FIELDS

# ------------------------------------------------------------------------------------------------
# 1. One VM over HTTP, and N of them in lockstep


class VMError(RuntimeError):
    """A VM call failed. `status` is the HTTP status the VM answered with, or None when it could not
    be reached or did not answer in time (then the VM itself is suspect, not the request)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def refused(self) -> bool:
        """The VM refused the request itself (4xx: an unknown key, a bad field): the sender's fault,
        so an episode counts a refused action as the model's format failure. 401/403 (the token)
        and 408 (the request arrived too slowly) are the connection's, not the request's; no status
        (unreachable, silent) and 5xx (the VM's program failed) are the VM's: the environment's."""
        return self.status is not None and 400 <= self.status < 500 and self.status not in (401, 403, 408)


SETTLE_HELP = "--settle must be 'watch' or seconds from 0 to 10"


def parse_settle(value) -> str | float | None:
    """--settle -> "watch" (the server watches the screen after the action until it stops changing,
    with a cap: one round trip per step) or a fixed sleep in seconds (0 to 10, the papers' way:
    ARPO/OSWorld sleep 0.5 s); None if it is neither (SETTLE_HELP says what is). Numbers of old run
    folders (args.json) parse as before."""
    if isinstance(value, str) and value.strip().lower() == "watch":
        return "watch"
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if 0 <= seconds <= 10 else None


class VMClient:
    """One desktop (vm_server.py) over HTTP. Every call has a timeout (`timeout=` overrides the
    client's for one call). Only calls that are safe to repeat are retried on a connection error:
    screenshot, reset, evaluate; never act or setup (a repeated click or launch is a different
    episode). A read timeout is never retried: a VM that froze would just freeze us twice. The one
    exception is a request the server closed its connection on without reading it (`_send`): every
    call sends that one again, act and setup included, since it never ran."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()  # keep-alive: one TCP connection per VM, not one per call
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def close(self) -> None:
        self.session.close()

    def _call(self, method: str, path: str, body: Any = None, retries: int = 0,
              timeout: float | None = None) -> requests.Response:
        where, timeout = self.url + path, timeout or self.timeout
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(0.2 * attempt)
            try:
                r = self._send(method, where, body, timeout)
            except requests.Timeout:
                raise VMError(f"{where} did not answer within {timeout:g} s; the VM may be frozen or overloaded.") from None
            except requests.RequestException as e:
                if attempt < retries:
                    continue
                raise VMError(f"cannot reach {where} ({type(e).__name__}); check that vm_server.py runs there.") from None
            if r.status_code >= 500 and attempt < retries:
                continue
            if r.status_code != 200:
                try:
                    msg = r.json()["error"]
                except Exception:  # noqa: BLE001 -- not our JSON: show the start of whatever it was
                    msg = r.text[:200]
                raise VMError(f"{where} answered {r.status_code}: {msg}", status=r.status_code)
            return r

    def _send(self, method: str, where: str, body: Any, timeout: float) -> requests.Response:
        """One request, sent once more on a new connection if the server closed the connection
        without answering (http.client's RemoteDisconnected, or a reset). The race: the session
        keeps connections alive between calls, and vm_server.py closes one left idle for its
        --request-timeout; urllib3 replaces a pooled connection it sees closed, but one that closes
        while our request is on its way fails, and requests retries nothing. Safe even for
        POST /action: the server answers every request it read whole (an error included) and
        closes silently only before that (idle, a request cut off at its deadline, or room made
        for another connection), so the request never ran. A server killed mid-request closes
        silently too; then nothing listens and the second try fails to connect."""
        try:
            return self.session.request(method, where, json=body, timeout=timeout)
        except requests.ConnectionError as e:  # ConnectTimeout is one too: re-raised below
            cause = e.args[0] if e.args else None  # requests wraps urllib3's error, which wraps the socket's
            unanswered = isinstance(cause, ProtocolError) and isinstance(cause.args[-1], (ConnectionResetError,
                                                                                          BrokenPipeError))
            if not unanswered:
                raise
        return self.session.request(method, where, json=body, timeout=timeout)

    def health(self, timeout: float | None = None) -> dict:
        return self._call("GET", "/health", timeout=timeout).json()

    def screenshot(self, format: str = "png", quality: int = 90, timeout: float | None = None) -> Image.Image:
        query = "" if format == "png" else f"?format={format}&quality={quality}"
        for attempt in range(2):
            r = self._call("GET", "/screenshot" + query, retries=2, timeout=timeout)
            try:
                return decode_image(r.content)  # a truncated body fails here and is fetched again
            except Exception as e:  # noqa: BLE001 -- PIL raises several types for a bad image
                err = VMError(f"{self.url}/screenshot returned an image that does not decode ({e}).")
        raise err

    def windows(self, timeout: float | None = None) -> list[dict]:
        """The desktop's application windows, [{"id": X window id, "title": str, "class": WM_CLASS}],
        oldest first ("class" is "instance.Class", e.g. "xterm.XTerm"; `app_of` names the app)."""
        return self._call("GET", "/windows", retries=2, timeout=timeout).json()["windows"]

    def act(self, action: Action | dict, settle: str | float | None = None, screenshot: str | bool = False,
            timeout: float | None = None, quality: int = 90) -> dict | ActResult:
        """Run one action. `settle`: None answers as soon as it ran; "watch" once the desktop has
        settled (the server watches it: vm_server.py, vm/settle.py); a number sleeps that many seconds
        there (0-10, the papers' fixed settle). `screenshot` "png"/"jpeg": answer with the settled
        screen in the same round trip -> ActResult(image, settle); else -> {"ok": True, "settle":
        {...}}. The settle dict: seconds waited, until ("quiet", "nochange", "cap", "fixed",
        "none"), first_change (seconds from the action's start, or None)."""
        body = action.to_dict() if isinstance(action, Action) else action
        if isinstance(settle, str) and settle != "watch":
            raise ValueError(f"settle must be None, 'watch' or seconds, got {settle!r}.")
        screenshot = "png" if screenshot is True else screenshot
        query = {"settle": settle if settle in (None, "watch") else f"{float(settle):.3f}",
                 "screenshot": screenshot or None, "quality": quality if screenshot in ("jpeg", "jpg") else None}
        query = "&".join(f"{k}={v}" for k, v in query.items() if v is not None)
        r = self._call("POST", "/action" + ("?" + query if query else ""), body, timeout=timeout)
        if not screenshot:
            return r.json()
        info = json.loads(r.headers.get("X-Settle", "{}"))
        try:
            return ActResult(decode_image(r.content), info)
        except Exception:  # noqa: BLE001 -- a body cut short; the action must not run twice, the screen can be read again
            return ActResult(self.screenshot(screenshot, quality, timeout=timeout), info)

    def reset(self, timeout: float | None = None) -> dict:
        return self._call("POST", "/reset", {}, retries=1, timeout=timeout).json()

    def setup(self, steps: list[dict], timeout: float | None = None) -> dict:
        if not steps:  # the server wants 1..64 steps; a task without setup needs no request
            return {"ok": True, "results": []}
        return self._call("POST", "/setup", {"steps": steps}, timeout=timeout).json()

    def evaluate(self, evaluator: dict, timeout: float | None = None) -> dict:
        return self._call("POST", "/evaluate", evaluator, retries=1, timeout=timeout).json()


# The --xvfb desktop's apps (vm/desktop.py's DESKTOP_APPS, named by their file stems) by the class
# part of WM_CLASS, lowercased. Classes, not titles: the file manager's title is its folder, the
# editor's its file, and XCalc calls itself "Calculator".
APP_CLASSES = {"xterm": "terminal", "mousepad": "editor", "galculator": "calculator", "pcmanfm": "files",
               "xclock": "clock", "xeyes": "eyes", "xcalc": "xcalc"}


def app_of(window: dict) -> str | None:
    """The desktop app a window of VMClient.windows() belongs to ("terminal", "editor", ...), or None
    for any other program's (tint2conf, xmessage, openbox's own dialogs) and for a window without a
    class (an older server sends none). An app's own dialogs share its class, so mousepad's Open File
    dialog is the editor's: this names the program, not the kind of window. None rather than an
    "other:<class>" label, so a count of apps counts apps; window["class"] is there for the rest."""
    return APP_CLASSES.get(window.get("class", "").rpartition(".")[2].lower())


@dataclass
class ActResult:
    """What VMClient.act(..., screenshot=...) answers: the settled screen and how it settled."""
    image: Image.Image   # RGB
    settle: dict         # {"seconds", "until", "first_change"}, the server's X-Settle header


def decode_image(data: bytes) -> Image.Image:
    img = Image.open(BytesIO(data))
    img.load()  # decode now, so a truncated body fails here
    if img.mode != "RGB":
        return img.convert("RGB")
    if img.format == "PNG":  # what it came as: lossless, so png_bytes() need not encode it again
        _PNG[id(img)] = (weakref.ref(img), data)
        weakref.finalize(img, _PNG.pop, id(img), None)  # the entry goes with the image, before its id is reused
    return img


# id(screenshot) -> (weak reference to it, the PNG bytes it was decoded from). Not in the image's
# own `info`: Pillow copies that into every image made from it (a crop would claim the bytes of
# the whole screen), and a weak reference in it would make the image unpicklable.
_PNG: dict[int, tuple] = {}


def png_bytes(img: Image.Image) -> bytes:
    """A screenshot as PNG bytes: those it arrived as, when a VM sent it as an RGB PNG (the same
    pixels: PNG is lossless), else encoded here (level 1: much faster than 6, a little bigger). The
    trainers store every screenshot (trajectory files, the replay buffer); encoding each one again
    took a tenth of the trainer's CPU on the two-step bench (bench/arpo_multi_iter.py)."""
    hit = _PNG.get(id(img))
    if hit is not None and hit[0]() is img:
        return hit[1]
    buf = BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


@dataclass
class VMResult:
    ok: bool
    value: Any = None
    error: str | None = None


_CALLS = ("health", "screenshot", "windows", "act", "reset", "setup", "evaluate")


class VMPool:
    """N desktops. `vms`: an int (launch that many local Xvfb desktops), or URLs of running
    vm_server.py instances (a list or one comma-separated string) -- what `--vms` takes.

    `map` (and screenshots, act, reset, ...) fans one call out to every VM in threads and returns
    one VMResult per VM, in order, within `timeout` seconds, whatever the VMs do: a VM that errors
    gives ok=False with the error; one that does not answer in time is marked down (`alive[i]`
    False) and skipped (an immediate error) until `reset()`, which restarts dead local desktops and
    re-checks remote ones. Those are driven from one thread (the trainer's). The trainers' rollouts
    drive each VM from a thread of its own instead (rollout.py): `call(i, ...)` one request,
    `revive(i)` a health check and, for a local desktop, a restart of that one alone. `token` is the
    secret each VM's own token is derived from (vm.rules.vm_token; `python vm_server.py --token-for
    URL` prints a remote VM's); local desktops without one get random tokens."""

    def __init__(self, vms: int | str | list[str] = (), token: str | None = None, timeout: float = 30,
                 screen: tuple[int, int] = (1280, 720), first: int = 0, limits: str = "", clients: list | None = None):
        if clients:  # clients of another kind with VMClient's calls (osworld_env.OSWorldClient), remote
            vms = [c.url for c in clients]
        if isinstance(vms, str) and vms.strip().isdigit():
            vms = int(vms)
        if isinstance(vms, str):
            vms = [u.strip() for u in vms.split(",") if u.strip()]
        self.timeout, self.screen = timeout, tuple(screen)
        self.first = first  # the number of its first VM in the run (torchrun: among all ranks'; rollout.Desktop.id)
        self.limits = limits  # local desktops' bounds (vm_server.py --limits; "" = its defaults)
        self.local: list[LocalVM] | None = None
        # Every VM has a token of its own: a local desktop a random one (or, given a secret, the
        # one derived from it), a remote VM the one derived from the secret and its URL (see
        # vm.rules.vm_token), so a token read inside one VM opens no other.
        self._secret = token
        if isinstance(vms, int):
            if vms < 1:
                raise ValueError(f"--vms must be at least 1, got {vms}.")
            self.local = launch_local_vms(vms, screen=self.screen, token=token, limits=limits)
            vms, tokens = [vm.url for vm in self.local], [vm.token for vm in self.local]
        else:
            tokens = [vm_token(token, u) if token else None for u in vms]
        if not vms:
            raise ValueError("no VMs given: pass a number of local desktops or a list of URLs.")
        self.urls = list(vms)
        self.clients = list(clients) if clients else [VMClient(u, t, timeout) for u, t in zip(self.urls, tokens)]
        self.alive = [True] * len(self.urls)
        self.why_down: list[str | None] = [None] * len(self.urls)
        # The call still running on each VM. A VM whose last call outlived its deadline gets no new
        # call until that one ends: its thread is stuck in a socket read (requests ends it after
        # `timeout`), and piling more requests on a frozen VM would only pile up threads.
        self._inflight: list[Any] = [None] * len(self.urls)
        self._generation = [0] * len(self.urls)  # bumped on restart: late results of the old VM are ignored
        # 2 workers per VM: after a restart the old VM's stuck thread may still hold one.
        self._executor = ThreadPoolExecutor(max_workers=2 * len(self.urls), thread_name_prefix="vmpool")
        # One lock per VM for revive(): the rollout stepper drives each VM from a thread of its own.
        self._locks = [threading.Lock() for _ in self.urls]
        # A /reset started when VM i's episode ended (reset_ahead), for its next episode to take:
        # (the VM's generation then, the Future), or None.
        self._ahead: list[Any] = [None] * len(self.urls)

    @property
    def size(self) -> int:
        return len(self.urls)

    def _mark_down(self, i: int, gen: int, why: str) -> None:
        if self._generation[i] == gen:
            self.alive[i], self.why_down[i] = False, why

    def mark_down(self, i: int, why: str) -> None:
        """VM i is out until revive(i) or reset() (the rollout stepper's watchdog gave up on it)."""
        self._mark_down(i, self._generation[i], why)

    # -- One VM at a time, from that VM's own thread (rollout.py): call, revive

    def call(self, i: int, fn_name: str, *args, **kwargs):
        """VMClient.<fn_name>(*args, **kwargs) on VM i -> its answer; raises VMError. An answer that
        never came (unreachable, silent: status None) or any other client-side failure marks the VM
        down, as map() does; an HTTP error status leaves it up (the request, or the VM's own
        program, failed: revive() tells which). Calls on different VMs may run in parallel."""
        if fn_name not in _CALLS:
            raise ValueError(f"VMPool.call: unknown call {fn_name!r}; one of {list(_CALLS)}.")
        gen, client = self._generation[i], self.clients[i]
        try:
            return getattr(client, fn_name)(*args, **kwargs)
        except VMError as e:
            if e.status is None:
                self._mark_down(i, gen, str(e))
            raise
        except Exception as e:  # noqa: BLE001 -- a garbled answer: the VM's fault, in its own words
            why = f"{self.urls[i]}: {type(e).__name__}: {e}"
            self._mark_down(i, gen, why)
            raise VMError(why) from None

    def reset_ahead(self, i: int) -> None:
        """Start VM i's POST /reset now, in the background, for the next episode on it, which begins
        with one (rollout.Desktop.reset takes it, waiting only for what is left of it). A desktop
        whose episode ended is then reset while the learner updates and the other desktops play,
        instead of at the start of the next iteration, when the learner has nothing to do. Call it
        only where the desktop's next use is a reset: nothing else may touch the desktop meanwhile."""
        self._ahead[i] = (self._generation[i], self._executor.submit(self.call, i, "reset"))

    def take_ahead(self, i: int):
        """VM i's pending reset_ahead (a Future of its /reset answer), or None: none was started, or
        the VM was restarted since (the new desktop is fresh anyway)."""
        ahead, self._ahead[i] = self._ahead[i], None
        return ahead[1] if ahead is not None and ahead[0] == self._generation[i] else None

    def revive(self, i: int) -> bool:
        """Make VM i fit for a new episode, from its own thread: True if it answers /health (a local
        desktop also needs its process running and not to have been marked down), else a local
        desktop is restarted (only this one; the others go on) and a remote one stays down.
        Thread-safe: one revive per VM at a time."""
        with self._locks[i]:
            local = self.local[i] if self.local is not None else None
            if self.alive[i] and (local is None or local.proc.poll() is None):
                try:
                    self.clients[i].health(timeout=min(10.0, self.timeout))
                    return True
                except VMError as e:
                    self._mark_down(i, self._generation[i], str(e))
            elif local is None:  # a remote VM that was down: back if it answers now
                try:
                    self.clients[i].health(timeout=min(10.0, self.timeout))
                    self.alive[i], self.why_down[i] = True, None
                    return True
                except VMError as e:
                    self.why_down[i] = str(e)
            if local is None:
                return False
            stop_vms([local])
            try:
                (vm,) = launch_local_vms(1, screen=self.screen, token=self._secret, limits=self.limits)
            except Exception as e:  # noqa: BLE001 -- the slot stays down, the run goes on without it
                self._mark_down(i, self._generation[i], f"restart failed: {e}")
                return False
            self._install(i, vm)
            return True

    def _install(self, i: int, vm: LocalVM) -> None:
        """A freshly started local desktop takes slot i; late results of the old one are ignored."""
        self._generation[i] += 1
        self.local[i], self.urls[i] = vm, vm.url
        self.clients[i] = VMClient(vm.url, vm.token, self.timeout)
        self._inflight[i], self.alive[i], self.why_down[i] = None, True, None

    def _run(self, i: int, gen: int, fn_name: str, args: tuple, timeout: float) -> VMResult:
        try:
            return VMResult(True, getattr(self.clients[i], fn_name)(*args, timeout=timeout))
        except VMError as e:
            if e.status is None:  # unreachable or silent: the VM, not the request, is the problem
                self._mark_down(i, gen, str(e))
            return VMResult(False, error=str(e))
        except Exception as e:  # noqa: BLE001 -- whatever happens in one VM stays in its slot
            return VMResult(False, error=f"{self.urls[i]}: {type(e).__name__}: {e}")

    def map(self, fn_name: str, args_per_vm: list | None = None, timeout: float | None = None) -> list[VMResult]:
        """Call VMClient.<fn_name>(args_per_vm[i]) on every VM at once (no argument when
        args_per_vm is None). A None entry sends nothing to that VM (VMResult(ok=True, value=None)).
        Returns within `timeout` (default: the pool's) even if some VMs hang."""
        if fn_name not in _CALLS:
            raise ValueError(f"VMPool.map: unknown call {fn_name!r}; one of {list(_CALLS)}.")
        if args_per_vm is not None and len(args_per_vm) != self.size:
            raise ValueError(f"VMPool.map: {len(args_per_vm)} arguments for {self.size} VMs.")
        timeout = self.timeout if timeout is None else timeout
        results: list[VMResult | None] = [None] * self.size
        futures = {}
        for i in range(self.size):
            busy = self._inflight[i] is not None and not self._inflight[i].done()
            if not self.alive[i]:
                results[i] = VMResult(False, error=f"{self.urls[i]} is down ({self.why_down[i]}); VMPool.reset() restarts or re-checks it.")
            elif busy:
                results[i] = VMResult(False, error=f"{self.urls[i]} is still busy with an earlier call that timed out.")
            elif args_per_vm is not None and args_per_vm[i] is None:
                results[i] = VMResult(True)
            else:
                args = () if args_per_vm is None else (args_per_vm[i],)
                fut = self._executor.submit(self._run, i, self._generation[i], fn_name, args, timeout)
                futures[fut] = i
                self._inflight[i] = fut
        done, _ = wait_futures(futures, timeout=timeout)
        for fut, i in futures.items():
            if fut in done:
                results[i] = fut.result()  # _run never raises
            else:
                why = f"{self.urls[i]} did not finish {fn_name} within {timeout:g} s"
                self._mark_down(i, self._generation[i], why)
                results[i] = VMResult(False, error=why + "; it is marked down until VMPool.reset().")
        return results

    def screenshots(self) -> list[VMResult]:
        return self.map("screenshot")

    def windows(self) -> list[VMResult]:
        return self.map("windows")

    def act(self, actions: list[Action | dict | None]) -> list[VMResult]:
        return self.map("act", actions)

    def setup(self, steps_per_vm: list[list[dict] | None], timeout: float | None = None) -> list[VMResult]:
        return self.map("setup", steps_per_vm, timeout)

    def evaluate(self, evaluators: list[dict | None], timeout: float | None = None) -> list[VMResult]:
        return self.map("evaluate", evaluators, timeout)

    def reset(self, timeout: float | None = None) -> list[VMResult]:
        """Bring dead VMs back, then POST /reset on every VM. A local desktop is restarted when its
        process exited, its health check fails, or it was marked down; a remote one is re-checked
        and comes back if it answers /health. VMs that stay down report an error in their slot."""
        for i in range(self.size):
            if not self.alive[i] and self.local is None and (self._inflight[i] is None or self._inflight[i].done()):
                self.alive[i] = True  # remote: give it a health check below
        health = self.map("health", timeout=min(10.0, self.timeout))
        bad = [i for i, h in enumerate(health)
               if not h.ok or (self.local is not None and self.local[i].proc.poll() is not None)]
        if self.local is not None and bad:
            stop_vms([self.local[i] for i in bad])
            try:
                fresh = launch_local_vms(len(bad), screen=self.screen, token=self._secret, limits=self.limits)
            except Exception as e:  # noqa: BLE001 -- reset never raises: the slots stay down
                for i in bad:
                    self._mark_down(i, self._generation[i], f"restart failed: {e}")
                fresh = []
            for i, vm in zip(bad, fresh):
                self._install(i, vm)
        return self.map("reset", timeout=timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        stop_vms(self.local or [])
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------------
# 2. Local desktops: `vm_server.py --xvfb` subprocesses

_LAUNCHED: list[LocalVM] = []  # stopped at interpreter exit, so no Xvfb outlives the trainer


@dataclass
class LocalVM:
    url: str
    proc: subprocess.Popen
    log: str           # the server's stdout + stderr (deleted when it is stopped)
    token: str | None = None  # its own bearer token (held here, by the trainer, only)

    def stop(self, keep_log: bool = False) -> None:
        stop_vms([self], keep_log)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_vms(vms: list[LocalVM], keep_log: bool = False) -> None:
    """Stop local desktops and everything they started, all at once (not one grace period each).
    Each server leads its own process group; SIGCONT goes with SIGTERM because a stopped (SIGSTOP)
    process would hold the SIGTERM pending forever. What is left after 5 s gets SIGKILL."""
    for vm in vms:
        if vm.proc.poll() is None:
            _killpg(vm.proc.pid, signal.SIGTERM)
            _killpg(vm.proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + 5
    for vm in vms:
        try:
            vm.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        _killpg(vm.proc.pid, signal.SIGKILL)  # leftovers in the group, or a server that ignored TERM
        try:
            vm.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _remove_orphan_tmp(vm)
        if not keep_log and os.path.exists(vm.log):
            os.unlink(vm.log)
        if vm in _LAUNCHED:
            _LAUNCHED.remove(vm)


atexit.register(lambda: stop_vms(list(_LAUNCHED)))


def _remove_orphan_tmp(vm: LocalVM) -> None:
    # A server that was SIGKILLed (or crashed) could not remove its temp dir (HOME copy, X runtime
    # dir). Its start line in the log names it ("... home /tmp/vm_server-XXXX/home"); remove it
    # here, so restarts in a long run do not pile them up. Only dirs that look like the server's.
    try:
        with open(vm.log, errors="replace") as f:
            m = re.search(r" home (\S+)/home\s*$", f.read(4096), re.M)
    except OSError:
        return
    tmp = m.group(1) if m else ""
    if vm.proc.returncode != 0 and os.path.basename(tmp).startswith("vm_server-") and \
            os.path.dirname(tmp) == tempfile.gettempdir():
        shutil.rmtree(tmp, ignore_errors=True)


def _log_tail(path: str, n: int = 600) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def launch_local_vms(n: int, screen: tuple[int, int] = (1280, 720), token: str | None = None, limits: str = "",
                     timeout: float = 90) -> list[LocalVM]:
    """Start n local desktops (`vm_server.py --xvfb`, each with its own display, HOME and port)
    and wait until all answer /health. They start in parallel: 8 take about as long as one.

    Each gets a token of its own (`LocalVM.token`): a random one, or with `token` (a secret) the
    one vm.rules.vm_token derives from it and the desktop's URL, as for remote VMs. We bind each
    port here and hand the socket over (--listen-fd), so no other process can take the port
    before the server starts, and the token travels through a pipe (--token-fd): it is in no argv
    and no environment, where `ps` or a process on the desktop could read it. `limits`: each
    desktop's bounds (vm_server.py --limits, vm/limits.py; "" = the defaults)."""
    if shutil.which("Xvfb") is None:
        raise VMError("Xvfb is not installed, so no local desktop can start; run `bash setup.sh`.")
    server = Path(__file__).resolve().with_name("vm_server.py")

    def start() -> LocalVM:
        sock = socket.create_server(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        tok = vm_token(token, url) if token else secrets.token_urlsafe(16)
        r, w = os.pipe()
        os.write(w, tok.encode())  # far below a pipe's buffer: the server reads it when it starts
        os.close(w)
        log = tempfile.NamedTemporaryFile(prefix=f"vm_server-{url.rsplit(':', 1)[1]}-", suffix=".log", delete=False)
        cmd = [sys.executable, str(server), "--xvfb", "--listen-fd", str(sock.fileno()), "--token-fd", str(r),
               "--screen", f"{screen[0]}x{screen[1]}", *(["--limits", limits] if limits else [])]
        # VM_SERVER_PARENT: the server exits when we do, even when we are SIGKILLed and atexit never runs.
        env = {k: v for k, v in os.environ.items() if k != "VM_TOKEN"} | {"VM_SERVER_PARENT": str(os.getpid())}
        try:
            # start_new_session: the server leads its own process group, so stop() reaches its Xvfb,
            # window manager and apps too, and a Ctrl-C in our terminal does not hit them first.
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=env, start_new_session=True, pass_fds=(sock.fileno(), r))
        finally:
            os.close(r)
            sock.close()  # the server holds the socket now
            log.close()
        vm = LocalVM(url, proc, log.name, tok)
        _LAUNCHED.append(vm)
        return vm

    vms: list[LocalVM] = []
    try:
        vms = [start() for _ in range(n)]
        pending, deadline = set(range(n)), time.monotonic() + timeout
        probe = [VMClient(vm.url, vm.token, timeout=2) for vm in vms]
        while pending:
            for i in sorted(pending):
                if vms[i].proc.poll() is not None:
                    raise VMError(f"local desktop {vms[i].url} exited with code {vms[i].proc.returncode}: "
                                  f"{_log_tail(vms[i].log)} (full log: {vms[i].log}).")
                try:
                    probe[i].health()
                    pending.discard(i)
                except VMError:
                    pass
            if pending and time.monotonic() > deadline:
                raise VMError(f"{len(pending)} local desktop(s) did not answer /health within {timeout:g} s; "
                              f"see {vms[min(pending)].log}.")
            time.sleep(0.1)
    except BaseException:
        stop_vms(vms, keep_log=True)  # the error message points at a log: keep it
        raise
    return vms

# ------------------------------------------------------------------------------------------------
# 3. Task files (tasks/*.json): `Task`, and `load_tasks`, which checks each file against the
# server's own schema of steps and checks (vm/tasks.py: STEP_FIELDS, CHECK_FIELDS) before a run
# starts, so a typo fails when the tasks load, not in the middle of a run; a solution's actions are
# checked with actions.py's schema. tasks/README.md has the format; `python tasks/prove.py <id>`
# proves a task solvable on one desktop (tests/test_tasks.py: every shipped task).


class TaskError(ValueError):
    """A malformed task file; the message names the file and the field."""


@dataclass
class Task:
    """One task file (tasks/README.md has the format). `solution` is its scripted solution, Action
    dicts in screen pixels, replayed by `python tasks/prove.py` and tests/test_tasks.py to prove the
    task solvable. The trainers never show it to a model: a prompt is built from `instruction` and
    the screenshots alone (model.uitars_messages takes the instruction string), and a trajectory file
    records the task's id and instruction only (tests/test_tasks.py checks both)."""
    id: str
    instruction: str
    setup: list[dict]
    evaluator: dict
    max_steps: int = 15
    infeasible: bool = False
    apps: tuple[str, ...] = ()
    solution: list[dict] = field(default_factory=list)
    domain: str = ""  # OSWorld's domain of the task (osworld_env.load_tasks); "" for ours


# A task file is checked against the server's own schema of steps and checks (vm.tasks.STEP_FIELDS,
# CHECK_FIELDS), so a typo fails when the tasks load, not in the middle of a run.
# `notes` is free text for the people who read the file (why the solution does what it does); nothing
# loads it.
_TASK = {"id": (str, True), "instruction": (str, True), "apps": (list, False), "setup": (list, False),
         "evaluator": (dict, True), "max_steps": (int, False), "infeasible": (bool, False),
         "solution": (list, False), "notes": (str, False)}


def _check_fields(item: dict, fields_: dict, where: str, fail) -> None:
    """Unknown fields, missing required ones, wrong types (a bool is not a number here)."""
    for k in item:
        if k != "type" and k not in fields_:
            fail(f"{where}{k}", f"is unknown here (allowed: {sorted(fields_)})")
    for k, (types, required) in fields_.items():
        v = item.get(k)
        if v is None and required:
            fail(f"{where}{k}", "is missing")
        if v is not None and (isinstance(v, bool) and types is not bool or not isinstance(v, types)):
            fail(f"{where}{k}", f"must be of type {getattr(types, '__name__', 'number')}, got {v!r}")


def _check_entry(item: Any, schema: dict, where: str, fail) -> None:
    """One setup step or evaluator check."""
    if not isinstance(item, dict) or item.get("type") not in schema:
        fail(where, f"must be an object whose 'type' is one of {sorted(schema)}")
    _check_fields(item, schema[item["type"]], where + ".", fail)
    if "argv" in item and not (item["argv"] and all(isinstance(a, str) and a for a in item["argv"])):
        fail(f"{where}.argv", "must be a non-empty list of strings")
    if "regex" in item:
        try:
            re.compile(item["regex"])
        except re.error as e:
            fail(f"{where}.regex", f"is not a valid regular expression ({e})")
    if item["type"] == "sleep" and not 0 <= item["seconds"] <= 30:
        fail(f"{where}.seconds", "must be between 0 and 30")
    if item["type"] == "file_contains" and ("text" in item) == ("regex" in item):
        fail(where, "needs exactly one of 'text' or 'regex'")


def _task_from_dict(d: Any, where: str) -> Task:
    def fail(field_: str, problem: str):
        raise TaskError(f"{where}: field '{field_}' {problem}; fix the task file.")

    if not isinstance(d, dict):
        raise TaskError(f"{where}: a task must be a JSON object; fix the task file.")
    _check_fields(d, _TASK, "", fail)
    for k in ("id", "instruction"):
        if not d[k].strip():
            fail(k, "is empty")
    if not 1 <= d.get("max_steps", 15) <= 100:
        fail("max_steps", f"must be from 1 to 100, got {d['max_steps']}")
    if not all(isinstance(a, str) for a in d.get("apps", [])):
        fail("apps", "must be a list of strings")
    setup, ev, infeasible = d.get("setup", []), d["evaluator"], d.get("infeasible", False)
    if len(setup) > 64:
        fail("setup", "has more than 64 steps")
    for j, step in enumerate(setup):
        _check_entry(step, STEP_FIELDS, f"setup[{j}]", fail)
    _check_fields(ev, {"conj": (str, False), "checks": (list, True)}, "evaluator.", fail)
    if ev.get("conj", "and") not in ("and", "or"):
        fail("evaluator.conj", "must be 'and' or 'or'")
    if not 0 < len(ev["checks"]) <= 64 and not (infeasible and not ev["checks"]):
        fail("evaluator.checks", "must hold 1 to 64 checks (only an infeasible task may have none)")
    for j, check in enumerate(ev["checks"]):
        _check_entry(check, CHECK_FIELDS, f"evaluator.checks[{j}]", fail)
    solution = []
    for j, a in enumerate(d.get("solution", [])):  # the server's own action schema (actions.py)
        try:
            solution.append(Action.from_dict(a).to_dict())
        except ValueError as e:
            fail(f"solution[{j}]", f"is not a valid action ({str(e).rstrip('.')})")
        # `done` and `fail` end an episode: whatever came after them could never be played
        if a["type"] in ("done", "fail") and j < len(d["solution"]) - 1:
            fail(f"solution[{j}]", f"ends the episode ('{a['type']}') before the last action")
    if len(solution) > d.get("max_steps", 15):
        fail("solution", f"has {len(solution)} actions, more than max_steps ({d.get('max_steps', 15)}) allows")
    return Task(d["id"], d["instruction"], setup, {"conj": ev.get("conj", "and"), "checks": ev["checks"]},
                d.get("max_steps", 15), infeasible, tuple(d.get("apps", [])), solution)


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Load one task file or every *.json in a directory (sorted). Each file holds a task object
    or a list of them. Any problem raises TaskError naming the file and the field."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise TaskError(f"{path}: no *.json task files in this directory.")
    elif path.is_file():
        files = [path]
    else:
        raise TaskError(f"{path}: no such task file or directory.")
    tasks, seen = [], {}
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TaskError(f"{f}: cannot read it ({e}).") from None
        except json.JSONDecodeError as e:
            raise TaskError(f"{f}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from None
        items = data if isinstance(data, list) else [data]
        for k, d in enumerate(items):
            task = _task_from_dict(d, f"{f}" + (f"[{k}]" if isinstance(data, list) else ""))
            if task.id in seen:
                raise TaskError(f"{f}: field 'id': duplicate task id {task.id!r} (also in {seen[task.id]}); ids must be unique.")
            seen[task.id] = f
            tasks.append(task)
    return tasks
