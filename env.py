"""env.py: the trainer's side of the desktops.

What is here, top to bottom:
  1. `Action`, the one action schema (screen pixels) that vm_server.py executes.
  2. `smart_resize` + `parse_action`: model text -> Action, for the two formats the models speak
     (`explore`: ScreenExplorer's JSON; `uitars`: UI-TARS-1.5's "Thought: ... Action: ...").
  3. `VMClient` (one desktop over HTTP) and `VMPool` (N desktops in lockstep, thread fan-out with a
     deadline, so one dead or frozen VM never stalls or kills a run).
  4. `launch_local_vms`: N local Xvfb desktops (`vm_server.py --xvfb`) as subprocesses.
  5. `Task` + `load_tasks`: ARPO's task files (tasks/*.json).

Used by train_explore.py / train_arpo.py; tested by
`python -m pytest -q tests/test_parse_action.py tests/test_env.py`; `python bench/fanout.py`
measures the lockstep fan-out.

Where this departs from the papers / upstream code:
  - ScreenExplorer's Text(x, y, "t") becomes one `type` action with x, y set; vm_server.py clicks
    at (x, y) before typing, so the model's single action stays a single request.
  - UI-TARS's parser in upstream code evaluates the action string with Python's ast; we never
    evaluate model text, we tokenize it with a few linear regexes (and cap its length).
  - The paper setups use a fixed pool of VMs; here a VM that stops answering drops out of the step
    (its slot reports an error) and is restarted on the next `reset()`.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import asdict, dataclass
from io import BytesIO
from pathlib import Path
from typing import Any

import requests
from PIL import Image

# ------------------------------------------------------------------------------------------------
# 1. Actions

# type -> (required fields, optional fields): the same table vm_server.py checks POST /action with.
_ACTION_FIELDS = {
    "move": (("x", "y"), ()), "click": ((), ("x", "y")), "double_click": ((), ("x", "y")),
    "right_click": ((), ("x", "y")), "drag": (("x", "y", "x2", "y2"), ()),
    "scroll": (("direction",), ("x", "y", "amount")), "type": (("text",), ("x", "y")),
    "key": (("keys",), ()), "wait": ((), ("amount",)), "done": ((), ()), "fail": ((), ()),
}
ACTION_TYPES = tuple(_ACTION_FIELDS)
DIRECTIONS = ("up", "down", "left", "right")
MAX_TEXT_CHARS = 2000  # longest `type` text we accept; mirrors the server's limit (a runaway
                       # generation is a format failure here, not a 400 from the VM later)
MAX_KEYS = 8           # a hotkey longer than this is not a hotkey


@dataclass
class Action:
    """One desktop action in screen pixels (the body of POST /action). Unused fields stay None."""
    type: str
    x: int | None = None
    y: int | None = None
    x2: int | None = None
    y2: int | None = None
    text: str | None = None
    keys: list[str] | None = None
    direction: str | None = None
    amount: int | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: Any) -> Action:
        """Validate a dict (e.g. a trajectory line read back from disk) with the server's rules
        (except the screen bounds and key names, which only the VM knows) and build the Action."""
        t = d.get("type") if isinstance(d, dict) else None
        if t not in _ACTION_FIELDS:
            raise ValueError(f"an action needs 'type' in {list(ACTION_TYPES)}, got {t!r}.")
        d = {k: v for k, v in d.items() if v is not None}
        required, optional = _ACTION_FIELDS[t]
        extra = sorted(set(d) - {"type", *required, *optional})
        if extra:
            raise ValueError(f"a {t!r} action does not take field(s) {extra}.")
        missing = [k for k in required if k not in d]
        if missing or ("x" in d) != ("y" in d):
            raise ValueError(f"a {t!r} action needs field(s) {missing or ['x', 'y']}.")
        for k in ("x", "y", "x2", "y2", "amount"):
            if k in d and (isinstance(d[k], bool) or not isinstance(d[k], int)):
                raise ValueError(f"action field {k!r} must be an integer, got {d[k]!r}.")
        if t == "type" and not (isinstance(d["text"], str) and 0 < len(d["text"]) <= MAX_TEXT_CHARS
                                and "\0" not in d["text"]):
            raise ValueError(f"a 'type' action needs 'text': a string of 1 to {MAX_TEXT_CHARS} characters.")
        if t == "key" and not (isinstance(d["keys"], list) and 0 < len(d["keys"]) <= MAX_KEYS
                               and all(isinstance(k, str) and k for k in d["keys"])):
            raise ValueError(f"a 'key' action needs 'keys': a list of 1 to {MAX_KEYS} key names.")
        if t == "scroll" and d["direction"] not in DIRECTIONS:
            raise ValueError(f"a 'scroll' action needs 'direction' in {list(DIRECTIONS)}.")
        return cls(**{k: (list(v) if k == "keys" else v) for k, v in d.items()})


@dataclass
class Parsed:
    action: Action  # in screen pixels, already clamped into the screen
    thought: str    # ScreenExplorer's "intent" or UI-TARS's "Thought"


# ------------------------------------------------------------------------------------------------
# 2. Model text -> Action

# Qwen2.5-VL's image processor defaults (transformers Qwen2VLImageProcessor: size shortest_edge =
# 56*56, longest_edge = 28*28*1280). A 1280x720 screen stays near full size: 1288x728.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_INPUT_CHARS = 16_000  # longer model outputs are runaway generations: a format failure, fast


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) Qwen2.5-VL resizes an image to: both sides multiples of `factor` (28 =
    14-pixel patches merged 2x2), total pixels within [min_pixels, max_pixels], aspect ratio kept
    as far as rounding allows. The model's coordinates live in this resized image."""
    if height < 1 or width < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"cannot resize a {width}x{height} image (aspect ratio must stay below 200).")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        # Shrink both sides by the same beta, rounding down so we land under the budget.
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        # Grow both sides, rounding up so we land over the floor.
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_screen(x: float, y: float, screen: tuple[int, int], image: tuple[int, int] | None = None,
              rel1000: bool = False) -> tuple[int, int] | None:
    """Map a model coordinate to a screen pixel, clamped into the screen (None if not finite).
    image=(w, h) the model saw -> scale by screen/image; rel1000 -> x/1000 of the screen width
    (UI-TARS-1.0 style); neither -> already screen pixels."""
    if not (math.isfinite(x) and math.isfinite(y)):
        return None
    sw, sh = screen
    if rel1000:
        x, y = x * sw / 1000, y * sh / 1000
    elif image is not None:
        x, y = x * sw / image[0], y * sh / image[1]
    # floor(v + 0.5) rounds halves up; Python's round() would round them to even.
    return min(max(math.floor(x + 0.5), 0), sw - 1), min(max(math.floor(y + 0.5), 0), sh - 1)


# One argument of a call: optional `name=`, then a quoted string (escapes allowed), a (..)/[..]
# group, or a bare word/number. Every alternative is linear: no nested quantifiers, no backtracking
# blow-up on adversarial text.
_ARG = re.compile(r"""\s*(?:(?P<key>[A-Za-z_]\w*)\s*=\s*)?(?:'(?P<sq>(?:[^'\\]|\\.)*)'|"(?P<dq>(?:[^"\\]|\\.)*)"|(?P<grp>\([^()]*\)|\[[^\[\]]*\])|(?P<bare>[^\s,()'"\[\]=]+))\s*""", re.S)
_CALL = re.compile(r"\s*([A-Za-z_]\w*)\s*\(\s*")
_NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def _unescape(s: str) -> str:
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(1)), s, flags=re.S)


def _parse_call(s: str) -> tuple[str, list[str], dict[str, str]] | None:
    """`name(a, b, key='v')` at the start of s -> (lower-cased name, args, kwargs), values as
    strings (quotes removed, escapes resolved). Text after the closing paren is ignored; a call
    that never closes (a truncated generation) is None."""
    m = _CALL.match(s)
    if not m:
        return None
    args: list[str] = []
    kwargs: dict[str, str] = {}
    pos = m.end()
    if s.startswith(")", pos):
        return m.group(1).lower(), args, kwargs
    while True:
        a = _ARG.match(s, pos)
        if not a:
            return None
        for kind in ("sq", "dq", "grp", "bare"):
            if a.group(kind) is not None:
                value = _unescape(a.group(kind)) if kind in ("sq", "dq") else a.group(kind)
        if a.group("key"):
            kwargs[a.group("key").lower()] = value
        elif kwargs:
            return None  # positional after keyword: not a call anyone meant
        else:
            args.append(value)
        pos = a.end()
        if s.startswith(")", pos):
            return m.group(1).lower(), args, kwargs
        if not s.startswith(",", pos):
            return None
        pos += 1


def _number(v: str) -> float | None:
    try:
        return float(v) if _NUM.fullmatch(v.strip()) else None
    except ValueError:  # e.g. more digits than int/float parsing allows
        return None


def _point(values: list[str]) -> tuple[float, float] | None:
    """Numbers from one box string ('(x,y)', '<|box_start|>(x,y)<|box_end|>', '<point>x y</point>',
    '[x1,y1,x2,y2]') or from two positional args. Two numbers are a point, four a box (its centre)."""
    nums = [float(n) for v in values for n in _NUM.findall(v)[:5]]
    if len(nums) == 2:
        return nums[0], nums[1]
    if len(nums) == 4:
        return (nums[0] + nums[2]) / 2, (nums[1] + nums[3]) / 2
    return None


_KEY_ALIASES = {"control": "ctrl", "arrowup": "up", "arrowdown": "down", "arrowleft": "left",
                "arrowright": "right", "return": "enter", "escape": "esc", "cmd": "win",
                "super": "win", "meta": "win", "pgup": "pageup", "pgdn": "pagedown"}


def _keys(spec: str) -> list[str] | None:
    """'ctrl c' / 'ctrl+c' / 'Ctrl + Shift + T' -> ['ctrl', 'c'] etc. (lower-cased). A '+' that is
    not followed by anything is the key itself ('ctrl++' -> ['ctrl', '+'])."""
    keys = []
    spec = re.sub(r"\s*\+\s*(?=\S)", "+", spec.strip())  # 'Ctrl + C' -> 'Ctrl+C'
    for word in spec.split():
        keys += [p for p in re.split(r"\+(?=.)", word) if p]
    keys = [_KEY_ALIASES.get(k.lower(), k.lower()) for k in keys]
    return keys if 0 < len(keys) <= MAX_KEYS else None


def _make(type_: str, point=None, screen=None, image=None, rel1000=False, **kw) -> Action | None:
    """Build an Action, mapping `point` (model coordinates) to the screen; None if invalid."""
    if point is not None:
        xy = to_screen(point[0], point[1], screen, image, rel1000)
        if xy is None:
            return None
        kw["x"], kw["y"] = xy
    text = kw.get("text")
    if type_ == "type" and (not text or len(text) > MAX_TEXT_CHARS or "\0" in text):
        return None  # the server would refuse it: a format failure now, not a 400 later
    return Action(type_, **kw)


# ScreenExplorer's action names (compared lower-cased, without '_'), -> (our type, scroll direction)
_EXPLORE_NAMES = {"move": ("move", None), "moveto": ("move", None), "click": ("click", None),
                  "leftclick": ("click", None), "rightclick": ("right_click", None),
                  "doubleclick": ("double_click", None), "scrollup": ("scroll", "up"),
                  "scrolldown": ("scroll", "down"), "text": ("type", None), "type": ("type", None),
                  "key": ("key", None), "hotkey": ("key", None)}


def _parse_explore(text, screen, image, rel1000) -> Parsed | None:
    # The first JSON object carrying string "intent" and "action" wins; searching for '{' skips
    # code fences and prose around it. 64 tries bound the work on text full of braces.
    decoder, obj = json.JSONDecoder(), None
    for i, m in enumerate(re.finditer(r"\{", text)):
        if i >= 64:
            break
        try:
            cand, _ = decoder.raw_decode(text, m.start())
        except (ValueError, RecursionError):
            continue
        if isinstance(cand, dict) and isinstance(cand.get("action"), str) and isinstance(cand.get("intent"), str):
            obj = cand
            break
    if obj is None:
        return None
    call = _parse_call(obj["action"])
    if call is None or call[2]:
        return None
    name, args, _ = call
    kind = _EXPLORE_NAMES.get(name.replace("_", ""))
    if kind is None:
        return None
    type_, direction = kind
    geo = dict(screen=screen, image=image, rel1000=rel1000)
    nums = [_number(a) for a in args]
    if type_ == "key":
        keys = _keys(args[0]) if len(args) == 1 else None
        action = _make("key", keys=keys) if keys else None
    elif type_ == "type":
        # Text("t") types at the focus; Text(x, y, "t") clicks (x, y) first (done by the server).
        if len(args) == 1:
            action = _make("type", text=args[0])
        elif len(args) == 3 and None not in nums[:2]:
            action = _make("type", point=nums[:2], text=args[2], **geo)
        else:
            action = None
    elif type_ == "scroll" and not args:
        action = _make("scroll", direction=direction)  # scroll wherever the mouse is
    elif len(args) == 2 and None not in nums:
        action = _make(type_, point=nums, direction=direction, **geo)
    else:
        action = None
    return Parsed(action, obj["intent"].strip()) if action else None


# UI-TARS action names -> our types. `finished` ends the episode (done), `call_user` gives up (fail).
_UITARS_POINT = {"click": "click", "left_single": "click", "left_double": "double_click",
                 "double_click": "double_click", "right_single": "right_click",
                 "right_click": "right_click", "hover": "move", "move": "move", "mouse_move": "move"}
_UITARS_KEY = ("hotkey", "press", "key", "keypress")
_START = ("start_box", "point", "start_point")
_END = ("end_box", "end_point")


def _box(kwargs, args, names) -> tuple[float, float] | None:
    for n in names:
        if n in kwargs:
            return _point([kwargs[n]])
    return _point(args) if args and not kwargs else None


def _parse_uitars(text, screen, image, rel1000) -> Parsed | None:
    m = re.search(r"Action\s*:", text)
    if not m:
        return None
    before = text[:m.start()]
    t = re.search(r"Thought\s*:", before)
    thought = (before[t.end():] if t else before).strip()
    rest = text[m.end():]
    call = _parse_call(rest)
    if call is None:
        # UI-TARS often leaves a quote unescaped inside content: type(content='it's'). Take the
        # content greedily up to the last quote-paren instead of failing the whole step.
        g = re.match(r"\s*(type|finished)\s*\(\s*content\s*=\s*(['\"])(.*)\2\s*\)", rest, re.S)
        if not g:
            return None
        call = (g.group(1), [], {"content": _unescape(g.group(3))})
    name, args, kwargs = call
    geo = dict(screen=screen, image=image, rel1000=rel1000)
    if name in _UITARS_POINT:
        p = _box(kwargs, args, _START)
        action = _make(_UITARS_POINT[name], point=p, **geo) if p else None
    elif name in ("drag", "select"):
        p, q = _box(kwargs, [], _START), _box(kwargs, [], _END)
        q_xy = to_screen(q[0], q[1], screen, image, rel1000) if q else None
        action = _make("drag", point=p, x2=q_xy[0], y2=q_xy[1], **geo) if p and q_xy else None
    elif name in _UITARS_KEY:
        spec = kwargs.get("key", kwargs.get("keys", args[0] if args else ""))
        keys = _keys(spec)
        action = _make("key", keys=keys) if keys else None
    elif name == "type":
        content = kwargs.get("content", args[0] if args else "")
        action = _make("type", text=content)
    elif name == "scroll":
        direction = kwargs.get("direction", "down").strip().lower()
        p = _box(kwargs, [], _START)
        if direction not in DIRECTIONS:
            action = None
        else:
            action = _make("scroll", point=p, direction=direction, **geo) if p else _make("scroll", direction=direction)
    elif name == "wait":
        action = Action("wait")
    elif name == "finished":
        action = Action("done")
    elif name == "call_user":
        action = Action("fail")
    else:
        action = None
    return Parsed(action, thought) if action else None


def parse_action(text: str, style: str, screen: tuple[int, int], image: tuple[int, int] | None = None,
                 rel1000: bool = False) -> Parsed | None:
    """Model text -> Parsed(action in screen pixels, thought), or None for anything unparseable (a
    format failure). Never raises on any text: garbage, truncated, unicode, huge -> None.
    style: "explore" (ScreenExplorer JSON) or "uitars" (UI-TARS-1.5). screen: (w, h) in pixels.
    image: the (w, h) the model saw (smart_resize of the screenshot); None = screen pixels.
    rel1000: the model's coordinates are 0..1000 relative (UI-TARS-1.0 style).
    A wrong `style`, `screen` or `image` is a bug in the caller, not a model failure: that raises ValueError."""
    if style not in ("explore", "uitars"):
        raise ValueError(f"style must be 'explore' or 'uitars', got {style!r}.")
    if not (len(screen) == 2 and screen[0] >= 1 and screen[1] >= 1):
        raise ValueError(f"screen must be (width, height) in pixels, got {screen!r}.")
    if image is not None and not (len(image) == 2 and image[0] >= 1 and image[1] >= 1):
        raise ValueError(f"image must be the (width, height) the model saw, or None; got {image!r}.")
    try:
        if not isinstance(text, str) or len(text) > MAX_INPUT_CHARS:
            return None
        fn = _parse_explore if style == "explore" else _parse_uitars
        return fn(text, screen, image, rel1000)
    except Exception:  # noqa: BLE001 -- the contract: bad model text is a format failure, never a crash
        return None


# ------------------------------------------------------------------------------------------------
# 3. One VM over HTTP, and N of them in lockstep


class VMError(RuntimeError):
    """A VM call failed. `status` is the HTTP status the VM answered with, or None when it could not
    be reached or did not answer in time (then the VM itself is suspect, not the request)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class VMClient:
    """One desktop (vm_server.py) over HTTP. Every call has a timeout (`timeout=` overrides the
    client's for one call). Only calls that are safe to repeat are retried on a connection error:
    screenshot, reset, evaluate; never act or setup (a repeated click or launch is a different
    episode). A read timeout is never retried: a VM that froze would just freeze us twice."""

    def __init__(self, url: str, token: str | None = None, timeout: float = 30):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()  # keep-alive: one TCP connection per VM, not one per call
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, body: Any = None, retries: int = 0,
              timeout: float | None = None) -> requests.Response:
        where, timeout = self.url + path, timeout or self.timeout
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(0.2 * attempt)
            try:
                r = self.session.request(method, where, json=body, timeout=timeout)
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

    def health(self, timeout: float | None = None) -> dict:
        return self._call("GET", "/health", timeout=timeout).json()

    def screenshot(self, format: str = "png", quality: int = 90, timeout: float | None = None) -> Image.Image:
        query = "" if format == "png" else f"?format={format}&quality={quality}"
        for attempt in range(2):
            r = self._call("GET", "/screenshot" + query, retries=2, timeout=timeout)
            try:
                img = Image.open(BytesIO(r.content))
                img.load()  # decode now, so a truncated body fails here and is fetched again
                return img if img.mode == "RGB" else img.convert("RGB")
            except Exception as e:  # noqa: BLE001 -- PIL raises several types for a bad image
                err = VMError(f"{self.url}/screenshot returned an image that does not decode ({e}).")
        raise err

    def act(self, action: Action | dict, timeout: float | None = None) -> dict:
        body = action.to_dict() if isinstance(action, Action) else action
        return self._call("POST", "/action", body, timeout=timeout).json()

    def reset(self, timeout: float | None = None) -> dict:
        return self._call("POST", "/reset", {}, retries=1, timeout=timeout).json()

    def setup(self, steps: list[dict], timeout: float | None = None) -> dict:
        if not steps:  # the server wants 1..64 steps; a task without setup needs no request
            return {"ok": True, "results": []}
        return self._call("POST", "/setup", {"steps": steps}, timeout=timeout).json()

    def evaluate(self, evaluator: dict, timeout: float | None = None) -> dict:
        return self._call("POST", "/evaluate", evaluator, retries=1, timeout=timeout).json()


@dataclass
class VMResult:
    ok: bool
    value: Any = None
    error: str | None = None


_CALLS = ("health", "screenshot", "act", "reset", "setup", "evaluate")


class VMPool:
    """N desktops driven in lockstep. `vms`: an int (launch that many local Xvfb desktops), or URLs
    of running vm_server.py instances (a list or one comma-separated string) -- what `--vms` takes.

    Every call fans out in threads and returns one VMResult per VM, in order, within `timeout`
    seconds, whatever the VMs do: a VM that errors gives ok=False with the error; one that does not
    answer in time is marked down (`alive[i]` False) and skipped (an immediate error) until
    `reset()`, which restarts dead local desktops and re-checks remote ones. The pool is driven from
    one thread (the trainer); the threads inside are its own."""

    def __init__(self, vms: int | str | list[str], token: str | None = None, timeout: float = 30,
                 screen: tuple[int, int] = (1280, 720)):
        if isinstance(vms, str) and vms.strip().isdigit():
            vms = int(vms)
        if isinstance(vms, str):
            vms = [u.strip() for u in vms.split(",") if u.strip()]
        self.timeout, self.screen = timeout, tuple(screen)
        self.local: list[LocalVM] | None = None
        if isinstance(vms, int):
            if vms < 1:
                raise ValueError(f"--vms must be at least 1, got {vms}.")
            token = token or _new_token()  # local desktops always get a token: other users share loopback
            self.local = launch_local_vms(vms, screen=self.screen, token=token)
            vms = [vm.url for vm in self.local]
        if not vms:
            raise ValueError("no VMs given: pass a number of local desktops or a list of URLs.")
        self.token = token
        self.urls = list(vms)
        self.clients = [VMClient(u, token, timeout) for u in self.urls]
        self.alive = [True] * len(self.urls)
        self.why_down: list[str | None] = [None] * len(self.urls)
        # The call still running on each VM. A VM whose last call outlived its deadline gets no new
        # call until that one ends: its thread is stuck in a socket read (requests ends it after
        # `timeout`), and piling more requests on a frozen VM would only pile up threads.
        self._inflight: list[Any] = [None] * len(self.urls)
        self._generation = [0] * len(self.urls)  # bumped on restart: late results of the old VM are ignored
        # 2 workers per VM: after a restart the old VM's stuck thread may still hold one.
        self._executor = ThreadPoolExecutor(max_workers=2 * len(self.urls), thread_name_prefix="vmpool")

    @property
    def size(self) -> int:
        return len(self.urls)

    def _mark_down(self, i: int, gen: int, why: str) -> None:
        if self._generation[i] == gen:
            self.alive[i], self.why_down[i] = False, why

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
                fresh = launch_local_vms(len(bad), screen=self.screen, token=self.token)
            except Exception as e:  # noqa: BLE001 -- reset never raises: the slots stay down
                for i in bad:
                    self._mark_down(i, self._generation[i], f"restart failed: {e}")
                fresh = []
            for i, vm in zip(bad, fresh):
                self._generation[i] += 1
                self.local[i], self.urls[i] = vm, vm.url
                self.clients[i] = VMClient(vm.url, self.token, self.timeout)
                self._inflight[i], self.alive[i], self.why_down[i] = None, True, None
        return self.map("reset", timeout=timeout)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        stop_vms(self.local or [])

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------------
# 4. Local desktops: `vm_server.py --xvfb` subprocesses

_LAUNCHED: list[LocalVM] = []  # stopped at interpreter exit, so no Xvfb outlives the trainer


@dataclass
class LocalVM:
    url: str
    proc: subprocess.Popen
    log: str           # the server's stdout + stderr (deleted when it is stopped)
    token: str | None = None

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


def _new_token() -> str:
    import secrets
    return secrets.token_urlsafe(16)


def _free_ports(n: int) -> list[int]:
    # Hold all n sockets open until we have them, so the n ports are distinct. Another process may
    # still take one before the server binds it; launch_local_vms retries such a VM once.
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _log_tail(path: str, n: int = 600) -> str:
    try:
        return Path(path).read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def launch_local_vms(n: int, screen: tuple[int, int] = (1280, 720), token: str | None = None,
                     timeout: float = 90) -> list[LocalVM]:
    """Start n local desktops (`vm_server.py --xvfb`, each with its own display, HOME and port)
    and wait until all answer /health. They start in parallel: 8 take about as long as one."""
    if shutil.which("Xvfb") is None:
        raise VMError("Xvfb is not installed, so no local desktop can start; run `sudo bash setup.sh`.")
    server = Path(__file__).resolve().with_name("vm_server.py")

    def start(port: int) -> LocalVM:
        log = tempfile.NamedTemporaryFile(prefix=f"vm_server-{port}-", suffix=".log", delete=False)
        cmd = [sys.executable, str(server), "--xvfb", "--host", "127.0.0.1", "--port", str(port),
               "--screen", f"{screen[0]}x{screen[1]}"]
        # The token travels in the environment, not argv, so `ps` does not show it.
        env = dict(os.environ, VM_TOKEN=token or "")
        # start_new_session: the server leads its own process group, so stop() reaches its Xvfb,
        # window manager and apps too, and a Ctrl-C in our terminal does not hit them first.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        log.close()
        vm = LocalVM(f"http://127.0.0.1:{port}", proc, log.name, token)
        _LAUNCHED.append(vm)
        return vm

    vms = [start(p) for p in _free_ports(n)]
    retried: set[int] = set()
    pending = set(range(n))
    deadline = time.monotonic() + timeout
    probe = [VMClient(vm.url, token, timeout=2) for vm in vms]
    try:
        while pending:
            for i in sorted(pending):
                if vms[i].proc.poll() is not None:
                    if i in retried:  # it died twice: not a port race, a real problem
                        raise VMError(f"local desktop {vms[i].url} exited with code {vms[i].proc.returncode}: "
                                      f"{_log_tail(vms[i].log)} (full log: {vms[i].log}).")
                    retried.add(i)  # most likely its port was taken meanwhile: once more on a new port
                    stop_vms([vms[i]], keep_log=True)
                    vms[i] = start(_free_ports(1)[0])
                    probe[i] = VMClient(vms[i].url, token, timeout=2)
                    continue
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
# 5. Task files (ARPO): tasks/*.json, one task object or a list of them per file


class TaskError(ValueError):
    """A malformed task file; the message names the file and the field."""


@dataclass
class Task:
    id: str
    instruction: str
    setup: list[dict]
    evaluator: dict
    max_steps: int = 15
    infeasible: bool = False
    apps: tuple[str, ...] = ()


_NUM_T = (int, float)
# type -> {field: (allowed Python types, required)}; mirrors what vm_server.py's /setup and
# /evaluate accept, so a typo fails when the tasks load, not in the middle of a run.
_STEPS = {
    "launch": {"argv": (list, True)},
    "open": {"path": (str, True)},
    "write_file": {"path": (str, True), "content": (str, True)},
    "sleep": {"seconds": (_NUM_T, True)},
    "command": {"argv": (list, True), "timeout": (_NUM_T, False)},
}
_CHECKS = {
    "file_exists": {"path": (str, True), "exists": (bool, False)},
    "file_contains": {"path": (str, True), "text": (str, False), "regex": (str, False)},
    "window_exists": {"title": (str, True), "exists": (bool, False)},
    "command": {"argv": (list, True), "stdout": (str, False), "regex": (str, False),
                "exit_code": (int, False), "timeout": (_NUM_T, False)},
}
_TASK = {"id": (str, True), "instruction": (str, True), "apps": (list, False), "setup": (list, False),
         "evaluator": (dict, True), "max_steps": (int, False), "infeasible": (bool, False)}


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
        _check_entry(step, _STEPS, f"setup[{j}]", fail)
    _check_fields(ev, {"conj": (str, False), "checks": (list, True)}, "evaluator.", fail)
    if ev.get("conj", "and") not in ("and", "or"):
        fail("evaluator.conj", "must be 'and' or 'or'")
    if not 0 < len(ev["checks"]) <= 64 and not (infeasible and not ev["checks"]):
        fail("evaluator.checks", "must hold 1 to 64 checks (only an infeasible task may have none)")
    for j, check in enumerate(ev["checks"]):
        _check_entry(check, _CHECKS, f"evaluator.checks[{j}]", fail)
    return Task(d["id"], d["instruction"], setup, {"conj": ev.get("conj", "and"), "checks": ev["checks"]},
                d.get("max_steps", 15), infeasible, tuple(d.get("apps", [])))


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
