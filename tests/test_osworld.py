"""OSWorld's VMs, task files and evaluators (osworld_env.py), without OSWorld's server, nothing
mocked: the --vms spellings; the task loader on task files in OSWorld's format (written here);
the pyautogui code of every action, by hand-written strings, and run by real pyautogui on one real
desktop against the project's own /action on another (the same pointer, buttons, keys and text);
the scoring rules through OSWorld's real DesktopEnv.evaluate (its setup controller talking to a
loopback HTTP server, the only thing a VM-less evaluate needs). The end-to-end test against
OSWorld's own server is tests/test_osworld_server.py (skipped unless OSWORLD_SRC names a checkout).

Run: python -m pytest -q tests/test_osworld.py    (~40 s; two desktops)
"""

from __future__ import annotations

import ast
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import free_port, mouse, start_vm_server, vm_call, wait_for, x11, x_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import osworld_env  # noqa: E402
from actions import Action  # noqa: E402
from env import TaskError, VMError  # noqa: E402


# ------------------------------------------------------------------------------------------------
# --vms osworld:...


def test_specs_expand_to_one_entry_per_vm_and_join_back():
    assert osworld_env.expand("osworld:attach:127.0.0.1:5000,10.0.0.2:5001") == [
        ("attach", "127.0.0.1:5000"), ("attach", "10.0.0.2:5001")]
    assert osworld_env.expand("osworld:docker:3") == [("docker", "")] * 3
    assert osworld_env.expand("osworld:aws:us-east-1:2|osworld:vmware:/vms/a.vmx,/vms/b.vmx") == [
        ("aws", "us-east-1"), ("aws", "us-east-1"), ("vmware", "/vms/a.vmx"), ("vmware", "/vms/b.vmx")]
    specs = osworld_env.expand("osworld:attach:h:1|osworld:docker:2|osworld:azure:eastus:1")
    assert osworld_env.expand(osworld_env.join(specs)) == specs  # a rank's slice passes on intact
    assert osworld_env.join(specs[1:3]) == "osworld:docker:1|osworld:docker:1"


@pytest.mark.parametrize("bad", ["osworld:attach:host", "osworld:attach:h:99999", "osworld:docker:0",
                                 "osworld:docker:x", "osworld:gcp:1", "osworld:aws:3", "osworld:", "docker:2"])
def test_bad_specs_say_what_is_wrong(bad):
    with pytest.raises(ValueError, match="osworld:attach:HOST:PORT"):
        osworld_env.expand(bad)


def test_ranks_take_slices_of_the_vms():
    """Two real gloo ranks (as torchrun starts them): each gets a contiguous slice, and its offset."""
    code = ("import sys, torch.distributed as td; sys.path.insert(0, sys.argv[1]); "
            "td.init_process_group('gloo', init_method=sys.argv[2], rank=int(sys.argv[3]), world_size=2); "
            "from plumbing import rundir; print(rundir.local_vms('osworld:attach:h:1,h:2,h:3|osworld:docker:1'))")
    where = f"tcp://127.0.0.1:{free_port()}"
    ranks = [subprocess.Popen([sys.executable, "-c", code, ROOT, where, str(r)], stdout=subprocess.PIPE, text=True)
             for r in (0, 1)]
    out = [p.communicate(timeout=120)[0].strip() for p in ranks]
    assert out == ["('osworld:attach:h:1|osworld:attach:h:2', 0)", "('osworld:attach:h:3|osworld:docker:1', 2)"]


# ------------------------------------------------------------------------------------------------
# OSWorld's task files


def write_examples(root) -> str:
    """Three tasks in OSWorld's format (our own texts): two domains, one infeasible."""
    tasks = {
        "os": [{"id": "t-os-1", "instruction": "Make a folder named reports in the home folder.",
                "config": [{"type": "execute", "parameters": {"command": ["true"]}}], "related_apps": ["os"],
                "evaluator": {"func": "exact_match", "result": {"type": "vm_command_line", "command": "ls ~"},
                              "expected": {"type": "rule", "rules": {"expected": "reports"}}}},
               {"id": "t-os-2", "instruction": "Print this page on paper.", "config": [],
                "evaluator": {"func": "infeasible"}}],
        "gimp": [{"id": "t-gimp-1", "instruction": "Open the picture.", "config": [], "related_apps": ["gimp"],
                  "evaluator": {"func": ["check_include_exclude", "exact_match"], "conj": "or",
                                "result": [{"type": "rule", "rules": "x"}, {"type": "rule", "rules": "y"}]}}],
    }
    for domain, items in tasks.items():
        os.makedirs(os.path.join(root, "examples", domain))
        for t in items:
            with open(os.path.join(root, "examples", domain, f"{t['id']}.json"), "w") as f:
                json.dump(t, f)
    meta = os.path.join(root, "test_all.json")
    with open(meta, "w") as f:
        json.dump({d: [t["id"] for t in items] for d, items in tasks.items()}, f)
    return meta


def test_the_loader_reads_osworld_task_files_as_they_are(tmp_path):
    meta = write_examples(tmp_path)
    tasks = osworld_env.load_tasks(meta)
    assert [(t.id, t.domain, t.infeasible, t.max_steps) for t in tasks] == [
        ("t-os-1", "os", False, 15), ("t-os-2", "os", True, 15), ("t-gimp-1", "gimp", False, 15)]
    raw = json.loads((tmp_path / "examples" / "os" / "t-os-1.json").read_text())
    assert tasks[0].setup == [{"type": "osworld", "task": raw}]  # the whole file: DesktopEnv.reset takes it
    assert tasks[0].instruction == raw["instruction"] and tasks[0].apps == ("os",)
    assert tasks[2].evaluator == {"osworld": ["check_include_exclude", "exact_match"]}
    assert [t.id for t in osworld_env.load_tasks(meta, str(tmp_path / "examples"), ["t-gimp-1"])] == ["t-gimp-1"]


def test_the_loader_names_what_is_wrong(tmp_path):
    meta = write_examples(tmp_path)
    with pytest.raises(TaskError, match=r"no task with id \['nope'\]"):
        osworld_env.load_tasks(meta, ids=["t-os-1", "nope"])
    with pytest.raises(TaskError, match="check --osworld-examples"):
        osworld_env.load_tasks(meta, str(tmp_path / "elsewhere"))
    (tmp_path / "bad.json").write_text('["t-os-1"]')
    with pytest.raises(TaskError, match="domain"):
        osworld_env.load_tasks(str(tmp_path / "bad.json"))
    (tmp_path / "examples" / "os" / "t-os-2.json").write_text('{"id": "t-os-2"}')
    with pytest.raises(TaskError, match="'instruction' is missing"):
        osworld_env.load_tasks(meta)


# ------------------------------------------------------------------------------------------------
# Our actions as pyautogui code


def hexed(s: str) -> str:
    return f"bytes.fromhex('{s.encode().hex()}').decode('utf-8')"


def test_the_code_of_each_action_by_hand():
    code = osworld_env.pyautogui_code
    assert code(Action("click", x=10, y=20)) == "pyautogui.click(10, 20, clicks=1, interval=0.05, button='left')"
    assert code(Action("click")) == "pyautogui.click(clicks=1, interval=0.05, button='left')"
    assert code(Action("double_click", x=3, y=4)) == "pyautogui.click(3, 4, clicks=2, interval=0.05, button='left')"
    assert code(Action("right_click", x=5, y=6)) == "pyautogui.click(5, 6, clicks=1, interval=0.05, button='right')"
    assert code(Action("move", x=7, y=8)) == "pyautogui.moveTo(7, 8)"
    assert code(Action("drag", x=1, y=2, x2=30, y2=40)) == (
        "pyautogui.moveTo(1, 2); pyautogui.mouseDown(); pyautogui.moveTo(30, 40, duration=0.3); pyautogui.mouseUp()")
    assert code(Action("scroll", direction="down", x=50, y=60)) == "pyautogui.moveTo(50, 60); pyautogui.scroll(-5)"
    assert code(Action("scroll", direction="up", amount=2)) == "pyautogui.scroll(2)"
    assert code(Action("scroll", direction="left", amount=3, x=1, y=1)) == "pyautogui.moveTo(1, 1); pyautogui.hscroll(-3)"
    assert code(Action("key", keys=["ctrl", "s"])) == (
        f"keys = [{hexed('ctrl')}, {hexed('s')}]\nbad = [k for k in keys if k not in pyautogui.KEYBOARD_KEYS]\n"
        "if bad:\n    print('unknown key name(s) %r' % bad, file=sys.stderr)\n    sys.exit(3)\npyautogui.hotkey(*keys)")
    typed = code(Action("type", text="hi\n", x=9, y=9)).splitlines()
    assert typed[0] == "def type_text(text: str) -> None:"  # vm/act.py's own, what /action runs
    assert typed[-2:] == ["pyautogui.click(9, 9)", f"type_text({hexed('hi' + chr(10))})"]


def test_arpos_mapping_from_answers_to_code_by_hand():
    """ARPO's rules for UI-TARS answers on OSWorld, through the project's parser and this mapping,
    on a 1920x1080 VM whose screenshot the model saw at 1288x728 (a --max-pixels below ARPO's):
    coordinates scale from the image to the screen; finished() is DONE and call_user() FAIL (no
    code runs, the episode ends); a type ending in a newline presses Enter (pyautogui writes it);
    hotkey keys split on spaces; an answer that does not parse is no action (a format failure)."""
    from actions import parse_action
    screen, seen = (1920, 1080), (1288, 728)

    def code(text):
        p = parse_action(text, "uitars", screen, seen)
        return None if p is None else (p.action.type if p.action.type in ("done", "fail", "wait")
                                       else osworld_env.pyautogui_code(p.action))
    assert code("Thought: the icon.\nAction: click(start_box='<|box_start|>(644,364)<|box_end|>')") == \
        "pyautogui.click(960, 540, clicks=1, interval=0.05, button='left')"
    assert code("Action: left_double(start_box='(0,0)')") == "pyautogui.click(0, 0, clicks=2, interval=0.05, button='left')"
    assert code("Action: right_single(start_box='(1287,727)')") == \
        "pyautogui.click(1919, 1079, clicks=1, interval=0.05, button='right')"
    assert code("Action: hotkey(key='ctrl shift t')").startswith(f"keys = [{hexed('ctrl')}, {hexed('shift')}, {hexed('t')}]")
    assert code("Action: type(content='ls -la\\n')").endswith(f"type_text({hexed('ls -la' + chr(10))})")
    assert code("Action: scroll(start_box='(644,364)', direction='down')") == "pyautogui.moveTo(960, 540); pyautogui.scroll(-5)"
    assert code("Action: finished(content='done')") == "done"
    assert code("Action: call_user()") == "fail"
    assert code("Action: wait()") == "wait"
    assert code("Thought: hmm\nAction: clack(start_box='(1,2)')") is None


def test_no_model_text_becomes_code():
    # Whatever the text, the code's only string literals are hex digits and the fixed ones above.
    evil = "'); import os; os.system('touch /tmp/pwned'); ('\"\"\" \\x27 {command} \n"
    for a in (Action("type", text=evil), Action("key", keys=[evil, "enter"])):
        tree = ast.parse(osworld_env.PREFIX + osworld_env.pyautogui_code(a))
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "fromhex"]
        assert calls and all(all(ch in "0123456789abcdef" for ch in c.args[0].value) for c in calls)
        assert "import os" not in "".join(c.args[0].value for c in calls)  # only as hex
        assert not any(isinstance(n, ast.Constant) and isinstance(n.value, str) and "pwned" in n.value
                       for n in ast.walk(tree))


# The same action, through /action on one desktop and as OSWorld's server would run the code (python
# -c, real pyautogui) on another: an override-redirect window over each whole screen, with the
# keyboard focus, records what the X server delivered to it.
RECORDER = r"""
import sys, time
from Xlib import X, XK, display
d = display.Display()
s = d.screen()
w = s.root.create_window(0, 0, s.width_in_pixels, s.height_in_pixels, 0, s.root_depth, override_redirect=True,
                         background_pixel=s.white_pixel,
                         event_mask=X.KeyPressMask | X.ButtonPressMask | X.ButtonReleaseMask | X.StructureNotifyMask)
w.map()
d.sync()
while d.next_event().type != X.MapNotify:
    pass
w.set_input_focus(X.RevertToParent, X.CurrentTime)
d.sync()
print("ready", flush=True)
end = time.time() + float(sys.argv[1])
while time.time() < end:
    while d.pending_events():
        e = d.next_event()
        if e.type == X.MappingNotify:
            d.refresh_keyboard_mapping(e)
        elif e.type == X.KeyPress:
            sym = d.keycode_to_keysym(e.detail, 1 if e.state & X.ShiftMask else 0) or d.keycode_to_keysym(e.detail, 0)
            print("key", XK.keysym_to_string(sym) or sym, e.state & (X.ShiftMask | X.ControlMask), flush=True)
        elif e.type in (X.ButtonPress, X.ButtonRelease):
            print("press" if e.type == X.ButtonPress else "release", e.detail, e.root_x, e.root_y, flush=True)
    time.sleep(0.005)
"""

ACTIONS = [Action("click", x=100, y=200), Action("double_click", x=300, y=150), Action("right_click", x=640, y=360),
           Action("drag", x=100, y=100, x2=400, y2=300), Action("scroll", direction="down", x=500, y=400, amount=3),
           Action("scroll", direction="left", amount=2), Action("scroll", direction="up", x=20, y=30, amount=1),
           Action("key", keys=["ctrl", "a"]), Action("key", keys=["enter"]), Action("move", x=1000, y=600),
           Action("type", text="Hi, 'you' \"q\" <a> & {x}\n"), Action("type", text="é ü ß", x=50, y=50)]


def record(vm, seconds: float) -> subprocess.Popen:
    prefix, env = x_env(vm)
    p = subprocess.Popen([*prefix, sys.executable, "-c", RECORDER, str(seconds)], env=env, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.fixture(scope="module")
def two_desktops():
    a, b = start_vm_server(), start_vm_server()
    yield a, b
    a.stop(), b.stop()


@pytest.mark.parametrize("action", ACTIONS, ids=[a.type + str(i) for i, a in enumerate(ACTIONS)])
def test_the_code_does_what_our_action_does(two_desktops, action):
    ours, theirs = two_desktops
    for vm in (ours, theirs):  # the same start: the pointer in the same place
        x11(vm, "xdotool", "mousemove", "640", "360", check=True)
    rec = [record(vm, 2.5) for vm in (ours, theirs)]
    r = vm_call(ours, "POST", "/action", action.to_dict())
    assert r.status_code == 200, r.text
    code = osworld_env.PREFIX + osworld_env.pyautogui_code(action)
    prefix, env = x_env(theirs)
    ran = subprocess.run([*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    events = [p.communicate(timeout=30)[0].splitlines() for p in rec]
    assert events[0] == events[1]
    if action.type != "move":  # a move delivers no button or key: the pointer's place says it
        assert events[0], "the recorder saw nothing: the comparison would prove nothing"
    assert mouse(ours) == mouse(theirs)


def test_an_unknown_key_is_refused_with_its_own_exit_code(two_desktops):
    _, theirs = two_desktops
    prefix, env = x_env(theirs)
    code = osworld_env.PREFIX + osworld_env.pyautogui_code(Action("key", keys=["ctrl", "hyperdrive"]))
    ran = subprocess.run([*prefix, sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert ran.returncode == osworld_env.REFUSED and "hyperdrive" in ran.stderr


# ------------------------------------------------------------------------------------------------
# The scoring rules, through OSWorld's own DesktopEnv.evaluate


class _Terminal(http.server.BaseHTTPRequestHandler):
    """What SetupController.setup asks before any step (GET /terminal): the VM is there."""
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def desktop_env_without_vm():
    """A real DesktopEnv whose evaluate runs without a VM: built without its constructor (which
    starts one), its setup controller on a loopback server that answers /terminal."""
    de = pytest.importorskip("desktop_env.desktop_env", reason="OSWorld's client (requirements-osworld.txt)")
    from desktop_env.controllers.setup import SetupController
    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Terminal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = de.DesktopEnv.__new__(de.DesktopEnv)
    env.enable_proxy, env.is_environment_used, env.action_history = False, False, []
    env.setup_controller = SetupController(vm_ip="127.0.0.1", server_port=port, cache_dir="/nonexistent")
    yield env
    server.shutdown()


def osworld_score(env, evaluator: dict, last) -> float:
    env._set_evaluator_info({"evaluator": evaluator})
    env.action_history = [] if last is None else ["pyautogui.click(1, 1)", last]
    return float(env.evaluate())


@pytest.mark.parametrize("end, ours, theirs", [
    ("fail", {"type": "fail"}, "FAIL"), ("done", {"type": "done"}, "DONE"),
    ("max_steps", {"type": "click", "x": 2, "y": 2}, "pyautogui.click(2, 2)"),
    ("format", None, "DONE")])  # ARPO's environment ends an unparseable answer with DONE
def test_our_scores_are_desktop_envs(desktop_env_without_vm, end, ours, theirs):
    """outcome_scores (the episode's score, hard protocol: the last action as played, ARPO's and
    training's) against DesktopEnv.evaluate for the same last action: an infeasible task scores 1
    only if the agent gave up (FAIL); a feasible one 0 if it did, else its metric's score (here a
    metric of OSWorld's on rule getters: 1). The standard protocol counts running out of steps as
    FAIL: DesktopEnv's score with FAIL last."""
    import train_arpo
    env = desktop_env_without_vm
    feasible = {"func": "check_include_exclude", "result": {"type": "rule", "rules": "the reports folder"},
                "expected": {"type": "rule", "rules": {"include": ["reports"], "exclude": []}}}
    actions = [{"type": "click", "x": 1, "y": 1}, ours]
    for infeasible, evaluator in ((True, {"func": "infeasible"}), (False, feasible)):
        hard, standard = train_arpo.outcome_scores(infeasible, actions, end, None if infeasible else 1.0)
        assert hard == osworld_score(env, evaluator, theirs), (end, infeasible)
        assert standard == osworld_score(env, evaluator, "FAIL" if end == "max_steps" else theirs), (end, infeasible)


def test_an_evaluator_that_raises_drops_the_episode(desktop_env_without_vm):
    client = osworld_env.OSWorldClient.__new__(osworld_env.OSWorldClient)
    client.env, client.url = desktop_env_without_vm, "http://127.0.0.1:1"
    client.env._set_evaluator_info({"evaluator": {"func": "exact_match", "result": {"type": "rule"}}})  # no rules
    client.env.action_history = []
    with pytest.raises(VMError, match="OSWorld's evaluator raised KeyError"):
        client.evaluate({})


# ------------------------------------------------------------------------------------------------
# The command line

BLOCK = """import sys
class NotInstalled:  # desktop_env as on a machine without requirements-osworld.txt
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] == 'desktop_env':
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NotInstalled())
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
import runpy
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def test_without_osworlds_client_the_run_stops_with_one_sentence(tmp_path):
    meta = write_examples(tmp_path)
    done = subprocess.run([sys.executable, "-c", BLOCK, ROOT, os.path.join(ROOT, "train_arpo.py"), "--vms",
                           "osworld:attach:127.0.0.1:9", "--osworld-tasks", meta, "--model", "tiny",
                           "--runs-dir", str(tmp_path / "runs")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "pip install -r requirements-osworld.txt" in done.stderr.strip().splitlines()[-1]
    assert not os.listdir(tmp_path / "runs")  # no half-made run folder


def test_screenexplorer_refuses_osworlds_vms(tmp_path):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train_explore.py"), "--vms", "osworld:docker:1",
                           "--runs-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode != 0 and "is for train_arpo.py" in done.stderr and "Traceback" not in done.stderr
