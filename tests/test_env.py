"""Tests for env.py's VM side (VMClient, VMPool, launch_local_vms) and env.py (load_tasks).

Run: python -m pytest -q tests/test_env.py   (needs Xvfb & co from setup.sh; about a minute)

Everything is real: `vm_server.py --xvfb` desktops started by launch_local_vms, HTTP on loopback,
processes killed with real signals. The shared desktop comes from tests/conftest.py. Parsing is tested in tests/test_parse_action.py.
"""

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time

import pytest
from PIL import Image

from actions import Action, parse_action
from conftest import free_port, wait_for
from env import APP_CLASSES, VMClient, VMError, VMPool, app_of, launch_local_vms
from env import Task, TaskError, load_tasks



@pytest.fixture
def vm(vm_desktop):
    """The session's shared desktop (tests/conftest.py: a real `vm_server.py --xvfb`)."""
    return vm_desktop


@pytest.fixture
def client(vm):
    c = VMClient(vm.url, vm.token, timeout=15)
    c.reset()  # every test starts from the initial desktop...
    yield c
    c.reset()  # ...and leaves it that way for the next test that shares it


# ------------------------------------------------------------------------------------------------
# VMClient


def test_client_round_trip(client, vm):
    assert client.health() == {"ok": True, "screen": [1280, 720]}
    img = client.screenshot()
    assert isinstance(img, Image.Image) and img.size == (1280, 720) and img.mode == "RGB"
    assert client.screenshot(format="jpeg", quality=50).size == (1280, 720)
    none = {"seconds": 0.0, "until": "none", "first_change": None}  # no settle asked for: none done
    assert client.act(Action("move", x=10, y=10)) == {"ok": True, "settle": none}
    assert client.act({"type": "wait", "amount": 0}) == {"ok": True, "settle": none}
    ev = client.evaluate({"conj": "and", "checks": [{"type": "file_exists", "path": "notes.txt"}]})
    assert ev["score"] == 1.0
    ev = client.evaluate({"conj": "and", "checks": [{"type": "file_exists", "path": "nope.txt"}]})
    assert ev["score"] == 0.0 and ev["details"][0]["passed"] is False
    out = client.setup([{"type": "write_file", "path": "a/b.txt", "content": "hello"}])
    assert out["ok"] is True
    ev = client.evaluate({"checks": [{"type": "file_contains", "path": "a/b.txt", "text": "hell"}]})
    assert ev["score"] == 1.0
    assert client.setup([]) == {"ok": True, "results": []}  # nothing to do: no request at all


def test_a_screenshot_is_stored_as_the_png_it_came_as(client):
    """env.png_bytes: a screenshot from a VM gives back the very bytes the server sent (no encoding
    again), and those decode to its pixels; anything else (a crop, which carries the screenshot's
    PIL info, or an image made here) is encoded, never mistaken for the screen it came from."""
    import io
    from env import png_bytes
    sent = client._call("GET", "/screenshot", retries=2).content
    img = client.screenshot()
    got = png_bytes(img)
    assert got[:8] == b"\x89PNG\r\n\x1a\n" and len(got) == len(sent)
    assert Image.open(io.BytesIO(got)).tobytes() == img.tobytes()  # the same pixels: what the model saw
    assert png_bytes(img) is got  # kept, not encoded again
    crop = img.crop((0, 0, 64, 32))
    assert Image.open(io.BytesIO(png_bytes(crop))).size == (64, 32)  # its own pixels, not the screen's
    made = Image.new("RGB", (8, 8), (1, 2, 3))
    assert Image.open(io.BytesIO(png_bytes(made))).getpixel((0, 0)) == (1, 2, 3)
    jpeg = client.screenshot(format="jpeg")  # not lossless: its bytes are never stored as the screen
    assert png_bytes(jpeg)[:8] == b"\x89PNG\r\n\x1a\n" and png_bytes(jpeg) is not png_bytes(jpeg)
    shown = client.act(Action("move", x=10, y=10), settle="watch", screenshot="png").image  # an action's screen
    assert png_bytes(shown) is png_bytes(shown)  # kept as it came, too


def test_client_errors_name_the_url(vm):
    c = VMClient(vm.url, vm.token, timeout=15)
    with pytest.raises(VMError) as e:
        c.act({"type": "click", "x": 99999, "y": 1})  # off screen: the server refuses it
    assert e.value.status == 400 and vm.url in str(e.value)
    with pytest.raises(VMError) as e:
        VMClient(vm.url, "wrong-token").health()
    assert e.value.status == 401 and vm.url in str(e.value)
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(VMError) as e:
        VMClient(dead, timeout=2).screenshot()  # retried, then a clear error
    assert e.value.status is None and dead in str(e.value) and "vm_server.py" in str(e.value)


def test_a_request_closed_unread_is_sent_again(client, vm):
    """vm_server.py closes a keep-alive connection left idle for its --request-timeout without a
    word; a request sent just as it does is lost unread, and requests retries nothing. VMClient
    sends it again on a new connection, POST /action included (it never ran). Deterministic here:
    a relay in front of the real server closes the first connection it accepts without reading a
    byte and joins every later one to the server (tests/test_http_hardening.py hits the real race)."""
    from conftest import mouse
    host, port = vm.url.split("//")[1].split(":")
    relay = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def pump(a, b):  # one direction of a joined connection, until either side closes
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for s in (a, b):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def serve():
        while True:
            try:
                c, _ = relay.accept()
            except OSError:  # the test closed the relay
                return
            accepted.append(c)
            if len(accepted) == 1:
                c.close()  # unread: the request in flight is lost, as in the race
                continue
            up = socket.create_connection((host, int(port)))
            threading.Thread(target=pump, args=(c, up), daemon=True).start()
            threading.Thread(target=pump, args=(up, c), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    c = VMClient(f"http://127.0.0.1:{relay.getsockname()[1]}", vm.token, timeout=10)
    try:
        assert c.act(Action("move", x=321, y=123))["ok"] is True  # act is never retried otherwise
        assert len(accepted) == 2 and mouse(vm) == (321, 123)
    finally:
        c.close()
        relay.close()
        for s in accepted:
            s.close()


def test_parsed_actions_drive_the_desktop(client):
    # Model text -> parse_action -> VMClient.act -> a real change on the desktop.
    # 1. explore DoubleClick on the Terminal icon (74, 46) opens an xterm window.
    p = parse_action('{"intent": "open a terminal", "action": "DoubleClick(74, 46)"}', "explore", (1280, 720))
    client.act(p.action)
    xterm = {"checks": [{"type": "window_exists", "title": "xterm"}]}
    wait_for(lambda: client.evaluate(xterm)["score"] == 1.0, "the xterm the DoubleClick opens", 10)
    # 2. Text(x, y, "...") is one `type` action with x, y: the server clicks there first. Move the
    # focus away to the desktop, then type into the terminal by its coordinates: the command only
    # runs if that click landed and focused the terminal.
    wid = client.setup([{"type": "command", "argv": ["xdotool", "search", "--name", "^xterm$"]}])["results"][0]["stdout"].split()[0]
    geo = client.setup([{"type": "command", "argv": ["xdotool", "getwindowgeometry", wid]}])["results"][0]["stdout"]
    px, py = map(int, geo.split("Position:")[1].split()[0].split(","))
    gw, gh = map(int, geo.split("Geometry:")[1].split()[0].split("x"))
    client.act(Action("click", x=1100, y=650))  # empty desktop, far from the terminal
    text = json.dumps({"intent": "make a file", "action": f'Text({px + gw // 2}, {py + gh // 2}, "touch made_by_text.txt\\n")'})
    p = parse_action(text, "explore", (1280, 720))
    assert p.action.type == "type" and p.action.x is not None
    client.act(p.action)
    made = {"checks": [{"type": "file_exists", "path": "made_by_text.txt"}]}
    wait_for(lambda: client.evaluate(made)["score"] == 1.0, "the file the typed command makes", 10)
    # 3. reset closes it again
    client.reset()
    assert client.evaluate(xterm)["score"] == 0.0


def test_app_of_names_each_desktop_app_by_its_window_class(client, vm):
    """Each of the desktop's apps, opened by a double-click on its icon, is named by app_of from its
    window's class (GET /windows's "class"); an app's dialog is that app's; other programs' windows
    (the panel's configurator, a message box), started on the display from here, are no app."""
    from conftest import x_env
    from vm.desktop import DESKTOP_APPS, desktop_icons
    assert sorted(APP_CLASSES.values()) == sorted(stem for stem, *_ in DESKTOP_APPS)  # the table covers the icons
    icons = desktop_icons((1280, 720))
    for stem, label, *_ in DESKTOP_APPS:
        if client.windows():
            client.reset()  # an open window may cover the next icon
        client.act(Action("double_click", *icons[label]))
        got = wait_for(lambda: client.windows(), f"the window of {label}", 15)
        assert [app_of(w) for w in got] == [stem] and got[0]["title"] and "." in got[0]["class"], (label, got)

    # The editor and its Open File dialog (the same class): both the editor's. Titles keep their spaces.
    client.reset()
    client.act(Action("double_click", *icons["Text Editor"]))
    wait_for(lambda: client.windows(), "the editor", 15)
    client.act(Action("key", keys=["ctrl", "o"]))
    wins = wait_for(lambda: len(ws := client.windows()) == 2 and ws, "the Open File dialog", 15)
    assert [(w["title"], w["class"], app_of(w)) for w in wins] == [
        ("Untitled 1 - Mousepad", "mousepad.Mousepad", "editor"), ("Open File", "mousepad.Mousepad", "editor")]

    # Programs that are not the desktop's apps, started from here on its display (/setup would not
    # start them: not allow-listed): no app. The message box's class has a space in it ("-name"),
    # which must not spill into its title.
    prefix, env = x_env(vm)
    others = [subprocess.Popen([*prefix, *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
              for argv in (["tint2conf"], ["xmessage", "-name", "a message", "-title", "not  an app", "hello"])]
    try:
        wins = wait_for(lambda: len(ws := client.windows()) == 4 and ws, "tint2conf and xmessage", 20)
        assert sorted((w["class"], app_of(w)) for w in wins[2:]) == [("a message.Xmessage", None),
                                                                    ("tint2conf.Tint2conf", None)]
        assert "not  an app" in [w["title"] for w in wins]
    finally:
        for p in others:
            p.kill()
            p.wait()


def test_loaded_task_runs_on_a_real_server(client, tmp_path):
    # The task schema load_tasks accepts is the one the server accepts.
    (tmp_path / "t.json").write_text(json.dumps({
        "id": "note", "instruction": "Write a note.", "apps": ["mousepad"], "max_steps": 5,
        "setup": [{"type": "write_file", "path": "~/Documents/n.txt", "content": "draft"},
                  {"type": "sleep", "seconds": 0},
                  {"type": "command", "argv": ["cp", "Documents/n.txt", "copy.txt"], "timeout": 5}],
        "evaluator": {"conj": "and", "checks": [
            {"type": "file_exists", "path": "copy.txt"},
            {"type": "file_contains", "path": "copy.txt", "regex": "^dra"},
            {"type": "window_exists", "title": "Mousepad", "exists": False},
            {"type": "command", "argv": ["cat", "copy.txt"], "stdout": "draft", "exit_code": 0}]}}))
    [task] = load_tasks(tmp_path)
    assert client.setup(task.setup)["ok"] is True
    ev = client.evaluate(task.evaluator)
    assert ev["score"] == 1.0, ev


# ------------------------------------------------------------------------------------------------
# VMPool


def test_pool_survives_killed_and_frozen_vms():
    timeout = 6.0
    with VMPool(3, timeout=timeout) as pool:
        assert pool.size == 3 and all(vm.proc.poll() is None for vm in pool.local)
        shots = pool.screenshots()
        assert all(r.ok and r.value.size == (1280, 720) for r in shots)

        # 1. SIGKILL VM 1 in the middle of a step (while every VM is busy with a 1 s `wait`).
        victim = pool.local[1]
        killer = threading.Timer(0.3, os.kill, (victim.proc.pid, signal.SIGKILL))
        killer.start()
        res = pool.act([Action("wait", amount=1)] * 3)
        assert res[0].ok and res[2].ok
        # the broken connection tells the pool at once: a connection error, not the pool's timeout
        assert not res[1].ok and victim.url in res[1].error and "cannot reach" in res[1].error, res[1].error
        assert pool.alive == [True, False, True]
        res = pool.act([Action("move", x=5, y=5), Action("move", x=5, y=5), None])
        assert res[0].ok and not res[1].ok and "down" in res[1].error
        assert res[2].ok and res[2].value is None  # None: nothing sent to that VM

        # 2. SIGSTOP VM 2 (its process group: the server runs in a sandbox below the pid we hold):
        # its call hangs; the pool gives up on it at the timeout (not before: the VM had its time)
        # and answers for the others. Only a hang past the timeout crosses 3x it.
        frozen = pool.local[2]
        os.killpg(frozen.proc.pid, signal.SIGSTOP)
        t0 = time.time()
        res = pool.screenshots()
        took = time.time() - t0
        assert timeout - 0.5 < took < 3 * timeout, took
        assert res[0].ok and not res[2].ok and "within" in res[2].error, res[2].error
        # The stuck call does not block the next ones: VM 2 is marked down and skipped, not called.
        res = pool.screenshots()
        assert res[0].ok and not res[2].ok and "is down" in res[2].error, res[2].error
        assert pool.alive == [True, False, False]

        # 3. reset() restarts both dead local desktops, then everything works again.
        t0 = time.time()
        res = pool.reset()
        assert all(r.ok for r in res), res
        assert pool.alive == [True, True, True]
        assert victim.proc.poll() is not None and frozen.proc.poll() is not None  # old ones gone
        assert pool.local[1] is not victim and pool.local[2] is not frozen
        assert all(r.ok for r in pool.screenshots())
        print(f"reset with 2 restarts took {time.time() - t0:.1f} s")
        procs = [vm.proc for vm in pool.local]
    assert all(p.poll() is not None for p in procs)  # close() stopped them


def test_pool_of_urls_with_one_dead(vm):
    dead = f"http://127.0.0.1:{free_port()}"
    pool = VMPool(f"{vm.url}, {dead}", token=vm.secret, timeout=5)  # what --vms URL,URL --token SECRET gives
    try:
        assert pool.urls == [vm.url, dead] and pool.local is None
        res = pool.screenshots()
        assert res[0].ok and not res[1].ok and dead in res[1].error
        res = pool.reset()  # a remote VM cannot be restarted: it is re-checked and stays down
        assert res[0].ok and not res[1].ok and pool.alive == [True, False]
        res = pool.evaluate([{"checks": [{"type": "file_exists", "path": "notes.txt"}]}, None])
        assert res[0].ok and res[0].value["score"] == 1.0
    finally:
        pool.close()
    assert vm.proc.poll() is None  # closing a pool of URLs never stops someone else's VM


def test_launch_without_xvfb_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a machine where Xvfb is not installed
    with pytest.raises(VMError, match="bash setup.sh"):
        launch_local_vms(1)


def test_bad_pool_arguments():
    with pytest.raises(ValueError):
        VMPool(0)
    with pytest.raises(ValueError):
        VMPool("")


# ------------------------------------------------------------------------------------------------
# Task files

GOOD = {"id": "calc-open", "instruction": "Open the calculator.", "apps": ["galculator"],
        "setup": [{"type": "launch", "argv": ["galculator"]}],
        "evaluator": {"conj": "or", "checks": [{"type": "window_exists", "title": "Calculator"}]},
        "max_steps": 10}


def test_load_tasks_good(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    infeasible = {"id": "impossible", "instruction": "Print the screen on paper.", "infeasible": True,
                  "evaluator": {"conj": "and", "checks": []}}
    (tmp_path / "b.json").write_text(json.dumps([infeasible]))
    (tmp_path / "notes.md").write_text("not a task")
    tasks = load_tasks(tmp_path)
    assert [t.id for t in tasks] == ["calc-open", "impossible"]
    assert tasks[0] == Task("calc-open", "Open the calculator.", GOOD["setup"], GOOD["evaluator"],
                            max_steps=10, infeasible=False, apps=("galculator",))
    assert tasks[1].max_steps == 15 and tasks[1].setup == [] and tasks[1].infeasible
    assert load_tasks(tmp_path / "a.json")[0].id == "calc-open"


def test_load_tasks_reads_the_solution(tmp_path):
    # The scripted solution is checked as the server checks actions and kept as Action dicts;
    # the notes are for people and go nowhere.
    solution = [{"type": "double_click", "x": 74, "y": 246, "text": None}, {"type": "wait", "amount": 1},
                {"type": "key", "keys": ["alt", "f4"]}, {"type": "done"}]
    (tmp_path / "a.json").write_text(json.dumps({**GOOD, "solution": solution, "notes": "The calculator icon."}))
    [task] = load_tasks(tmp_path)
    assert task.solution == [{"type": "double_click", "x": 74, "y": 246}, {"type": "wait", "amount": 1},
                             {"type": "key", "keys": ["alt", "f4"]}, {"type": "done"}]
    assert task == Task("calc-open", "Open the calculator.", GOOD["setup"], GOOD["evaluator"], max_steps=10,
                        apps=("galculator",), solution=task.solution)
    assert "notes" not in vars(task)


def _with(**changes):
    d = json.loads(json.dumps(GOOD))
    for k, v in changes.items():
        if v is None:
            del d[k]
        else:
            d[k] = v
    return d


@pytest.mark.parametrize("task,field", [
    (_with(id=None), "'id'"),
    (_with(instruction=7), "'instruction'"),
    (_with(max_steps=0), "'max_steps'"),
    (_with(max_steps="15"), "'max_steps'"),
    (_with(max_steps=True), "'max_steps'"),
    (_with(max_step=15), "'max_step'"),  # a typo'd field is an error, not silently ignored
    (_with(setup=[{"type": "reboot"}]), "'setup[0]'"),
    (_with(setup=[{"type": "launch", "argv": "galculator"}]), "'setup[0].argv'"),
    (_with(setup=[{"type": "launch"}]), "'setup[0].argv'"),
    (_with(setup=[{"type": "sleep", "seconds": 99}]), "'setup[0].seconds'"),
    (_with(evaluator=None), "'evaluator'"),
    (_with(evaluator={"conj": "xor", "checks": GOOD["evaluator"]["checks"]}), "'evaluator.conj'"),
    (_with(evaluator={"checks": []}), "'evaluator.checks'"),  # empty only for infeasible tasks
    (_with(evaluator={"checks": [{"type": "screen_says", "text": "hi"}]}), "'evaluator.checks[0]'"),
    (_with(evaluator={"checks": [{"type": "file_contains", "path": "x"}]}), "'evaluator.checks[0]'"),
    (_with(evaluator={"checks": [{"type": "file_contains", "path": "x", "regex": "("}]}),
     "'evaluator.checks[0].regex'"),
    (_with(evaluator={"checks": [{"type": "command", "argv": ["ls"], "exit_code": "0"}]}),
     "'evaluator.checks[0].exit_code'"),
    (_with(apps="galculator"), "'apps'"),
    (_with(infeasible="yes"), "'infeasible'"),
    (_with(solution="double-click the icon"), "'solution'"),
    (_with(solution=[{"type": "teleport"}]), "'solution[0]'"),   # the server's action schema (actions.py)
    (_with(solution=[{"type": "click", "x": 5}]), "'solution[0]'"),
    (_with(solution=[{"type": "key", "keys": []}]), "'solution[0]'"),
    (_with(solution=[{"type": "done"}, {"type": "key", "keys": ["a"]}]), "'solution[0]'"),  # nothing after an end
    (_with(solution=[{"type": "wait"}] * 11), "'solution'"),  # more actions than max_steps (10)
    (_with(notes=["why"]), "'notes'"),
])
def test_load_tasks_names_file_and_field(tmp_path, task, field):
    f = tmp_path / "broken.json"
    f.write_text(json.dumps(task))
    with pytest.raises(TaskError) as e:
        load_tasks(tmp_path)
    assert str(f) in str(e.value) and field in str(e.value), str(e.value)


def test_load_tasks_file_level_errors(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(GOOD))
    (tmp_path / "b.json").write_text(json.dumps(GOOD))
    with pytest.raises(TaskError, match="duplicate task id 'calc-open'") as e:
        load_tasks(tmp_path)
    assert "b.json" in str(e.value) and "a.json" in str(e.value)
    bad = tmp_path / "c.json"
    bad.write_text('{"id": "x",')
    with pytest.raises(TaskError, match="not valid JSON") as e:
        load_tasks(bad)
    assert str(bad) in str(e.value)
    with pytest.raises(TaskError, match="no such"):
        load_tasks(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TaskError, match="no \\*.json"):
        load_tasks(empty)


def test_shipped_tasks_load():
    # Every task file the repo ships in tasks/ loads (one task a file there), each id once.
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks")
    files = [n for n in os.listdir(root) if n.endswith(".json")]
    ids = [t.id for t in load_tasks(root)]
    assert files and len(ids) == len(set(ids)) == len(files), (files, ids)
