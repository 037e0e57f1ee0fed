"""osworld_env.py: OSWorld's own VMs, task files and evaluators as this project's desktops and tasks.

    python train_arpo.py --vms osworld:docker:8 --osworld-tasks evaluation_examples/test_all.json \
        --osworld-examples evaluation_examples/examples            # docs/osworld.md has the rest

Imported only when `--vms osworld:...` or `--osworld-tasks` asks for it. OSWorld's client
(`pip install -r requirements-osworld.txt`: the PyPI package desktop-env, without its pinned
requirements) does the VM work: its providers start and revert the VMs, its setup controller
runs a task's `config` steps, its evaluators score. This file adapts them to what the rest of the
project already speaks, so the stepper (rollout.py), ARPO's episode and its scoring run unchanged:

  1. `expand` / `join`: the `--vms osworld:...` spellings, one entry per VM (torchrun ranks take
     slices of the list, as they do of URLs).
  2. `OSWorldClient`: the interface of env.VMClient (health, screenshot, act, reset, setup,
     evaluate, windows, close) over one OSWorld `DesktopEnv`.
  3. `pyautogui_code`: one of our actions as the pyautogui code OSWorld's server runs, every
     string in it hex-encoded, so no model output ever becomes code.
  4. `load_tasks`: OSWorld's task files as they are (a meta file of ids per domain, one JSON per
     task) -> env.Task, whose setup is the one step {"type": "osworld", "task": <the file>}.

How a step runs on an OSWorld VM, against one of ours: OSWorld's server executes a Python string
(`POST /execute`), ours a checked JSON action; we send the one pyautogui call ours would make
(vm/act.py's, including its `type_text` for text pyautogui cannot type), so the same action does
the same thing on both (tests/test_osworld.py compares them on two real desktops). The settle is
a fixed sleep (ARPO and OSWorld: 0.5 s): the watched settle needs our server's view of the X
server and its processes.

Departures from ARPO's code (verl/trainer/gui_agent.py), each deliberate:
  - An evaluator that raises drops the episode (the environment's fault, as for our own desktops);
    ARPO scores it 0, which trains the policy against a VM fault.
  - A failed reset or setup (OSWorld retries a setup 5 times, then goes on regardless) drops the
    episode; ARPO plays it anyway, on a desktop that is not the task's.
  - Actions are sent to `/execute` directly, once: OSWorld's controller retries a command that
    failed, which repeats a click or a typed text that may already have happened.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import inspect
import json
import os
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from actions import Action
from env import ActResult, Task, TaskError, VMError, decode_image

INSTALL = ("OSWorld's client is not installed: `pip install -r requirements-osworld.txt` "
           "(desktop-env without its pinned requirements; docs/osworld.md)")
# One VM kind per entry: attach takes HOST:PORT of a running OSWorld server; docker a count of
# local containers; vmware/virtualbox a VM file (or name) each; the cloud providers REGION:COUNT.
KINDS = ("attach", "docker", "vmware", "virtualbox", "aws", "azure", "aliyun", "volcengine")
SPEC_HELP = ("--vms osworld:attach:HOST:PORT[,HOST:PORT...] | osworld:docker:N | osworld:vmware:PATH[,PATH...] | "
             "osworld:virtualbox:NAME[,NAME...] | osworld:aws|azure|aliyun|volcengine:REGION:N; several joined by '|'")
SCREEN = (1920, 1080)   # OSWorld's VM images and ARPO's setting
SETTLE = 0.5            # s after each action (ARPO: env.step(action, pause=0.5))
VM_TIMEOUT = 600.0      # s a reset may take: a VM revert or boot, a task's downloads
PORTS = (9222, 8006, 8080)  # what an attached server's DesktopEnv is told: chromium, VNC, VLC


# ------------------------------------------------------------------------------------------------
# 1. --vms osworld:...: one entry per VM


def expand(vms: str) -> list[tuple[str, str]]:
    """`--vms osworld:...` -> [(kind, where)], one per VM: attach (HOST:PORT), docker (""),
    vmware/virtualbox (the VM file or name), a cloud provider (its region). ValueError says what is
    wrong."""
    out = []
    for part in vms.split("|"):
        part = part.strip()
        if not part.startswith("osworld:"):
            raise ValueError(f"{part!r} is not an osworld: spec ({SPEC_HELP})")
        kind, _, rest = part[len("osworld:"):].partition(":")
        if kind not in KINDS or not rest:
            raise ValueError(f"{part!r}: unknown kind or nothing after it ({SPEC_HELP})")
        if kind == "attach":
            for hp in rest.split(","):
                host, _, port = hp.strip().rpartition(":")
                if not host or not port.isdigit() or not 0 < int(port) < 65536:
                    raise ValueError(f"{part!r}: {hp!r} is not HOST:PORT ({SPEC_HELP})")
                out.append((kind, f"{host}:{int(port)}"))
        elif kind == "docker":
            out += [(kind, "")] * _count(rest, part)
        elif kind in ("vmware", "virtualbox"):
            out += [(kind, p.strip()) for p in rest.split(",") if p.strip()]
        else:
            region, _, n = rest.rpartition(":")
            if not region:
                raise ValueError(f"{part!r}: a cloud provider takes REGION:N ({SPEC_HELP})")
            out += [(kind, region)] * _count(n, part)
    return out


def _count(n: str, part: str) -> int:
    if not n.isdigit() or int(n) < 1:
        raise ValueError(f"{part!r}: {n!r} is not a number of VMs ({SPEC_HELP})")
    return int(n)


def join(specs: list[tuple[str, str]]) -> str:
    """The inverse of expand, one VM an entry: what a torchrun rank's slice is passed on as."""
    def one(kind, where):
        if kind == "docker":
            return "osworld:docker:1"
        return f"osworld:{kind}:{where}" + ("" if kind in ("attach", "vmware", "virtualbox") else ":1")
    return "|".join(one(k, w) for k, w in specs)


def require() -> None:
    """Stop with one sentence when OSWorld's client is not importable."""
    try:
        import desktop_env.desktop_env  # noqa: F401
    except ImportError as e:
        if getattr(e, "name", "") and not str(e.name).startswith("desktop_env"):
            raise SystemExit(f"OSWorld's client is installed but cannot import {e.name!r} ({e}); "
                             "`pip install -r requirements-osworld.txt` installs what it needs.") from None
        raise SystemExit(INSTALL + ".") from None


class _Optional(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """easyocr and librosa, which OSWorld's evaluator modules import at their top but only 4 tasks
    use (text in images, audio): without them, a placeholder module that says what to install when
    one of those tasks touches it. easyocr pulls a CUDA torch build over ours, so it stays out of
    requirements-osworld.txt."""
    NAMES = ("easyocr", "librosa")

    def find_spec(self, name, path=None, target=None):
        # Last on sys.meta_path: asked only when no other finder has the module.
        return importlib.machinery.ModuleSpec(name, self) if name in self.NAMES else None

    def create_module(self, spec):
        m = types.ModuleType(spec.name)

        def missing(attr):
            if attr.startswith("__"):  # the import system's own questions (__path__, __file__, ...)
                raise AttributeError(attr)
            raise ImportError(f"an OSWorld evaluator needs {spec.name} ({attr}): `pip install {spec.name}` "
                              f"(easyocr: after it, reinstall the CPU torch; docs/osworld.md)")
        m.__getattr__ = missing
        return m

    def exec_module(self, module):
        pass


if not any(isinstance(f, _Optional) for f in sys.meta_path):
    sys.meta_path.append(_Optional())  # last: a real easyocr or librosa is found first


# ------------------------------------------------------------------------------------------------
# 2. One OSWorld VM with the interface of env.VMClient


class _Attached:
    """OSWorld's provider interface for a server that already runs (`osworld:attach:HOST:PORT`):
    nothing to start, stop or revert; its address is the one given."""

    def __init__(self, where: str):
        self.where = where

    def start_emulator(self, *args, **kwargs):
        pass

    def get_ip_address(self, *args, **kwargs) -> str:  # "host:server:chromium:vnc:vlc"
        return ":".join([self.where, *map(str, PORTS)])

    def revert_to_snapshot(self, *args, **kwargs):
        return None  # no snapshot: the desktop keeps its state (docs/osworld.md)

    def save_state(self, *args, **kwargs):
        pass

    def stop_emulator(self, *args, **kwargs):
        pass


_FACTORY = threading.Lock()  # the provider factory is swapped for attached VMs, one at a time


def make_env(kind: str, where: str, cache_dir: str, screen=SCREEN):
    """One OSWorld DesktopEnv: its own provider starts (or finds) the VM. OSWorld has no hook to
    register a provider, so for attach its factory is swapped while this one env is built
    (DesktopEnv calls it once, in its constructor); "docker" semantics: the VM starts clean and is
    reverted once used."""
    require()
    import desktop_env.desktop_env as de
    kw = dict(action_space="pyautogui", cache_dir=cache_dir, screen_size=tuple(screen), headless=True,
              require_a11y_tree=False, os_type="Ubuntu")
    if kind != "attach":
        vm = where if kind in ("vmware", "virtualbox") else None
        region = where if kind not in ("docker", "vmware", "virtualbox") else None
        return de.DesktopEnv(provider_name=kind, region=region, path_to_vm=vm, **kw)
    with _FACTORY:
        real = de.create_vm_manager_and_provider
        de.create_vm_manager_and_provider = lambda *a, **k: (None, _Attached(where))
        try:
            return de.DesktopEnv(provider_name="docker", path_to_vm=f"attach:{where}", **kw)
        finally:
            de.create_vm_manager_and_provider = real


class OSWorldClient:
    """env.VMClient's calls over one DesktopEnv. reset reverts the VM if it was used (OSWorld's
    rule); setup([{"type": "osworld", "task": <task file>}]) is DesktopEnv.reset(task): its config
    steps; evaluate is DesktopEnv.evaluate (postconfig, then the metric). Screenshots and actions
    go to the server directly, with this client's timeout, once each. Any failure is a VMError:
    status 400 for an action the VM refused (an unknown key), else None (the VM or its program)."""

    def __init__(self, kind: str, where: str, cache_dir: str = "cache", screen=SCREEN, timeout: float = VM_TIMEOUT):
        self.kind, self.timeout = kind, timeout
        self.env = make_env(kind, where, cache_dir, screen)
        self.url = self.env.controller.http_server  # "http://ip:port", what errors and metrics name
        self.session = requests.Session()

    def _http(self, method: str, path: str, timeout: float | None = None, **kw) -> requests.Response:
        try:
            r = self.session.request(method, self.url + path, timeout=timeout or self.timeout, **kw)
        except requests.RequestException as e:
            raise VMError(f"{self.url}{path}: no answer ({type(e).__name__}); is OSWorld's server running there?") from None
        if r.status_code != 200:
            raise VMError(f"{self.url}{path} answered {r.status_code}: {r.text[:200]}")
        return r

    def health(self, timeout: float | None = None) -> dict:
        size = self._http("POST", "/screen_size", timeout).json()
        return {"ok": True, "screen": [int(size["width"]), int(size["height"])], "osworld": self.kind}

    def screenshot(self, format: str = "png", quality: int = 90, timeout: float | None = None):
        r = self._http("GET", "/screenshot", timeout)
        try:
            return decode_image(r.content)
        except Exception as e:  # noqa: BLE001 -- PIL raises several types for a bad image
            raise VMError(f"{self.url}/screenshot returned an image that does not decode ({e}).") from None

    def windows(self, timeout: float | None = None) -> list[dict]:
        raise VMError("OSWorld's server does not list windows (the project's /windows).", status=501)

    def act(self, action, settle=None, screenshot=False, timeout: float | None = None, quality: int = 90):
        """Run one action as pyautogui code on the VM, sleep `settle` seconds, and answer as
        VMClient.act does. A wait sleeps here; done and fail run nothing."""
        a = action if isinstance(action, Action) else Action.from_dict(action)
        if settle == "watch":
            raise ValueError("OSWorld's VMs take a fixed settle (--settle 0.5), not watch.")
        t0 = time.monotonic()
        if a.type == "wait":
            time.sleep(a.amount if a.amount is not None else 1)
        elif a.type not in ("done", "fail"):
            cmd = ["python", "-c", PREFIX + pyautogui_code(a)]
            out = self._http("POST", "/execute", timeout, json={"command": cmd, "shell": False}).json()
            if out.get("returncode") == REFUSED:
                raise VMError(f"{self.url}: the VM refused the action ({out.get('error', '').strip()[-200:]})", status=400)
            if out.get("returncode") != 0:
                raise VMError(f"{self.url}: the action's code failed ({str(out.get('error') or out)[-300:]})")
        if settle:
            time.sleep(float(settle))
        info = {"seconds": round(time.monotonic() - t0, 3), "until": "fixed" if settle else "none", "first_change": None}
        if not screenshot:
            return {"ok": True, "settle": info}
        return ActResult(self.screenshot(timeout=timeout), info)

    def reset(self, timeout: float | None = None) -> dict:
        """Revert the VM if it was used since its last revert (OSWorld's rule; an attached server
        is never reverted). The task's own setup comes with setup()."""
        try:
            self.env.reset(None)
        except Exception as e:  # noqa: BLE001 -- the provider's own failure: the episode is dropped
            raise VMError(f"{self.url}: OSWorld's reset failed ({type(e).__name__}: {e})") from None
        return {"ok": True}

    def setup(self, steps: list[dict], timeout: float | None = None) -> dict:
        if not steps:
            return {"ok": True, "results": []}
        if len(steps) != 1 or steps[0].get("type") != "osworld":
            raise VMError("an OSWorld VM runs OSWorld tasks only (setup [{'type': 'osworld', 'task': ...}]).", status=400)
        task = steps[0]["task"]
        try:
            self.env.reset(task)
        except Exception as e:  # noqa: BLE001 -- a setup step that raised (a download, a launch)
            raise VMError(f"{self.url}: OSWorld's setup of {task.get('id')} raised {type(e).__name__}: {e}") from None
        # DesktopEnv.reset tries a failing setup 5 times, then goes on; only a setup that succeeded
        # (and had steps) marks the VM used.
        if task.get("config") and not self.env.is_environment_used:
            raise VMError(f"{self.url}: OSWorld's setup of task {task.get('id')} failed (after its own retries).")
        return {"ok": True, "results": []}

    def evaluate(self, evaluator: dict, timeout: float | None = None) -> dict:
        """DesktopEnv.evaluate on the task setup() ran: {"score": float}. An evaluator that raises is
        the environment's fault (a departure: ARPO scores it 0)."""
        try:
            score = self.env.evaluate()
        except Exception as e:  # noqa: BLE001 -- any evaluator failure drops the episode, never scores it
            raise VMError(f"{self.url}: OSWorld's evaluator raised {type(e).__name__}: {e}") from None
        return {"score": float(score), "checks": []}

    def close(self) -> None:
        try:
            self.env.close()  # the provider stops its VM (an attached server is left running)
        except Exception as e:  # noqa: BLE001 -- closing is best effort, at the end of a run
            print(f"{self.url}: OSWorld's close failed ({e})", file=sys.stderr)


def open_clients(vms: str, cache_dir: str, screen=SCREEN, timeout: float = VM_TIMEOUT) -> list[OSWorldClient]:
    """One client per VM of `vms`, their VMs started in parallel (a boot takes minutes). If one
    cannot start, the ones that did are closed (a container or cloud VM is not left running) and
    its error is raised."""
    specs = expand(vms)
    require()
    with ThreadPoolExecutor(max_workers=min(16, len(specs))) as ex:
        futures = [ex.submit(OSWorldClient, k, w, os.path.join(cache_dir, f"vm{i}"), screen, timeout)
                   for i, (k, w) in enumerate(specs)]
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        for f in futures:
            if f.exception() is None:
                f.result().close()
        raise failed[0]
    return [f.result() for f in futures]


# ------------------------------------------------------------------------------------------------
# 3. Our actions as pyautogui code for OSWorld's server

REFUSED = 3  # the exit code of an action the VM cannot do (a key it does not know): the model's fault
PREFIX = "import pyautogui, re, sys, time; pyautogui.FAILSAFE = False\n"  # OSWorld's controller sets FAILSAFE off too


def _text(s: str) -> str:
    """A string as code that cannot be anything but that string: hex of its UTF-8 bytes."""
    return f"bytes.fromhex('{s.encode('utf-8').hex()}').decode('utf-8')"


@functools.cache  # read once: every typed text sends it
def _type_text_source() -> str:
    from vm import act
    return inspect.getsource(act.type_text)


def pyautogui_code(a: Action) -> str:
    """The pyautogui code that does what vm/act.py's do_action does for this action. Numbers are
    ints (Action's schema), strings hex-encoded: nothing of the model's text is ever code."""
    at = f"{int(a.x)}, {int(a.y)}" if a.x is not None else ""
    if a.type == "move":
        return f"pyautogui.moveTo({at})"
    if a.type in ("click", "double_click", "right_click"):
        return (f"pyautogui.click({at + ', ' if at else ''}clicks={2 if a.type == 'double_click' else 1}, "
                f"interval=0.05, button='{'right' if a.type == 'right_click' else 'left'}')")
    if a.type == "drag":
        return (f"pyautogui.moveTo({at}); pyautogui.mouseDown(); "
                f"pyautogui.moveTo({int(a.x2)}, {int(a.y2)}, duration=0.3); pyautogui.mouseUp()")
    if a.type == "scroll":
        n = int(a.amount if a.amount is not None else 5)
        move = f"pyautogui.moveTo({at}); " if at else ""
        if a.direction in ("up", "down"):
            return move + f"pyautogui.scroll({n if a.direction == 'up' else -n})"
        return move + f"pyautogui.hscroll({n if a.direction == 'right' else -n})"
    if a.type == "type":
        click = f"pyautogui.click({at})\n" if at else ""
        return _type_text_source() + "\n" + click + f"type_text({_text(a.text)})"
    if a.type == "key":
        keys = "[" + ", ".join(_text(k) for k in a.keys) + "]"
        return (f"keys = {keys}\nbad = [k for k in keys if k not in pyautogui.KEYBOARD_KEYS]\n"
                f"if bad:\n    print('unknown key name(s) %r' % bad, file=sys.stderr)\n    sys.exit({REFUSED})\n"
                "pyautogui.hotkey(*keys)")
    raise ValueError(f"no pyautogui code for a {a.type!r} action")


# ------------------------------------------------------------------------------------------------
# 4. OSWorld's task files


def load_tasks(meta: str, examples: str = "", ids: list[str] | None = None) -> list[Task]:
    """OSWorld's task files as env.Task: `meta` a JSON of {domain: [task id, ...]} (OSWorld's
    test_all.json, ARPO's 128-task list, a user's own), each task read from
    `examples`/<domain>/<id>.json (default: the meta file's folder's `examples/`). `ids` keeps
    those. The task's evaluator stays OSWorld's (its VM evaluates it); an evaluator func
    "infeasible" marks the task infeasible (scored by the client: 1 if the agent gave up)."""
    meta_path = Path(meta)
    try:
        listing = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TaskError(f"{meta}: cannot read OSWorld's task list ({e}).") from None
    if not isinstance(listing, dict) or not all(isinstance(v, list) for v in listing.values()):
        raise TaskError(f"{meta}: an OSWorld task list is {{domain: [task id, ...]}}.")
    root = Path(examples) if examples else meta_path.parent / "examples"
    want = set(ids or [])
    tasks = []
    for domain, task_ids in listing.items():
        for tid in task_ids:
            if want and tid not in want:
                continue
            f = root / domain / f"{tid}.json"
            try:
                d = json.loads(f.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TaskError(f"{f}: cannot read the task ({e}); check --osworld-examples.") from None
            for k in ("id", "instruction", "evaluator"):
                if k not in d:
                    raise TaskError(f"{f}: field '{k}' is missing; is this an OSWorld task file?")
            func = d["evaluator"].get("func")
            tasks.append(Task(d["id"], d["instruction"], [{"type": "osworld", "task": d}],
                              {"osworld": func}, 15, func == "infeasible", tuple(d.get("related_apps", [])),
                              domain=domain))
    missing = want - {t.id for t in tasks}
    if missing:
        raise TaskError(f"{meta}: no task with id {sorted(missing)}.")
    if not tasks:
        raise TaskError(f"{meta}: lists no task.")
    return tasks
