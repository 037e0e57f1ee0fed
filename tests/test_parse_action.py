"""Tests for actions.parse_action / actions.smart_resize / actions.Action: model text -> screen actions.

Run: python -m pytest -q tests/test_parse_action.py   (pure Python, no desktop, a few seconds)

The tables below are realistic model outputs for both formats, each with the exact Action it must
become (or None = a format failure). Unless a case says otherwise the screen is 1280x720 and the
model's coordinates are already screen pixels (image=None).
"""

import os
import random
import time

import pytest

from actions import Action, Parsed, cursor_after, parse_action, smart_resize, to_screen

S = (1280, 720)


def A(type_, **kw):
    return Action(type_, **kw)


# ------------------------------------------------------------------------------------------------
# ScreenExplorer JSON: {"intent": ..., "action": "Click(x, y)"}

EXPLORE = [
    # well formed, every action name
    ('{"intent": "Open the file manager", "action": "DoubleClick(64, 120)"}', A("double_click", x=64, y=120)),
    ('{"intent": "Click the menu", "action": "Click(300, 400)"}', A("click", x=300, y=400)),
    ('{"intent": "See the context menu", "action": "RightClick(10, 20)"}', A("right_click", x=10, y=20)),
    ('{"intent": "hover the clock", "action": "Move(5, 6)"}', A("move", x=5, y=6)),
    ('{"intent": "scroll the list", "action": "ScrollUp(640, 360)"}', A("scroll", x=640, y=360, direction="up")),
    ('{"intent": "scroll down here", "action": "ScrollDown()"}', A("scroll", direction="down")),
    ('{"intent": "type a note", "action": "Text(100, 200, \\"hello world\\")"}', A("type", x=100, y=200, text="hello world")),
    ('{"intent": "type at focus", "action": "Text(\\"only text\\")"}', A("type", text="only text")),
    ('{"intent": "copy", "action": "Key(\\"ctrl+c\\")"}', A("key", keys=["ctrl", "c"])),
    ('{"intent": "confirm", "action": "Key(\\"Enter\\")"}', A("key", keys=["enter"])),
    ('{"intent": "reopen tab", "action": "Key(\\"Ctrl + Shift + T\\")"}', A("key", keys=["ctrl", "shift", "t"])),
    ('{"intent": "zoom in", "action": "Key(\\"ctrl++\\")"}', A("key", keys=["ctrl", "+"])),
    # code fences and prose around the JSON
    ('```json\n{"intent": "open terminal", "action": "DoubleClick(40, 50)"}\n```', A("double_click", x=40, y=50)),
    ('Sure! Here is my answer:\n{"intent": "menu", "action": "RightClick(10, 20)"}\nHope this helps.', A("right_click", x=10, y=20)),
    ('I see a desktop.\n```\n{\n  "intent": "open editor",\n  "action": "DoubleClick(64, 220)"\n}\n```', A("double_click", x=64, y=220)),
    # escaped quotes, newlines, commas and parens inside the text, unicode
    ('{"intent": "quote", "action": "Text(100, 200, \\"say \\\\\\"hi\\\\\\"\\")"}', A("type", x=100, y=200, text='say "hi"')),
    ('{"intent": "two lines", "action": "Text(1, 2, \\"line1\\\\nline2\\")"}', A("type", x=1, y=2, text="line1\nline2")),
    ('{"intent": "tricky", "action": "Text(1, 2, \\"a, b) c\\")"}', A("type", x=1, y=2, text="a, b) c")),
    ('{"intent": "输入中文", "action": "Text(50, 60, \\"你好，世界 🌍\\")"}', A("type", x=50, y=60, text="你好，世界 🌍")),
    ('{"intent": "click {the} icon", "action": "Click(3, 4)"}', A("click", x=3, y=4)),
    # lenient spellings we accept on purpose
    ('{"intent": "x", "action": "click( 7 ,8 )"}', A("click", x=7, y=8)),
    ('{"intent": "x", "action": "double_click(1, 2)"}', A("double_click", x=1, y=2)),
    ('{"action": "Click(1,2)", "intent": "reversed keys", "confidence": 0.9}', A("click", x=1, y=2)),
    ('{"intent": "no action here"} then {"intent": "real", "action": "Click(9, 9)"}', A("click", x=9, y=9)),
    ('{"intent": "x", "action": "Click(100.6, 200.4)"}', A("click", x=101, y=200)),
    ('{"intent": "off screen", "action": "Click(5000, -20)"}', A("click", x=1279, y=0)),
    ('{"intent": "x", "action": "Click(3, 4) now"}', A("click", x=3, y=4)),
    # format failures
    ('{"intent": "open", "action": "Click(100, 2', None),  # truncated generation
    ('{"intent": "x", "action": "Click(100, "}', None),
    ('{"intent": "x", "action": "Text(1, 2, \\"never closed)"}', None),
    ("asdkjh qwe {{ ]]", None),
    ("", None),
    ('{"action": "Click(1,2)"}', None),                       # no intent
    ('{"intent": "x", "action": "Swipe(1, 2)"}', None),       # not an action
    ('{"intent": "x", "action": "Click(1)"}', None),          # wrong arity
    ('{"intent": "x", "action": "Click(x, y)"}', None),       # placeholders, not numbers
    ('{"intent": "x", "action": {"type": "click"}}', None),   # action not a string
    ("Click(100, 200)", None),                                # no JSON at all
    ('{"intent": "x", "action": "Key()"}', None),
    ('{"intent": "x", "action": "Key(\\"\\")"}', None),
    ('{"intent": "x", "action": "Text(1, 2, \\"\\")"}', None),  # nothing to type
    ("{'intent': 'x', 'action': 'Click(1, 2)'}", None),       # Python dict, not JSON
    ('{"intent": "x", "action": "Click(NaN, 2)"}', None),
    ('{"intent": "x", "action": "Text(1, 2, \\"' + "a" * 3000 + '\\")"}', None),  # runaway text
]

# ------------------------------------------------------------------------------------------------
# UI-TARS-1.5: "Thought: ...\nAction: click(start_box='(x,y)')"

UITARS = [
    ("Thought: I need to open the terminal.\nAction: left_double(start_box='<|box_start|>(64,120)<|box_end|>')", A("double_click", x=64, y=120)),
    ("Thought: Click OK.\nAction: click(start_box='(300,400)')", A("click", x=300, y=400)),
    ("Thought: Click OK.\nAction: click(point='<point>300 400</point>')", A("click", x=300, y=400)),
    ("Thought: menu\nAction: right_single(start_box='<|box_start|>(10,20)<|box_end|>')", A("right_click", x=10, y=20)),
    ("Thought: move the file\nAction: drag(start_box='(10,20)', end_box='(300,400)')", A("drag", x=10, y=20, x2=300, y2=400)),
    ("Thought: select\nAction: drag(start_point='<point>10 20</point>', end_point='<point>30 40</point>')", A("drag", x=10, y=20, x2=30, y2=40)),
    ("Thought: save\nAction: hotkey(key='ctrl s')", A("key", keys=["ctrl", "s"])),
    ("Thought: new tab\nAction: hotkey(key='Ctrl+Shift+T')", A("key", keys=["ctrl", "shift", "t"])),
    ("Thought: confirm\nAction: press(key='enter')", A("key", keys=["enter"])),
    ("Thought: type\nAction: type(content='hello world')", A("type", text="hello world")),
    ("Thought: type\nAction: type(content='it\\'s fine')", A("type", text="it's fine")),
    ("Thought: submit\nAction: type(content='line1\\nline2\\n')", A("type", text="line1\nline2\n")),
    ('Thought: quote\nAction: type(content="double \\"quoted\\"")', A("type", text='double "quoted"')),
    ("Thought: sloppy\nAction: type(content='it's unescaped')", A("type", text="it's unescaped")),
    ("Thought: 写中文\nAction: type(content='naïve café ☕ 你好')", A("type", text="naïve café ☕ 你好")),
    ("Thought: down\nAction: scroll(start_box='(640,360)', direction='down')", A("scroll", x=640, y=360, direction="down")),
    ("Thought: up\nAction: scroll(direction='up')", A("scroll", direction="up")),
    ("Thought: up\nAction: scroll(point='<point>5 6</point>', direction='UP')", A("scroll", x=5, y=6, direction="up")),
    ("Thought: loading\nAction: wait()", A("wait", amount=5)),  # UI-TARS: sleep 5 s (the server's cap)
    ("Thought: The file is saved.\nAction: finished(content='Task done.')", A("done")),
    ("Thought: all done\nAction: finished()", A("done")),
    ("Thought: I cannot do this.\nAction: call_user()", A("fail")),
    ("Thought: box\nAction: click(start_box='(100,200,300,400)')", A("click", x=200, y=300)),
    ("Thought: box\nAction: click(start_box='[100, 200]')", A("click", x=100, y=200)),
    ("Thought: 我要点击“确定”按钮。\nAction: click(start_box='(500,300)')", A("click", x=500, y=300)),
    ("Reflection: the last click missed.\nThought: try again\nAction: click(start_box='(1,2)')<|im_end|>", A("click", x=1, y=2)),
    ("Action: click(start_box='(1,2)')", A("click", x=1, y=2)),
    ("Thought: x\nAction: click(start_box='(1,2)')\n\nI hope this works (really).", A("click", x=1, y=2)),
    ("Thought: far\nAction: click(start_box='(2000,900)')", A("click", x=1279, y=719)),
    ("Thought: hover\nAction: hover(start_box='(5,5)')", A("move", x=5, y=5)),
    ("Thought: x\nAction:   click( start_box = \"(7, 8)\" )", A("click", x=7, y=8)),
    # format failures
    ("Thought: I will click the button\nAction: click(start_box='(1,", None),  # truncated
    ("Thought: I will click", None),                                           # no Action
    ("qwe rty (((( ''' \\\\", None),
    ("", None),
    ("Thought: x\nAction: open_app(name='firefox')", None),
    ("Thought: x\nAction: click()", None),
    ("Thought: x\nAction: click(start_box='(1,2,3)')", None),
    ("Thought: x\nAction: hotkey(key='')", None),
    ("Thought: x\nAction: type(content='')", None),
    ("Thought: x\nAction: scroll(start_box='(1,2)', direction='sideways')", None),
    ("Thought: x\nAction: drag(start_box='(1,2)')", None),
    ("Thought: x\nAction: click(start_box='(nan,2)')", None),
    ("Thought: x\nAction: click(start_box='(1,2)'", None),  # never closed
]


@pytest.mark.parametrize("text,expected", EXPLORE)
def test_explore_table(text, expected):
    got = parse_action(text, "explore", S)
    assert (got.action if got else None) == expected


@pytest.mark.parametrize("text,expected", UITARS)
def test_uitars_table(text, expected):
    got = parse_action(text, "uitars", S)
    assert (got.action if got else None) == expected


def test_tables_are_big_enough():
    # At least 30 realistic outputs per format: every action kind, in several spellings.
    assert len(EXPLORE) >= 30 and len(UITARS) >= 30


def test_thought_and_intent_are_returned():
    p = parse_action('```json\n{"intent": "  Open the editor ", "action": "Click(1, 2)"}\n```', "explore", S)
    assert p == Parsed(A("click", x=1, y=2), "Open the editor")
    p = parse_action("Thought: The editor is open.\nNow type.\nAction: type(content='x')", "uitars", S)
    assert p.thought == "The editor is open.\nNow type."


# ------------------------------------------------------------------------------------------------
# Where we follow the reference parsers: UI-TARS's Python parser (also its PyPI package ui-tars),
# UI-TARS-desktop's TypeScript parser and ARPO's. The outputs are shaped like real ones from
# issues, logs and the references' own tests.


def test_explore_drag_to_starts_where_the_mouse_is():
    # ScreenExplorer's release parses DragTo(x, y) (its prompt does not list it) and runs it as:
    # button down where the pointer is, move to (x, y), button up. Our drag names both ends, so the
    # start is the pointer, passed as `cursor` in screen pixels.
    text = '{"intent": "Drag notes.txt onto the Documents folder", "action": "DragTo(400, 300)"}'
    assert parse_action(text, "explore", S, cursor=(74, 346)).action == A("drag", x=74, y=346, x2=400, y2=300)
    # Without a cursor, the screen centre: (1280 // 2, 720 // 2), where POST /reset leaves the pointer.
    assert parse_action(text, "explore", S).action == A("drag", x=640, y=360, x2=400, y2=300)
    # The end is in the model's image like every coordinate: 400 * 1280 / 1288 = 397.5 -> 398,
    # 300 * 720 / 728 = 296.7 -> 297. The cursor is in screen pixels already, clamped into the screen.
    p = parse_action(text, "explore", S, image=(1288, 728), cursor=(5000, -3))
    assert p == Parsed(A("drag", x=1279, y=0, x2=398, y2=297), "Drag notes.txt onto the Documents folder")
    assert parse_action('{"intent": "x", "action": "DragTo(400)"}', "explore", S) is None
    with pytest.raises(ValueError):
        parse_action(text, "explore", S, cursor=(1, 2, 3))  # a caller bug, not a model failure


def test_cursor_after_follows_the_pointer():
    # Where the pointer is after each action, from the centre after a reset: what a trainer passes
    # as the next step's cursor.
    c = (640, 360)
    steps = [(A("click", x=100, y=200), (100, 200)), (A("key", keys=["ctrl", "c"]), (100, 200)),
             (None, (100, 200)),  # a format failure: nothing ran
             (A("click"), (100, 200)), (A("type", text="hi"), (100, 200)),
             (A("drag", x=100, y=200, x2=400, y2=300), (400, 300)), (A("scroll", direction="up"), (400, 300)),
             (A("scroll", x=5, y=6, direction="down"), (5, 6)), (A("type", x=7, y=8, text="a"), (7, 8)),
             (A("move", x=9, y=10), (9, 10)), (A("wait", amount=1), (9, 10)), (A("done"), (9, 10))]
    for action, expected in steps:
        c = cursor_after(action, c)
        assert c == expected, action


def test_two_action_lines_the_last_one_runs():
    # A model that changes its mind in one answer: every reference runs what follows the LAST
    # "Action:" (UI-TARS-desktop tests this shape as "it should return last action"). The thought
    # is what precedes the first one, as in the references.
    text = ("Thought: 地址栏已经被激活，可以直接输入网址。\nAction: click(start_box='(100,100)')\n\n"
            "Action: type(content='doubao.com\\n')")
    assert parse_action(text, "uitars", S) == Parsed(A("type", text="doubao.com\n"), "地址栏已经被激活，可以直接输入网址。")
    # A hallucinated next turn after the answer: its action is the last one.
    text = ("Thought: Open the text editor from the desktop.\nAction: left_double(start_box='(74,146)')\n\n"
            "Thought: The editor is open, type the note.\nAction: type(content='buy milk')")
    assert parse_action(text, "uitars", S) == Parsed(A("type", text="buy milk"), "Open the text editor from the desktop.")
    # "Action:" in the thought is prose, not an action line: the real one after it runs.
    text = "Thought: My last Action: click missed the OK button, it is lower.\nAction: click(start_box='(640,420)')"
    assert parse_action(text, "uitars", S) == Parsed(A("click", x=640, y=420), "My last Action: click missed the OK button, it is lower.")
    # The last "Action:" decides even when it is broken (the references fail it too).
    assert parse_action("Thought: x\nAction: click(start_box='(1,2)')\n\nAction: type(content='abc", "uitars", S) is None


def test_full_width_colons():
    # doubao-1.5-ui-tars answers in Chinese with "Action：" (U+FF1A); UI-TARS-desktop accepts it.
    text = "Thought: 我需要点击“确定”按钮来保存文件。\nAction：click(start_box='(100,200)')"
    assert parse_action(text, "uitars", S) == Parsed(A("click", x=100, y=200), "我需要点击“确定”按钮来保存文件。")
    text = "Thought：我需要点击“确定”按钮来保存文件。\nAction：click(start_box='<bbox>191 21 191 21</bbox>')"
    assert parse_action(text, "uitars", S) == Parsed(A("click", x=191, y=21), "我需要点击“确定”按钮来保存文件。")
    assert parse_action("\n\nAction：hotkey(key='ctrl s')", "uitars", S) == Parsed(A("key", keys=["ctrl", "s"]), "")


def test_reflection_and_action_summary_are_labels_not_thought():
    # UI-TARS's reflective format (the references' tests and README): the thought is the
    # Action_Summary, the Reflection is kept apart, and neither label stays in the text.
    text = ("Reflection: 在桌面上我看到了Chrome浏览器的图标，应该双击该图标来启动浏览器。\n"
            "Action_Summary: 在桌面上找到Chrome浏览器图标的位置，通过双击操作来打开浏览器。\n"
            "Action: left_double(start_box='21, 246, 21, 246')")
    p = parse_action(text, "uitars", S)
    assert p == Parsed(A("double_click", x=21, y=246), "在桌面上找到Chrome浏览器图标的位置，通过双击操作来打开浏览器。",
                       "在桌面上我看到了Chrome浏览器的图标，应该双击该图标来启动浏览器。")
    p = parse_action("Action_Summary: 粘贴使用 ctrl+v。\nAction: hotkey(key='ctrl v')", "uitars", S)
    assert p == Parsed(A("key", keys=["ctrl", "v"]), "粘贴使用 ctrl+v。")
    # A reflection, then a thought: each under its own label.
    p = parse_action("Reflection: The last click missed the menu.\nThought: Click File instead.\n"
                     "Action: click(start_box='(12,30)')", "uitars", S)
    assert (p.thought, p.reflection) == ("Click File instead.", "The last click missed the menu.")
    # UI-TARS-desktop's o1 format (a <Thought> tag, a summary, a closing </Output>).
    p = parse_action("<Thought>The dialog asks to save.</Thought>\nAction_Summary: Click Save.\n"
                     "Action: click(start_box='(900,650)')\n</Output>", "uitars", S)
    assert p == Parsed(A("click", x=900, y=650), "Click Save.")


def test_unknown_escapes_keep_their_backslash():
    # UI-TARS's and ARPO's parsers read type(content='...') as a Python string literal: \n, \t,
    # \', \" and \\ are escapes, and an unknown escape keeps its backslash. Regexes typed into a terminal need
    # that: '\d{3}' must reach the VM as backslash-d, not 'd'.
    text = "Thought: Count lines with a 3-digit number.\n" + r"""Action: type(content='grep -cE "\d{3}" notes.txt\n')"""
    assert parse_action(text, "uitars", S).action == A("type", text='grep -cE "\\d{3}" notes.txt\n')
    text = "Thought: Strip trailing spaces.\n" + r"""Action: type(content='sed -i \'s/\s\+$//\' notes.txt\n')"""
    assert parse_action(text, "uitars", S).action == A("type", text="sed -i 's/\\s\\+$//' notes.txt\n")
    text = '{"intent": "search digits", "action": "Text(100, 200, \\"[0-9]\\\\d+\\")"}'
    assert parse_action(text, "explore", S).action == A("type", x=100, y=200, text="[0-9]\\d+")


def test_calls_after_the_first_on_one_action_line_are_not_run():
    # Where we differ on purpose: the references run every call of the last action line (split on
    # blank lines); a step here is one action, so the first runs, the one planned on this screen.
    text = ("Thought: Click the search box, then type the query.\nAction: click(start_box='(640,60)')\n\n"
            "type(content='weather\\n')")
    assert parse_action(text, "uitars", S).action == A("click", x=640, y=60)


def test_action_inside_a_quoted_argument_is_text():
    # Where we are better than split("Action:")[-1]: an "Action:" inside a quoted argument of a
    # well-formed call is part of the text, not a second action line.
    p = parse_action("Thought: Log the step.\nAction: type(content='Action: saved the file\\n')", "uitars", S)
    assert p == Parsed(A("type", text="Action: saved the file\n"), "Log the step.")
    p = parse_action("Thought: done\nAction: finished(content='Action: none needed')", "uitars", S)
    assert p.action == A("done")


# ------------------------------------------------------------------------------------------------
# Coordinates


def test_smart_resize_hand_computed():
    # 1280x720: 720/28 = 25.71 -> 26*28 = 728; 1280/28 = 45.71 -> 46*28 = 1288;
    # 728*1288 = 937,664 <= 1,003,520 (= 28*28*1280), so no rescale.
    assert smart_resize(720, 1280) == (728, 1288)
    # 1920x1080: 39*28 x 69*28 = 1092*1932 = 2,109,744 > 1,003,520, so shrink by
    # beta = sqrt(1920*1080 / 1,003,520) = sqrt(2.06632) = 1.43747:
    # h = floor(1080 / 1.43747 / 28) * 28 = floor(26.83) * 28 = 728
    # w = floor(1920 / 1.43747 / 28) * 28 = floor(47.70) * 28 = 1316
    assert smart_resize(1080, 1920) == (728, 1316)
    # 20x30 is tiny: 28*28 = 784 < 3136 (= 56*56), so grow by beta = sqrt(3136 / 600) = 2.2862:
    # h = ceil(20 * 2.2862 / 28) * 28 = ceil(1.633) * 28 = 56; w = ceil(30 * 2.2862 / 28) * 28 = ceil(2.449) * 28 = 84
    assert smart_resize(20, 30) == (56, 84)
    with pytest.raises(ValueError):
        smart_resize(1, 500)  # aspect ratio 500 > 200


def _transformers_smart_resize():
    """transformers' own Qwen2-VL resize function, the reference. Importing the transformers
    package is slow, so we compile just that function from its source file (same code,
    same behaviour); if the file moved in another version, we import it the slow way."""
    import ast
    import importlib.util
    import math
    spec = importlib.util.find_spec("transformers")
    path = os.path.join(spec.submodule_search_locations[0], "models", "qwen2_vl", "image_processing_qwen2_vl.py")
    try:
        tree = ast.parse(open(path).read())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize")
        ns = {"math": math}
        exec(compile(ast.Module([fn], type_ignores=[]), path, "exec"), ns)
        return ns["smart_resize"]
    except (OSError, StopIteration):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        return smart_resize


def test_smart_resize_matches_transformers():
    ref = _transformers_smart_resize()
    rng = random.Random(0)
    sizes = [(720, 1280), (1080, 1920), (768, 1366), (900, 1440), (1600, 2560), (20, 30), (28, 28)]
    sizes += [(rng.randint(10, 3000), rng.randint(10, 3000)) for _ in range(300)]
    for h, w in sizes:
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w) == ref(h, w, factor=28, min_pixels=56 * 56, max_pixels=28 * 28 * 1280)
        assert smart_resize(h, w, min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28) == ref(
            h, w, factor=28, min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28)


def test_coordinate_mapping_hand_computed():
    img = (1288, 728)  # smart_resize of 1280x720, as (w, h)
    # (644, 364) in the image -> 644 * 1280 / 1288 = 640.0, 364 * 720 / 728 = 360.0
    p = parse_action('{"intent": "c", "action": "Click(644, 364)"}', "explore", S, image=img)
    assert (p.action.x, p.action.y) == (640, 360)
    # (100, 200) -> 100 * 1280 / 1288 = 99.38 -> 99; 200 * 720 / 728 = 197.80 -> 198
    p = parse_action("Action: click(start_box='(100,200)')", "uitars", S, image=img)
    assert (p.action.x, p.action.y) == (99, 198)
    # drag end points are mapped too: (1288, 728) -> (1280, 720) -> clamped to (1279, 719)
    p = parse_action("Action: drag(start_box='(0,0)', end_box='(1288,728)')", "uitars", S, image=img)
    assert (p.action.x, p.action.y, p.action.x2, p.action.y2) == (0, 0, 1279, 719)
    # rel1000: (500, 500) -> (0.5 * 1280, 0.5 * 720) = (640, 360); (250, 100) -> (320, 72)
    p = parse_action("Action: click(start_box='(500,500)')", "uitars", S, rel1000=True)
    assert (p.action.x, p.action.y) == (640, 360)
    p = parse_action('{"intent": "c", "action": "Click(250, 100)"}', "explore", S, rel1000=True)
    assert (p.action.x, p.action.y) == (320, 72)
    # halves round up: 0.5 -> 1 (Python's round() would give 0)
    assert to_screen(0.5, 2.5, S) == (1, 3)


@pytest.mark.parametrize("screen", [(1280, 720), (1920, 1080), (800, 600)])
def test_coordinate_round_trip(screen):
    # Screen pixel -> what the model sees (scaled, rounded to an int as a model would write it)
    # -> back through parse_action. Rounding in the image costs at most half an image pixel,
    # i.e. 0.5 * sw/iw screen pixels (<= 0.73 at 1920 -> 1316), so we land within 1 pixel.
    ih, iw = smart_resize(screen[1], screen[0])
    for sx in range(0, screen[0], 37):
        for sy in range(0, screen[1], 41):
            mx, my = round(sx * iw / screen[0]), round(sy * ih / screen[1])
            p = parse_action(f"Action: click(start_box='({mx},{my})')", "uitars", screen, image=(iw, ih))
            assert abs(p.action.x - sx) <= 1 and abs(p.action.y - sy) <= 1, (sx, sy, p.action)


# ------------------------------------------------------------------------------------------------
# Robustness: nothing raises, every action is valid and inside the screen

CHARS = list("{}[]()'\"\\,:=+-.0123456789 \n\tabcxyzACTIONThought<|>/") + ["你", "🌍", "\u0000", "é"]


def _mutate(rng, s):
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(5)
        i = rng.randint(0, len(s))
        if op == 0:
            s = s[:i]                                            # truncate
        elif op == 1:
            s = s[:i] + s[i + rng.randint(1, 5):]               # delete
        elif op == 2:
            s = s[:i] + "".join(rng.choice(CHARS) for _ in range(rng.randint(1, 6))) + s[i:]
        elif op == 3:
            s = s[:i] + s[rng.randint(0, len(s)):][:20] + s[i:]  # splice a piece of itself
        else:
            s = s.replace(str(rng.randint(0, 9)), str(rng.randint(-99999, 99999)))
    return s


def _check(p, screen):
    if p is None:
        return
    a = p.action
    assert Action.from_dict(a.to_dict()) == a  # the server's schema accepts it
    for x, y in ((a.x, a.y), (a.x2, a.y2)):
        if x is not None:
            assert 0 <= x < screen[0] and 0 <= y < screen[1]


def test_random_inputs_never_raise():
    rng = random.Random(1234)
    t0 = time.process_time()  # CPU seconds of this process: other jobs on the machine do not count
    n_parsed = 0
    for i in range(5000):
        style = "explore" if i % 2 else "uitars"
        table = EXPLORE if style == "explore" else UITARS
        screen = rng.choice([(1280, 720), (1920, 1080), (640, 480)])
        image = rng.choice([None, (1288, 728), (28, 28), (4000, 3000)])
        if rng.random() < 0.1:
            text = "".join(rng.choice(CHARS) for _ in range(rng.randint(0, 200)))
        else:
            text = _mutate(rng, rng.choice(table)[0])
        p = parse_action(text, style, screen, image=image, rel1000=rng.random() < 0.2)
        _check(p, screen)
        n_parsed += p is not None
    assert n_parsed > 500  # the mutations leave many outputs parseable: we really exercised both paths
    # far under the bound on one core; only runaway backtracking on the mutated inputs comes near 8 s
    assert time.process_time() - t0 < 8


def test_huge_and_hostile_inputs_are_fast():
    hostile = [
        "x" * 1_000_000,
        "{" * 15_000,
        "[" * 15_000 + '{"intent": "x", "action": "Click(1, 2)"}',
        '{"intent": "' + "\\" * 15_000,
        "Action: click(" + "'" * 15_000,
        "Action: type(content='" + "\\'" * 7_000,
        "Action: click(start_box='" + "(" * 15_000,
        "Thought: " + "Action: " * 1500,
        '{"intent": "x", "action": "Click(' + "9" * 5000 + ', 1)"}',
        "Action: click(start_box='(" + "9" * 5000 + ",1)')",
        None, 12, b"bytes",
    ]
    t0 = time.process_time()  # CPU seconds of this process: other jobs on the machine do not count
    for text in hostile:
        for style in ("explore", "uitars"):
            _check(parse_action(text, style, S), S)
    # far under the bound on one core; only runaway backtracking on the 15,000-character inputs comes near 3 s
    assert time.process_time() - t0 < 3


def test_bad_style_or_screen_is_a_caller_bug():
    with pytest.raises(ValueError):
        parse_action("Action: wait()", "json", S)
    with pytest.raises(ValueError):
        parse_action("Action: wait()", "uitars", (0, 720))


# ------------------------------------------------------------------------------------------------
# Action dict round trip and validation


def test_action_dict_round_trip():
    a = A("drag", x=1, y=2, x2=3, y2=4)
    assert a.to_dict() == {"type": "drag", "x": 1, "y": 2, "x2": 3, "y2": 4}
    assert Action.from_dict(a.to_dict()) == a
    assert Action.from_dict({"type": "key", "keys": ["ctrl", "c"]}) == A("key", keys=["ctrl", "c"])


@pytest.mark.parametrize("d,word", [
    ({"type": "jump"}, "type"),
    ({"type": "click", "x": 1}, "'y'"),
    ({"type": "click", "x": 1.5, "y": 2}, "'x'"),
    ({"type": "click", "x": True, "y": 2}, "'x'"),
    ({"type": "click", "x": 1, "y": 2, "button": "left"}, "button"),
    ({"type": "type"}, "text"),
    ({"type": "key", "keys": "ctrl+c"}, "keys"),
    ({"type": "scroll", "direction": "sideways"}, "direction"),
    ({"type": "drag", "x": 1, "y": 2}, "x2"),
    ([1, 2], "type"),
    ({"type": "done", "text": "answer"}, "text"),             # the server takes no fields on done
    ({"type": "type", "text": "a\0b"}, "text"),
])
def test_action_from_dict_rejects(d, word):
    with pytest.raises(ValueError, match=word):
        Action.from_dict(d)
