"""Model-output fuzzing: 10,000 random and mutated outputs per format through actions.parse_action.

Run: python -m pytest -q tests/test_fuzz_parse.py        (pure Python, no desktop, ~10 s)

parse_action wraps its parsers in a catch-all (`except Exception: return None`), so "it never
raises" is true by construction and proves little. These tests therefore also call the two inner
parsers (`_parse_explore`, `_parse_uitars`) WITHOUT the catch-all: an exception there is a parser
bug the catch-all would have hidden (a step silently scored as a format failure). And every action
that does come out must be one the VM accepts: inside the screen, valid per `Action.from_dict`,
text within the server's limits, and it survives a JSON round trip (what the trainer sends).

Inputs (seeded, so a failure replays): realistic model outputs of both formats (all the action
kinds, with thoughts, fences, unicode; UI-TARS's reflective format, full-width colons and a
taken-back earlier action line), then 1-4 mutations each: hostile numbers (NaN, inf, 1e309,
-0, huge, negative, full-width digits), character edits, truncation, duplication, quote/brace/
backslash injection, case flips, token swaps between formats; plus 10 % pure noise. Screens,
image sizes, rel1000 and explore's pointer (the start of DragTo) vary per call. Tested here:
10,000 per format (tests/test_parse_action.py has its own 5,000 mixed; these are independent).
"""
from __future__ import annotations

import json
import math
import random
import time

import actions as A
from actions import Action, parse_action

N_PER_FORMAT = 10_000
SCREENS = [(1280, 720), (1920, 1080), (640, 480), (3840, 2160), (1, 1), (7, 3000)]
IMAGES = [None, (1288, 728), (28, 28), (4000, 3000), (1, 1), (56, 1120)]

HOSTILE_NUMBERS = ["NaN", "nan", "inf", "-inf", "Infinity", "1e309", "-1e309", "1e-400", "-0", "0.0", "-1",
                   "-99999", "99999999999999999999999", "9" * 400, "1.5.5", "１２３", "٣٤", "0x10", "1_000",
                   "+5", "--5", "5.", ".5", "1e2", "", " ", "None", "null", "true", "[]", "()", "'", '"']
NOISE = list("(){}[]<>'\"\\,:;=+-_.!?@#$%^&*~`|/ \t\n") + ["\0", "\x1b", "\u200b", "\ud800", "é", "你", "🌍",
                                                            "<|box_start|>", "<|box_end|>", "<point>", "</point>",
                                                            "Action:", "Thought:", "start_box=", "content="]

EXPLORE_ACTIONS = ["Click({x}, {y})", "DoubleClick({x}, {y})", "RightClick({x}, {y})", "Move({x}, {y})",
                   "ScrollUp({x}, {y})", "ScrollDown({x}, {y})", "ScrollDown()", "Text({x}, {y}, \"{t}\")",
                   "Text(\"{t}\")", "Key(\"{k}\")", "MoveTo({x}, {y})", "LeftClick({x}, {y})", "DragTo({x}, {y})"]
UITARS_ACTIONS = ["click(start_box='<|box_start|>({x},{y})<|box_end|>')", "click(start_box='({x},{y})')",
                  "click(point='<point>{x} {y}</point>')", "left_double(start_box='({x},{y})')",
                  "right_single(start_box='({x},{y})')", "hover(start_box='({x},{y})')",
                  "drag(start_box='({x},{y})', end_box='({y},{x})')",
                  "drag(start_point='<point>{x} {y}</point>', end_point='<point>{y} {x}</point>')",
                  "hotkey(key='{k}')", "press(key='{k}')", "type(content='{t}')", "type(content=\"{t}\")",
                  "scroll(start_box='({x},{y})', direction='{d}')", "scroll(direction='{d}')", "wait()",
                  "finished(content='{t}')", "call_user()", "click(start_box='({x},{y},{y},{x})')"]
THOUGHTS = ["I need to open the terminal.", "The menu is closed; click it.", "我要点击“确定”按钮。",
            "Let me type the name.", "", "Hmm (not sure) -- try this: {x}, {y}", "It's 'quoted' \"twice\"."]
TEXTS = ["hello world", "it\\'s fine", "line1\\nline2\\n", "naïve café ☕ 你好", "ls -la ~", "a" * 50,
         "x, y) (z", "{\"json\": 1}"]
KEYS = ["ctrl c", "ctrl+s", "Ctrl + Shift + T", "enter", "alt f4", "ctrl++", "super", "a b c d e f g h"]


def realistic(rng: random.Random, style: str, image) -> str:
    """One plausible model answer, coordinates inside (or near) the image the model saw."""
    w, h = image or (1280, 720)
    fill = dict(x=rng.randint(-5, w + 5), y=rng.randint(-5, h + 5), t=rng.choice(TEXTS), k=rng.choice(KEYS),
                d=rng.choice(["up", "down", "left", "right", "Down"]))
    if style == "explore":
        act = rng.choice(EXPLORE_ACTIONS).format(**fill)
        body = json.dumps({"intent": rng.choice(THOUGHTS).format(**fill), "action": act}, ensure_ascii=rng.random() < 0.5)
        return rng.choice(["{}", "```json\n{}\n```", "Sure! Here it is:\n{}\nDone.", "{}<|im_end|>"]).format(body)
    act = rng.choice(UITARS_ACTIONS).format(**fill)
    # UI-TARS's plain and reflective formats, the full-width colon, and sometimes an earlier
    # action line the model took back (the last one runs).
    head = rng.choice(["Thought: {0}", "Thought：{0}", "Reflection: {0}\nAction_Summary: {1}", "Action_Summary: {1}"])
    head = head.format(rng.choice(THOUGHTS).format(**fill), rng.choice(THOUGHTS).format(**fill))
    if rng.random() < 0.1:
        head += "\nAction: " + rng.choice(UITARS_ACTIONS).format(**fill) + "\n"
    return f"{head}\nAction{rng.choice([':', ':', '：'])} {act}" + rng.choice(["", "<|im_end|>", "\n\nok"])


def mutate(rng: random.Random, text: str) -> str:
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        i = rng.randint(0, len(text))
        if op == 0:    # a number becomes something hostile
            nums = [m for m in __import__("re").finditer(r"-?\d+", text)]
            if nums:
                m = rng.choice(nums)
                text = text[:m.start()] + rng.choice(HOSTILE_NUMBERS) + text[m.end():]
        elif op == 1:  # insert noise
            text = text[:i] + "".join(rng.choice(NOISE) for _ in range(rng.randint(1, 5))) + text[i:]
        elif op == 2:  # delete a span
            text = text[:i] + text[i + rng.randint(1, 10):]
        elif op == 3:  # truncate (a generation cut at max_new_tokens)
            text = text[:i]
        elif op == 4:  # duplicate a span
            j = rng.randint(i, len(text))
            text = text[:j] + text[i:j] + text[j:]
        elif op == 5:  # case flip
            text = text.swapcase() if rng.random() < 0.3 else text[:i] + text[i:i + 8].upper() + text[i + 8:]
        elif op == 6:  # the other format's action inside this one
            text = text[:i] + rng.choice(EXPLORE_ACTIONS + UITARS_ACTIONS) + text[i:]
        elif op == 7:  # replace a character
            if text:
                text = text[:i] + rng.choice(NOISE) + text[i + 1:]
        else:          # a long runaway tail
            text = text + rng.choice(NOISE) * rng.randint(10, 3000)
    return text


def check_action(a: Action, screen) -> None:
    """Everything the VM checks (bar key names, which only the VM's keyboard knows)."""
    d = a.to_dict()
    assert Action.from_dict(json.loads(json.dumps(d))) == a, d
    for kx, ky in (("x", "y"), ("x2", "y2")):
        if kx in d:
            assert isinstance(d[kx], int) and isinstance(d[ky], int), d
            assert 0 <= d[kx] < screen[0] and 0 <= d[ky] < screen[1], (d, screen)
    if a.type == "type":
        assert 0 < len(a.text) <= A.MAX_TEXT_CHARS and "\0" not in a.text
    if a.type == "key":
        assert 0 < len(a.keys) <= A.MAX_KEYS and all(k and k == k.lower() for k in a.keys), a.keys
    if a.type == "scroll":
        assert a.direction in A.DIRECTIONS


def fuzz(style: str, seed: int) -> dict:
    rng = random.Random(seed)
    inner = A._parse_explore if style == "explore" else A._parse_uitars
    stats = {"n": 0, "parsed": 0, "inner_raised": [], "types": set(), "slowest_ms": 0.0}
    for _ in range(N_PER_FORMAT):
        screen, image, rel = rng.choice(SCREENS), rng.choice(IMAGES), rng.random() < 0.15
        # explore's DragTo starts at the pointer: any cursor, even a stale one off this screen
        cursor = rng.choice([None, (0, 0), (rng.randint(-50, 4000), rng.randint(-50, 4000))])
        extra = (cursor,) if style == "explore" else ()
        text = "".join(rng.choice(NOISE) for _ in range(rng.randint(0, 300))) if rng.random() < 0.1 \
            else mutate(rng, realistic(rng, style, image))
        t0 = time.process_time()  # CPU time of this process: other jobs on the machine do not count
        p = parse_action(text, style, screen, image, rel, *extra)
        stats["slowest_ms"] = max(stats["slowest_ms"], 1000 * (time.process_time() - t0))
        if len(text) <= A.MAX_INPUT_CHARS:
            try:  # the parser itself, without parse_action's catch-all
                q = inner(text, screen, image, rel, *extra)
                assert q == p, (text, p, q)
            except AssertionError:
                raise
            except Exception as e:  # noqa: BLE001 -- exactly what we are counting
                stats["inner_raised"].append((type(e).__name__, str(e)[:80], text[:200]))
        stats["n"] += 1
        if p is not None:
            stats["parsed"] += 1
            stats["types"].add(p.action.type)
            assert isinstance(p.thought, str) and isinstance(p.reflection, str)
            check_action(p.action, screen)
    return stats


def _run(style: str, seed: int, all_types: set) -> None:
    t0 = time.process_time()
    s = fuzz(style, seed)
    dt = time.process_time() - t0
    print(f"{style}: {s['n']} outputs, {s['parsed']} parsed, {len(s['inner_raised'])} inner exceptions, "
          f"slowest {s['slowest_ms']:.1f} ms, {dt:.1f} s of CPU")
    assert s["n"] == N_PER_FORMAT
    assert not s["inner_raised"], s["inner_raised"][:5]
    # Many mutations leave a valid answer, and every action kind came out: both parsers were exercised.
    assert s["parsed"] > 0.2 * N_PER_FORMAT and s["parsed"] < 0.95 * N_PER_FORMAT, s["parsed"]
    assert all_types <= s["types"], all_types - s["types"]
    assert s["slowest_ms"] < 200 and dt < 15


def test_fuzz_explore():
    _run("explore", 20240601, {"click", "double_click", "right_click", "move", "scroll", "type", "key", "drag"})


def test_fuzz_uitars():
    _run("uitars", 20240602, {"click", "double_click", "right_click", "move", "drag", "scroll", "type", "key",
                              "wait", "done", "fail"})


def test_hostile_numbers_never_leave_the_screen():
    # Every hostile number in every coordinate slot of every action kind, on a 7x3000 screen whose
    # narrow width makes an off-by-one clamp visible.
    screen = (7, 3000)
    for style, templates in (("explore", EXPLORE_ACTIONS), ("uitars", UITARS_ACTIONS)):
        for tpl in templates:
            for xs in HOSTILE_NUMBERS:
                for image in (None, (28, 28)):
                    act = tpl.format(x=xs, y="5", t="t", k="enter", d="up")
                    text = json.dumps({"intent": "i", "action": act}) if style == "explore" else f"Action: {act}"
                    p = parse_action(text, style, screen, image)
                    if p is not None:
                        check_action(p.action, screen)
                        if "x" in p.action.to_dict():
                            assert not math.isnan(p.action.x)
