"""OSWorld's own VM-side server (desktop_env/server/main.py of an OSWorld checkout, named by
OSWORLD_SRC) on a local Xvfb + openbox desktop, and two tasks in OSWorld's format that such a plain
desktop can play: the tools of tests/test_osworld_server.py and bench/osworld.py.

Nothing of OSWorld is in this repository: the server runs from the checkout given, in a copy of its
server folder (it writes its screenshots beside itself). What it needs that a plain Debian desktop
lacks: `pyatspi` (the accessibility tree, which this project does not use) gets a stand-in module
whose names exist and do nothing; flask comes from pip. The tasks' texts are this project's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import requests

# Only the names main.py imports at its top; its accessibility routes fail on them, no task here uses them.
PYATSPI = """# A stand-in for pyatspi: OSWorld's server imports it on Linux for the accessibility tree only.
class _Any:
    def __init__(self, *a, **k):
        raise RuntimeError("no accessibility tree on this desktop (pyatspi is a stand-in)")
Accessible = StateType = Action = Component = Text = Value = _Any
STATE_SHOWING = 0
"""

# A feasible task solved through the GUI (type a command into the terminal the setup opened) and
# an infeasible one, in OSWorld's task-file format (id, instruction, config, evaluator).
FEASIBLE = {
    "id": "local-os-mkdir-reports", "snapshot": "os", "related_apps": ["os"], "source": "this project",
    "instruction": "In the open terminal, make a folder named reports in my home folder.",
    "config": [{"type": "launch", "parameters": {"command": ["xterm", "-geometry", "100x30+100+100"]}},
               {"type": "sleep", "parameters": {"seconds": 1}}],
    "evaluator": {"func": "check_include_exclude",
                  "result": {"type": "vm_command_line", "command": "ls ~", "shell": True},
                  "expected": {"type": "rule", "rules": {"include": ["reports"], "exclude": []}}},
}
INFEASIBLE = {
    "id": "local-os-print-photo", "snapshot": "os", "related_apps": ["os"], "source": "this project",
    "instruction": "Print my holiday photo on the office's colour printer.",
    "config": [], "evaluator": {"func": "infeasible"},
}
# The scripted policy's answers per task, in UI-TARS's format, one a step.
SOLUTIONS = {
    FEASIBLE["id"]: ["Thought: The terminal has the focus, I make the folder.\nAction: type(content='mkdir ~/reports\\n')",
                     "Thought: The folder is made.\nAction: finished(content='done')"],
    INFEASIBLE["id"]: ["Thought: There is no printer on this computer.\nAction: call_user()"],
}


def source() -> str | None:
    """The OSWorld checkout OSWORLD_SRC names (its desktop_env/server/main.py must exist), or None."""
    src = os.environ.get("OSWORLD_SRC", "")
    return src if src and os.path.isfile(os.path.join(src, "desktop_env", "server", "main.py")) else None


def write_tasks(root: str) -> str:
    """The two tasks as OSWorld's evaluation_examples: <root>/examples/os/<id>.json and a meta
    file <root>/test_local.json. -> the meta file's path."""
    import json
    os.makedirs(os.path.join(root, "examples", "os"), exist_ok=True)
    for t in (FEASIBLE, INFEASIBLE):
        with open(os.path.join(root, "examples", "os", t["id"] + ".json"), "w") as f:
            json.dump(t, f, indent=1)
    meta = os.path.join(root, "test_local.json")
    with open(meta, "w") as f:
        json.dump({"os": [FEASIBLE["id"], INFEASIBLE["id"]]}, f)
    return meta


@dataclass
class Server:
    url: str
    port: int
    home: str
    procs: list

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(os.path.dirname(self.home), ignore_errors=True)


def start(src: str, port: int, screen=(1280, 720)) -> Server:
    """Xvfb + openbox + OSWorld's server from `src` on 127.0.0.1:port, a HOME of its own."""
    work = tempfile.mkdtemp(prefix="osworld-")
    home, server = os.path.join(work, "home"), os.path.join(work, "server")
    os.makedirs(home)
    shutil.copytree(os.path.join(src, "desktop_env", "server"), server)
    with open(os.path.join(work, "pyatspi.py"), "w") as f:
        f.write(PYATSPI)
    display = f":{200 + port % 700}"
    # XDG_SESSION_TYPE: what a desktop session sets; pyautogui takes screenshots (scrot) only under it
    env = {**os.environ, "DISPLAY": display, "HOME": home, "PYTHONPATH": f"{server}:{work}", "XDG_SESSION_TYPE": "x11"}
    env.pop("XAUTHORITY", None)
    procs = [subprocess.Popen(["Xvfb", display, "-screen", "0", f"{screen[0]}x{screen[1]}x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    s = Server(f"http://127.0.0.1:{port}", port, home, procs)
    try:
        _wait(lambda: subprocess.run(["xdpyinfo"], env=env, capture_output=True).returncode == 0, "Xvfb")
        procs.append(subprocess.Popen(["openbox"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        log = open(os.path.join(work, "server.log"), "w")
        procs.append(subprocess.Popen([sys.executable, "-c", f"from main import app; app.run(host='127.0.0.1', port={port})"],
                                      env=env, cwd=home, stdout=log, stderr=subprocess.STDOUT))
        _wait(lambda: _up(s.url), "OSWorld's server", procs[-1], os.path.join(work, "server.log"))
    except BaseException:
        s.stop()
        raise
    return s


def _up(url: str) -> bool:
    try:
        return requests.post(url + "/screen_size", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def _wait(cond, what: str, proc=None, log: str = "", timeout: float = 30) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.2)
    tail = open(log).read()[-2000:] if log and os.path.exists(log) else ""
    raise RuntimeError(f"{what} did not come up. {tail}")
