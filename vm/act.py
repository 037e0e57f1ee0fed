"""vm/act.py: POST /action inside the VM: the body checked against the action schema and this
screen (`check_action`), then done with pyautogui (`do_action`), text of any alphabet included
(`type_text`).

vm_server.py imports this file; copy it into your VM with the server. The schema itself (the
fields of each action type, the key and text limits) is actions.py's, the one the trainer's
parser writes, so a parsed action is one the server takes. Tested by `python -m pytest -q
tests/test_vm_server.py` (every action type on a real desktop) and tests/test_hostile_input.py.

Where this departs from OSWorld's server: it runs pyautogui code the client sends (`exec` of a
string); ours takes a checked JSON action and runs the one pyautogui call that does it.
"""

from __future__ import annotations

import re
import time

from actions import ACTION_FIELDS, DIRECTIONS, MAX_KEYS, MAX_TEXT_CHARS
from vm.procs import DesktopState
from vm.rules import BadRequest, check_number, check_object, check_str


def check_action(desk: DesktopState, body) -> dict:
    """The body of POST /action, checked against actions.ACTION_FIELDS and this screen."""
    import pyautogui
    a = check_object(body, "action", ACTION_FIELDS)
    t = a["type"]
    if ("x" in a) != ("y" in a):
        raise BadRequest("'x' and 'y' must be given together.")
    for kx, ky in (("x", "y"), ("x2", "y2")):
        if kx in a:  # an off-screen point is the client's bug (actions.to_screen clamps model output)
            check_number(a, kx, 0, desk.screen[0] - 1), check_number(a, ky, 0, desk.screen[1] - 1)
    if t == "type":
        check_str(a, "text", MAX_TEXT_CHARS)
    elif t == "key":
        keys = a["keys"]
        if not (isinstance(keys, list) and 0 < len(keys) <= MAX_KEYS and all(isinstance(k, str) for k in keys)):
            raise BadRequest(f"'keys' must be a list of 1 to {MAX_KEYS} key names, e.g. [\"ctrl\", \"s\"].")
        bad = [k for k in keys if k not in pyautogui.KEYBOARD_KEYS]
        if bad:
            raise BadRequest(f"unknown key name(s) {bad}; use pyautogui's names, e.g. 'ctrl', 'enter', 'a'.")
    elif t == "scroll":
        if a["direction"] not in DIRECTIONS:
            raise BadRequest("'direction' must be one of 'up', 'down', 'left', 'right'.")
        a["amount"] = check_number(a, "amount", 1, 50, default=5)  # wheel clicks; GTK scrolls ~3 lines each
    elif t == "wait":
        a["amount"] = check_number(a, "amount", 0, 5, default=1)   # seconds
    return a


def do_action(desk: DesktopState, a: dict) -> None:
    import pyautogui as gui
    t, at = a["type"], ((a["x"], a["y"]) if "x" in a else ())
    if t == "move":
        gui.moveTo(*at)
    elif t in ("click", "double_click", "right_click"):
        gui.click(*at, clicks=2 if t == "double_click" else 1, interval=0.05,
                  button="right" if t == "right_click" else "left")
    elif t == "drag":
        # Press, glide, release: apps only see a drag if the pointer moves while the button is
        # down (jumping straight to the end is a click there).
        gui.moveTo(*at)
        gui.mouseDown()
        gui.moveTo(a["x2"], a["y2"], duration=0.3)
        gui.mouseUp()
    elif t == "scroll":
        if at:
            gui.moveTo(*at)
        n = a["amount"]
        if a["direction"] in ("up", "down"):
            gui.scroll(n if a["direction"] == "up" else -n)   # X11 buttons 4 / 5
        else:
            gui.hscroll(n if a["direction"] == "right" else -n)  # X11 buttons 7 / 6
    elif t == "type":
        if at:  # ScreenExplorer's Text(x, y, "t"): click the field first
            gui.click(*at)
        type_text(a["text"])
    elif t == "key":
        gui.hotkey(*a["keys"])
    elif t == "wait":
        time.sleep(a["amount"])
    # done / fail: the client ends the episode; nothing to execute here


def type_text(text: str) -> None:
    """Type any text. pyautogui types what the US keymap has and silently drops the rest; for
    those characters we map spare keycodes to them (all at once), type, then unmap. (`xdotool type`
    remaps one keycode per character and loses characters when an app reads the keymap late.)"""
    import pyautogui
    from Xlib import X, display
    from Xlib.ext import xtest
    # "<" is printable ASCII but pyautogui types it as shift + the key that carries "<" on this
    # keymap, which gives ">" (an agent's `wc -l < f` would become `wc -l > f`): it takes the
    # remapped-keycode path like non-ASCII text.
    us = lambda c: c in "\n\t" or (" " <= c <= "~" and c != "<")  # noqa: E731
    if all(map(us, text)):
        return pyautogui.write(text)
    d = display.Display()
    lo = d.display.info.min_keycode
    keymap = d.get_keyboard_mapping(lo, d.display.info.max_keycode - lo + 1)
    spare, width = [lo + i for i, syms in enumerate(keymap) if not any(syms)], len(keymap[0])
    pos = 0
    while spare and pos < len(text):
        codes, end = {}, pos  # the longest run whose special characters fit the spare keycodes
        while end < len(text) and (us(text[end]) or text[end] in codes or len(codes) < len(spare)):
            if not us(text[end]):
                codes.setdefault(text[end], spare[len(codes)])
            end += 1
        for c, kc in codes.items():  # Latin-1 keysyms are the code point, others 0x1000000 + it
            d.change_keyboard_mapping(kc, [(ord(c) if ord(c) < 256 else 0x1000000 + ord(c),) * width])
        d.sync()
        time.sleep(0.05)  # apps reload their keymap on the MappingNotify first
        for c in re.findall(r"[\t\n -;=-~]+|.", text[pos:end], re.S):  # US runs (no "<"), single others
            if c in codes:
                xtest.fake_input(d, X.KeyPress, codes[c])
                xtest.fake_input(d, X.KeyRelease, codes[c])
                d.sync()
            else:
                pyautogui.write(c)
        time.sleep(0.2)  # the app translates the last keys before the keycodes change back
        for kc in codes.values():
            d.change_keyboard_mapping(kc, [(0,) * width])
        d.sync()
        pos = end
    d.close()
