r"""actions.py: the one action schema, and model text -> action.

What is here, top to bottom:
  1. `Action`, the one action schema (screen pixels) that vm_server.py executes (the body of
     POST /action), and `Parsed` (an action plus the model's thought, and UI-TARS's reflection).
  2. `smart_resize` + `to_screen` + `parse_action`: model text -> Action, for the two formats the
     models speak:
       - `explore`: ScreenExplorer's JSON, {"intent": "...", "action": "Click(x, y)"}, with the
         actions Move/Click/RightClick/DoubleClick/ScrollUp/ScrollDown/DragTo/Text/Key;
       - `uitars`: UI-TARS-1.5's "Thought: ...\nAction: click(start_box='(x,y)')", with
         click/left_double/right_single/drag/hotkey/type/scroll/wait/finished/call_user.
  3. `cursor_after`: where the pointer is after an action (the start of the next DragTo).

Coordinates. A Qwen-VL model sees the screenshot resized by `smart_resize` (both sides multiples
of `factor`: 28 for Qwen2/2.5-VL, the default, 32 for Qwen3-VL, which the model side passes as
`policy.resize_factor`; the pixel count capped), and answers in the pixels of THAT image.
`to_screen` maps them back: x_screen = x * screen_w / image_w (same for y), rounded half up and
clamped into the screen. `rel1000=True` instead reads 0..1000 relative coordinates (UI-TARS-1.0
style). A box (four numbers) stands for its centre.

Anything unparseable -- garbage, truncated, huge, an unknown action -- is None: a format failure
for the reward, never an exception. vm_server.py checks POST /action against the same table and
limits (ACTION_FIELDS, MAX_TEXT_CHARS, MAX_KEYS, DIRECTIONS), so this file is copied into each VM
too; it imports nothing but the standard library. Tested by `python -m pytest -q
tests/test_parse_action.py` (hand-written real-shaped outputs) and tests/test_fuzz_parse.py
(20,000 mutated ones).

Where we follow the reference parsers (UI-TARS's Python parser and its PyPI package ui-tars,
UI-TARS-desktop's TypeScript parser, ARPO's, ScreenExplorer's):
  - Two "Action:" lines in one answer: the LAST one runs (they all split("Action:")[-1]).
  - "Action：" with the full-width colon (doubao-1.5-ui-tars) counts, as in UI-TARS-desktop; so
    do "Thought：" and the other labels with it (there, only "Action：" does).
  - "Reflection:" / "Action_Summary:" are labels: the thought is the Thought, else the
    Action_Summary, and the reflection goes to `Parsed.reflection`, as their {thought, reflection}.
  - Escapes in quoted arguments mean what they mean in a Python literal (UI-TARS and ARPO read
    the call with ast): \n, \t, \', \" and \\ resolve, any other backslash stays.
  - ScreenExplorer's DragTo(x, y) presses where the pointer is and releases at (x, y). Our drag
    names both ends (vm_server.py moves to the start, presses, glides, releases), so the start is
    `parse_action(..., cursor=)`; without one, the screen centre, where POST /reset leaves it.

Where we deliberately differ:
  - We never evaluate model text (upstream parses it with Python's ast); a few linear regexes
    tokenize it, and its length is capped.
  - An "Action:" inside the quoted argument of a well-formed call, type(content='Action: x'), is
    text, and one in the thought's prose does not end the thought: split("Action:") cuts both.
  - One action per step: of several calls on the last action line (the references split it on
    blank lines and run them all), the first runs, the one the model planned on this screen.
  - Kept where some of the references fail: escaped quotes and newlines in type(content=...),
    an unescaped quote in it (taken up to the last quote-paren), boxes in square brackets,
    <bbox>x1 y1 x2 y2</bbox>, a trailing </Output> or <|im_end|>, horizontal scroll, "CTRL+A"
    hotkeys (split on '+' or spaces, lower-cased).
  - ScreenExplorer's Text(x, y, "t") becomes one `type` action with x, y set; vm_server.py clicks
    at (x, y) before typing, so the model's single action stays a single request.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from typing import Any

# ------------------------------------------------------------------------------------------------
# 1. Actions

# type -> {field: (JSON type, required)}: what each action takes. vm_server.py checks POST /action
# against it, and Action.from_dict reads a stored action back with it.
_POINT = {"x": (int, False), "y": (int, False)}  # optional; given together or not at all
ACTION_FIELDS = {
    "move": {"x": (int, True), "y": (int, True)}, "click": _POINT, "double_click": _POINT,
    "right_click": _POINT, "drag": {"x": (int, True), "y": (int, True), "x2": (int, True), "y2": (int, True)},
    "scroll": {"direction": (str, True), **_POINT, "amount": (int, False)},
    "type": {"text": (str, True), **_POINT}, "key": {"keys": (list, True)},
    "wait": {"amount": (int, False)}, "done": {}, "fail": {},
}
ACTION_TYPES = tuple(ACTION_FIELDS)
DIRECTIONS = ("up", "down", "left", "right")
MAX_TEXT_CHARS = 2000  # longest `type` text; the server refuses longer, and a runaway generation
                       # is a format failure here rather than a 400 from the VM later
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
        if t not in ACTION_FIELDS:
            raise ValueError(f"an action needs 'type' in {list(ACTION_TYPES)}, got {t!r}.")
        d = {k: v for k, v in d.items() if v is not None}
        fields = ACTION_FIELDS[t]
        extra = sorted(set(d) - {"type", *fields})
        if extra:
            raise ValueError(f"a {t!r} action does not take field(s) {extra}.")
        missing = [k for k, (_, required) in fields.items() if required and k not in d]
        if missing or ("x" in d) != ("y" in d):
            raise ValueError(f"a {t!r} action needs field(s) {missing or ['x', 'y']}.")
        for k, (kind, _) in fields.items():  # the text, keys and direction get their own checks below
            if kind is int and k in d and (isinstance(d[k], bool) or not isinstance(d[k], int)):
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
    action: Action        # in screen pixels, already clamped into the screen
    thought: str          # ScreenExplorer's "intent"; UI-TARS's "Thought" (or its "Action_Summary")
    reflection: str = ""  # UI-TARS's "Reflection", when it writes one


# ------------------------------------------------------------------------------------------------
# 2. Model text -> Action

# Qwen2.5-VL's image processor defaults (transformers Qwen2VLImageProcessor: size shortest_edge =
# 56*56, longest_edge = 28*28*1280). A 1280x720 screen stays near full size: 1288x728.
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280
MAX_INPUT_CHARS = 16_000  # longer model outputs are runaway generations: a format failure, fast


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) a Qwen-VL model resizes an image to: both sides multiples of `factor`
    (28 = 14-pixel patches merged 2x2, Qwen2/2.5-VL; 32 = 16-pixel patches, Qwen3-VL: pass
    model.Policy.resize_factor), total pixels within [min_pixels, max_pixels], aspect ratio kept
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
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _unescape(s: str) -> str:
    r"""Resolve the escapes a model writes in a quoted argument (\n \t \r \\ \' \"). Any other
    backslash stays, as in a Python string literal (UI-TARS's and ARPO's parsers read the call
    with Python's ast): a regex typed into a terminal, grep '\d+', keeps its backslash."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), m.group(0)), s, flags=re.S)


def _parse_call(s: str, start: int = 0) -> tuple[str, list[str], dict[str, str], int] | None:
    """`name(a, b, key='v')` at s[start:] -> (lower-cased name, args, kwargs, end), values as
    strings (quotes removed, escapes resolved), `end` the index just past the closing paren. Text
    after it is ignored; a call that never closes (a truncated generation) is None."""
    m = _CALL.match(s, start)
    if not m:
        return None
    args: list[str] = []
    kwargs: dict[str, str] = {}
    pos = m.end()
    if s.startswith(")", pos):
        return m.group(1).lower(), args, kwargs, pos + 1
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
            return m.group(1).lower(), args, kwargs, pos + 1
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
                  "key": ("key", None), "hotkey": ("key", None), "dragto": ("drag", None)}


def _parse_explore(text, screen, image, rel1000, cursor=None) -> Parsed | None:
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
    name, args, _, _ = call
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
    elif type_ == "drag":
        # DragTo(x, y): from where the pointer is (the server presses the button there, moves,
        # releases). Our drag names both ends, so the start is the caller's cursor, else the
        # screen centre, where POST /reset leaves the pointer.
        end = to_screen(nums[0], nums[1], screen, image, rel1000) if len(args) == 2 and None not in nums else None
        cx, cy = cursor if cursor is not None else (screen[0] // 2, screen[1] // 2)
        start = min(max(cx, 0), screen[0] - 1), min(max(cy, 0), screen[1] - 1)
        action = Action("drag", x=start[0], y=start[1], x2=end[0], y2=end[1]) if end else None
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


# "Action：" with the full-width colon (U+FF1A) is how doubao-1.5-ui-tars writes it in Chinese
# answers; UI-TARS-desktop's parser accepts it, and so do we, for the labels (_LABEL) too.
_ACTION_LINE = re.compile(r"(?<![A-Za-z_])Action\s*[:\uff1a]")


def _last_action(text: str) -> tuple[int, int] | None:
    """(where the thought ends, where the action's call starts) in a UI-TARS answer, or None.
    The action is the one after the LAST "Action:", as in every reference parser (a model that
    changes its mind, or runs on into a made-up next turn, means its last line). Unlike their
    split("Action:")[-1], an "Action:" inside the quoted arguments of a well-formed call is text,
    and the thought ends at the first "Action:" that holds a call, not at one in the prose."""
    pos, thought_end, last = 0, None, None
    while (m := _ACTION_LINE.search(text, pos)) is not None:
        last = m
        call = _parse_call(text, m.end())
        if call is not None and thought_end is None:
            thought_end = m.start()
        pos = call[3] if call is not None else m.end()  # both advance: the scan stays linear
    if last is None:
        return None
    return (last.start() if thought_end is None else thought_end), last.end()


_LABEL = re.compile(r"(?<![A-Za-z_])(Reflection|Thought|Action_Summary)\s*[:\uff1a]")


def _thought(head: str) -> tuple[str, str]:
    """The text before the action -> (thought, reflection). UI-TARS labels its parts "Thought:",
    or "Reflection:" + "Action_Summary:" (its reflective format); each part runs to the next label.
    As in the references, the thought is the Thought part, else the Action_Summary, and the labels
    are not part of the text; an unlabelled head is all thought."""
    marks = list(_LABEL.finditer(head))
    if not marks:
        return head.strip(), ""
    parts: dict[str, str] = {}
    for m, nxt in zip(marks, marks[1:] + [None]):
        parts.setdefault(m.group(1), head[m.end():nxt.start() if nxt else len(head)].strip())
    return parts.get("Thought", parts.get("Action_Summary", "")), parts.get("Reflection", "")


def _parse_uitars(text, screen, image, rel1000) -> Parsed | None:
    found = _last_action(text)
    if found is None:
        return None
    thought, reflection = _thought(text[:found[0]])
    rest = text[found[1]:]
    call = _parse_call(rest)
    if call is None:
        # UI-TARS often leaves a quote unescaped inside content: type(content='it's'). Take the
        # content greedily up to the last quote-paren instead of failing the whole step.
        g = re.match(r"\s*(type|finished)\s*\(\s*content\s*=\s*(['\"])(.*)\2\s*\)", rest, re.S)
        if not g:
            return None
        call = (g.group(1), [], {"content": _unescape(g.group(3))}, g.end())
    name, args, kwargs, _ = call
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
        action = Action("wait", amount=5)  # UI-TARS's wait(): "sleep for 5s" (the prompt says so too)
    elif name == "finished":
        action = Action("done")
    elif name == "call_user":
        action = Action("fail")
    else:
        action = None
    return Parsed(action, thought, reflection) if action else None


def parse_action(text: str, style: str, screen: tuple[int, int], image: tuple[int, int] | None = None,
                 rel1000: bool = False, cursor: tuple[int, int] | None = None) -> Parsed | None:
    """Model text -> Parsed(action in screen pixels, thought, reflection), or None for anything
    unparseable (a format failure). Never raises on any text: garbage, truncated, unicode, huge -> None.
    style: "explore" (ScreenExplorer JSON) or "uitars" (UI-TARS-1.5). screen: (w, h) in pixels.
    image: the (w, h) the model saw (smart_resize of the screenshot); None = screen pixels.
    rel1000: the model's coordinates are 0..1000 relative (UI-TARS-1.0 style).
    cursor: where the pointer is, in screen pixels (`cursor_after` tracks it): the start of
    ScreenExplorer's DragTo(x, y); None = the screen centre, where POST /reset leaves it.
    A wrong `style`, `screen`, `image` or `cursor` is a bug in the caller, not a model failure:
    that raises ValueError."""
    if style not in ("explore", "uitars"):
        raise ValueError(f"style must be 'explore' or 'uitars', got {style!r}.")
    if not (len(screen) == 2 and screen[0] >= 1 and screen[1] >= 1):
        raise ValueError(f"screen must be (width, height) in pixels, got {screen!r}.")
    if image is not None and not (len(image) == 2 and image[0] >= 1 and image[1] >= 1):
        raise ValueError(f"image must be the (width, height) the model saw, or None; got {image!r}.")
    if cursor is not None and not (len(cursor) == 2 and all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in cursor)):
        raise ValueError(f"cursor must be the pointer's (x, y) in screen pixels, or None; got {cursor!r}.")
    try:
        if not isinstance(text, str) or len(text) > MAX_INPUT_CHARS:
            return None
        if style == "explore":
            return _parse_explore(text, screen, image, rel1000, cursor)
        return _parse_uitars(text, screen, image, rel1000)
    except Exception:  # noqa: BLE001 -- the contract: bad model text is a format failure, never a crash
        return None


def cursor_after(action: Action | None, cursor: tuple[int, int]) -> tuple[int, int]:
    """Where the pointer is after `action` ran, if it was at `cursor` (screen pixels): the end of a
    drag, else the action's (x, y) when it has one (the server moves there first), else unchanged
    (keys, typing at the focus, wait, done/fail, and None: a format failure sends nothing). Start
    from the screen centre after POST /reset; the next DragTo starts here."""
    if action is None:
        return cursor
    if action.type == "drag":
        return action.x2, action.y2
    return (action.x, action.y) if action.x is not None else cursor
