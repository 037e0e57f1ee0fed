"""Task-file rules (vm/tasks.py) under attack: what a task file alone could once turn into code.

Run: python -m pytest -q tests/test_task_rules.py      (~20 s; loopback only)

Every attack goes as /setup steps or /evaluate checks to a real `vm_server.py --xvfb` on loopback
(the session's shared desktop, see conftest.py), and must get a 4xx JSON error. Then nothing may
have happened: HOME is byte-for-byte what it was (a snapshot before and after, so no file was
made, changed or truncated), the folder outside HOME that every payload writes into is still
empty, no new process runs under the server, the mouse has not moved. The routes closed here:
  1. xdotool: its command names ignore case (`Exec`, `KEY`) and it runs every command in its argv;
  2. launchers: a `.desktop` file (or a file whose content is one) runs its Exec= line when the
     file manager opens it, and Desktop/ holds the agent's icons;
  3. X resource files: ~/XTerm & co. are read by Xt apps, and xterm's translations type commands;
  4. `date MMDDhhmm` sets the clock, `date -d 'TZ="/any/file"'` opens any file;
  5. lone surrogates and odd shapes: a 500 after earlier steps ran, a truncated target;
  6. HOME quota and time budget: `cp -r` doubling HOME, 64 steps of 120 s.
The fixture plays the agent where an attack needs something only the agent could make (a
launcher in Documents/, a symlink into Desktop/): the task file must not be able to use it.
Each `*_attacks` function returns its requests; N_ATTACKS counts them all.
"""
from __future__ import annotations

import json
import os
import random
import threading
import time
import types

import pytest

from vm import rules as vm_rules
from vm import tasks as vm_tasks
from conftest import ROOT, vm_call
from test_hostile_input import armed, home_snapshot, processes_under  # noqa: F401 (armed: a fixture)
from conftest import mouse

def setup(*steps) -> tuple[str, dict]:
    return "/setup", {"steps": list(steps)}


def command(*argv, **kw) -> dict:
    return {"type": "command", "argv": list(argv), "timeout": 5, **kw}


def as_every_kind(argv: list[str]) -> list[tuple[str, dict]]:
    """argv as a setup command, a launched program and an evaluator check."""
    return [setup(command(*argv)), setup({"type": "launch", "argv": argv}),
            ("/evaluate", {"checks": [command(*argv)]})]


def refused_here(argv: list[str]) -> bool:
    """vm_tasks' rules refuse argv, judged in this process without running anything: a clock
    attack is only sent once this holds, so a broken rule fails the test instead of setting the
    clock of the machine running it."""
    desk = types.SimpleNamespace(home=ROOT, allow=vm_rules.DEFAULT_ALLOW, env=dict(os.environ))
    try:
        vm_rules.check_args(desk, argv)
    except vm_rules.BadRequest:
        return True
    return False


# ------------------------------------------------------------------------------------------------
# The attacks, by route


def xdotool_attacks(pwn: str) -> list[tuple[str, dict]]:
    touch = ["touch", pwn]
    argvs = [["xdotool", "getmouselocation", "Exec", "--sync", "touch", pwn]]  # the one found
    argvs += [["xdotool", "getmouselocation", name, *touch] for name in ("exec", "EXEC", "eXeC", "Exec")]
    argvs += [["xdotool", "search", "--name", "x", name, "a"] for name in ("Type", "TYPE", "KEY", "Key", "keydown",
                                                                           "Click", "MouseMove", "Behave", "set_window")]
    argvs += [
        ["xdotool", "Behave", "%1", "focus", "exec", *touch], ["xdotool", "BEHAVE_SCREEN_EDGE", "left", "exec", *touch],
        ["xdotool", "search", "--name", "x", "exec", *touch], ["xdotool", "search", "--sync", "--name", "x", "windowactivate",
                                                                "--sync", "Exec", *touch],
        ["xdotool", "Search", "--name", "xterm", "KEY", "ctrl+alt+t"], ["xdotool", "getwindowgeometry", "%1", "type", "x"],
        ["xdotool", "windowmove", "%1", "1", "2", "Exec", *touch], ["xdotool", "sleep", "1", "exec", *touch],
        ["xdotool", "search", "--name", "x", ";", "exec", *touch], ["xdotool", "search", "--name", "x", "--", "exec", *touch],
        ["xdotool", "search", "--name", "x", "getwindowgeometry"],  # a chain of two harmless ones: still two
        ["xdotool", "search", "--name=x", "y"], ["xdotool", "search", "--sy", "--name", "x"], ["xdotool", "search", "-name", "x"],
        ["xdotool", "search", "--name"], ["xdotool", "search", "--pid", "1;exec", "x"], ["xdotool", "getmouselocation", "--prefix", "x"],
        ["xdotool", "windowmove", "1", "2", "3", "4"], ["xdotool", "windowactivate", "exec"], ["xdotool", "sleep", "1e9"],
        ["xdotool", "-", "exec"], ["xdotool", "--version"], ["xdotool", "cmds.xdo"], ["xdotool"],
        ["xterm", "-e", "xdotool", "getmouselocation", "Exec", *touch], ["xterm", "-hold", "-e", "xdotool", "KEY", "a"],
    ]
    reqs = [r for argv in argvs for r in as_every_kind(argv)]
    # a script file made in the same request: xdotool runs a file named as its first argument
    reqs.append(setup({"type": "write_file", "path": "cmds.xdo", "content": f"exec touch {pwn}\n"}, command("xdotool", "cmds.xdo")))
    return reqs


LAUNCHER = "[Desktop Entry]\nType=Application\nName=x\nExec=touch {pwn}\n"


def launcher_attacks(pwn: str) -> list[tuple[str, dict]]:
    entry = LAUNCHER.format(pwn=pwn)
    names = ["Documents/x.desktop", "X.DESKTOP", "x.Desktop", "x.desktop ", "x.desktop.", "x.desktop~", "x.kdelnk",
             "Documents/a.b.DESKTOP", "Desktop/terminal.desktop", "Desktop/new.txt", "Desktop/x", "~/Desktop/editor.desktop",
             "Documents/../Desktop/files.desktop", "link.txt", "Documents/dangling.txt"]
    reqs = [setup({"type": "write_file", "path": p, "content": entry}) for p in names]
    reqs += [setup({"type": "write_file", "path": p, "content": "harmless"}) for p in names]
    # content makes a launcher when the name says nothing certain (no or an unknown extension)
    for p, content in [("Documents/launcher", entry), ("Documents/x.foo", entry), ("x", "# c\n" + entry),
                       ("y", entry.lower()), ("z", "[KDE Desktop Entry]\nExec=touch " + pwn), ("w", "[Desktop Action a]\n")]:
        reqs.append(setup({"type": "write_file", "path": p, "content": content}))
    for argv in (["cp", "notes.txt", "Documents/x.desktop"], ["cp", "notes.txt", "X.DESKTOP "], ["cp", "-r", "Documents", "y.desktop"],
                 ["cp", "-r", ".", "backup"], ["cp", "-r", "Desktop", "backup"], ["cp", "-rT", "Desktop", "Documents/d"],
                 ["cp", "-r", "src", "dst"], ["cp", "-rT", "src", "Documents"], ["mv", "src", "dst"], ["mv", "notes.txt", "x.DESKTOP"],
                 ["mv", "Documents/todo.txt", "Desktop"], ["mv", "Desktop", "Old"], ["cp", "notes.txt", "Desktop/terminal.desktop"],
                 ["cp", "link.txt", "l2.txt"], ["touch", "x.desktop"], ["mkdir", "-p", "y.desktop/z"], ["sort", "-o", "z.desktop", "notes.txt"],
                 ["uniq", "notes.txt", "u.desktop"], ["cp", "notes.txt", "."], ["cp", "-rT", "Documents", "."],
                 ["pcmanfm", "Documents/evil.desktop"], ["pcmanfm", "Documents/launcher"], ["pcmanfm", "notes.txt"],
                 ["mousepad", "Documents/evil.desktop"], ["mousepad", "Desktop/terminal.desktop"], ["ls", "Desktop"]):
        reqs += as_every_kind(argv)
    for p in ("Desktop/terminal.desktop", "Documents/evil.desktop", "Desktop", "link.txt", "Documents/evil.DESKTOP"):
        reqs.append(setup({"type": "open", "path": p}))
    # the write comes first, then the launch: refused as a whole
    reqs.append(setup({"type": "write_file", "path": "Documents/l2", "content": entry}, {"type": "launch", "argv": ["pcmanfm", "Documents/l2"]}))
    return reqs


def xt_attacks(pwn: str) -> list[tuple[str, dict]]:
    # xterm's translations type a command into its shell the moment its window maps
    res = f"XTerm*VT100.translations: #override <Map>: string(\"touch {pwn}\\n\")\n*title: pwned\n"
    names = ["XTerm", "xterm", "XTERM", "XTerm-color", "UXTerm", "KOI8RXTerm", "XCalc", "XClock", "XEyes", "XClock-color",
             "C/XTerm", "C.UTF-8/XTerm", "en_US/XCalc", "Documents/../XTerm", "~/XTerm", ".Xdefaults", ".Xresources",
             ".Xdefaults-localhost", "Documents/xterm-notes.txt"]
    reqs = [setup({"type": "write_file", "path": p, "content": res}, {"type": "launch", "argv": ["xterm"]}) for p in names]
    for argv in (["touch", "XTerm"], ["mkdir", "-p", "C/XTerm"], ["cp", "notes.txt", "XTerm"], ["mv", "notes.txt", "XCalc"],
                 ["cp", "notes.txt", "Documents/XClock"], ["sort", "-o", "XEyes", "notes.txt"], ["uniq", "notes.txt", "XTerm"],
                 ["cp", "-r", "xtsrc", "C"], ["touch", ".Xresources"], ["mousepad", "XTerm"]):
        reqs += as_every_kind(argv)
    return reqs


CLOCK_ARGVS = [["date", "010100002030"], ["date", "0101000030"], ["date", "12312359"], ["date", "+%s", "010100002030"],
               ["date", "-u", "010100002030"], ["date", "-s", "2030-01-01"], ["date", "--set=2030-01-01"], ["date", "-us", "2030-01-01"]]


def date_attacks(pwn: str) -> list[tuple[str, dict]]:
    argvs = CLOCK_ARGVS + [
        ["date", "-d", 'TZ="/etc/shadow" now'], ["date", "-d", 'tz="/etc/shadow"'], ["date", "-d", ' TZ="/etc/shadow" now'],
        ["date", "-d", 'TZ="Europe/../../../../etc/shadow" now'], ["date", "-ud", 'TZ="/etc/shadow"'],
        ["date", '--date=TZ="/etc/shadow" now'], ["date", "-f", "/etc/shadow"], ["date", "--file=/etc/shadow"],
        ["date", "-r", "/etc/shadow"], ["date", "--reference=/etc/shadow"], ["date", "-d"], ["date", "-d", "x", "-d", "y"],
        ["date", "+%Y", "+%m"], ["date", "--", "010100002030"], ["date", "-Iseconds"], ["date", "--rfc-3339=ns"],
    ]
    return [r for argv in argvs for r in as_every_kind(argv)]


def whole_request_attacks(pwn: str) -> list[tuple[str, dict]]:
    ok = {"type": "write_file", "path": "first.txt", "content": "ran"}
    reqs = [setup(ok, {"type": "write_file", "path": "notes.txt", "content": s}) for s in ("\ud800", "a\udfffb", "\udc80")]
    reqs += [setup(ok, {"type": "write_file", "path": p, "content": "x"}) for p in ("a\ud800.txt", "\udc80", "Documents/\udcff",
                                                                                  "notes.txt/x.txt", "x" * 300 + "/y.txt")]
    reqs += [setup(ok, {"type": "open", "path": "\ud800"}), setup(ok, command("cat", "\ud800")),
             setup(ok, command("echo", "\udc80")), setup(ok, {"type": "launch", "argv": ["xterm", "-T", "\ud800"]}),
             setup(ok, {"type": "sleep", "seconds": 0, "\ud800": 1}), setup(ok, {"type": "write_file\ud800", "path": "a"})]
    reqs += [("/evaluate", {"checks": [c]}) for c in (
        {"type": "file_exists", "path": "\ud800"}, {"type": "file_contains", "path": "notes.txt", "text": "\ud800"},
        {"type": "file_contains", "path": "notes.txt", "regex": "\ud800"}, {"type": "window_exists", "title": "\udc80"},
        command("echo", "x", stdout="\ud800"), command("grep", "\ud800", "notes.txt"))]
    reqs.append(("/evaluate", {"checks": [{"type": "file_exists", "path": "notes.txt"}], "conj": "\ud800"}))
    # a valid step, then an invalid one: the valid one must not run either
    reqs += [setup(ok, bad) for bad in ({"type": "write_file", "path": "x.txt"}, {"type": "sleep", "seconds": 31},
                                        command("rm", "x"), {"type": "open", "path": "/etc"}, 7, [ok], {"type": "nope"})]
    # steps each valid alone, but an earlier one puts a file where a later one needs a folder
    w = lambda p: {"type": "write_file", "path": p, "content": "x"}  # noqa: E731
    reqs += [setup(ok, *steps) for steps in (
        [w("a.txt"), w("a.txt/b.txt")], [w("d/e.txt"), w("d")], [command("mkdir", "x.txt"), w("x.txt")],
        [command("touch", "d"), {"type": "launch", "argv": ["pcmanfm", "d"]}], [command("cp", "notes.txt", "n2"), w("n2/x.txt")],
        [command("sort", "-o", "s", "notes.txt"), w("s/x.txt")], [command("mv", "Documents/todo.txt", "m"), w("m/x.txt")])]
    return reqs


def quota_attacks(pwn: str) -> list[tuple[str, dict]]:
    # Fibonacci growth: a = 0.9 MiB; cp -r a b, cp -r b a, ...: 10 steps would reach ~130 MiB
    grow = [command("cp", "-r", *(("a", "b") if k % 2 == 0 else ("b", "a"))) for k in range(10)]
    big = {"type": "write_file", "path": "a/f.txt", "content": "x" * 900_000}
    return [setup(big, *grow), ("/evaluate", {"checks": [command("cp", "-r", "Documents", "a")] + grow}),
            setup(*[command("sleep", "120", timeout=120)] * 64), setup(*[{"type": "sleep", "seconds": 30}] * 64),
            setup(command("sleep", "1", timeout=120), {"type": "sleep", "seconds": 0.5}),
            setup(*[{"type": "command", "argv": ["true"]}] * 5)]  # 5 x the default 30 s


ROUTES = {"xdotool": xdotool_attacks, "launcher": launcher_attacks, "xt": xt_attacks, "date": date_attacks,
          "whole": whole_request_attacks, "quota": quota_attacks}
N_ATTACKS = sum(len(f("/x/pwned")) for f in ROUTES.values())


# ------------------------------------------------------------------------------------------------
# Sending them, and proving nothing happened


@pytest.fixture(scope="module")
def agent_traps(vm_desktop, tmp_path_factory):
    """The shared desktop, reset once for the attack tests of this module (each one snapshots HOME
    itself), with what only the agent could have made planted in HOME: a launcher in Documents/
    (by name and by content), a folder holding one, a symlink into Desktop/, a dangling link to a
    launcher name, a folder holding an X resource file."""
    vm = vm_desktop
    assert vm_call(vm, "POST", "/reset").status_code == 200
    outside = str(tmp_path_factory.mktemp("outside"))
    home, entry = vm.home, LAUNCHER.format(pwn=os.path.join(outside, "pwned-by-agent-trap"))
    for rel, text in [("Documents/evil.desktop", entry), ("Documents/launcher", entry), ("src/a.desktop", entry),
                      ("src/ok.txt", "ok"), ("xtsrc/XTerm", "*title: pwned\n")]:
        os.makedirs(os.path.dirname(os.path.join(home, rel)), exist_ok=True)
        with open(os.path.join(home, rel), "w") as f:
            f.write(text)
    os.symlink(os.path.join(home, "Desktop", "terminal.desktop"), os.path.join(home, "link.txt"))
    os.symlink("../evil.desktop", os.path.join(home, "Documents", "dangling.txt"))
    assert vm_call(vm, "POST", "/action", {"type": "move", "x": 321, "y": 123}).status_code == 200
    time.sleep(1.0)  # let the freshly reset desktop settle (pcmanfm writes its config once)
    yield vm, outside
    vm_call(vm, "POST", "/reset")


def send_all(vm, reqs: list[tuple[str, dict]], outside: str) -> None:
    """Send every request; each must get a 4xx JSON error; then nothing may have happened."""
    home0, procs0, mouse0 = home_snapshot(vm.home), processes_under(vm.proc.pid), mouse(vm)
    failures = []
    for path, body in reqs:
        r = vm_call(vm, "POST", path, body, timeout=60)
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            err = None
        if not (400 <= r.status_code < 500 and isinstance(err, str) and err.endswith(".")):
            failures.append((path, json.dumps(body)[:160], r.status_code, r.text[:160]))
    time.sleep(1.5)  # what a launched app or an xterm would have done by now
    assert not failures, f"{len(failures)} of {len(reqs)} not refused with a 4xx JSON error: {failures[:8]}"
    assert os.listdir(outside) == []
    assert home_snapshot(vm.home) == home0
    assert processes_under(vm.proc.pid) - procs0 == set()
    assert mouse(vm) == mouse0
    print(f"{len(reqs)} attacks sent, {len(reqs)} refused, 0 side effects")


def test_xdotool_runs_exactly_one_window_command(agent_traps):
    vm, outside = agent_traps
    send_all(vm, xdotool_attacks(os.path.join(outside, "pwned")), outside)
    # the commands the task suite uses still run, in any case
    r = vm_call(vm, "POST", "/evaluate", {"checks": [
        command("xdotool", "getdisplaygeometry", stdout="1280 720"), command("xdotool", "GetDisplayGeometry", stdout="1280 720"),
        command("xdotool", "search", "--onlyvisible", "--name", "^no such window$", exit_code=1), command("xdotool", "sleep", "0.1")]})
    assert r.status_code == 200 and r.json()["score"] == 1.0, r.text


def test_no_launcher_is_made_opened_or_touched_in_desktop(agent_traps):
    vm, outside = agent_traps
    desktop = {p: open(os.path.join(vm.home, "Desktop", p)).read() for p in os.listdir(os.path.join(vm.home, "Desktop"))}
    send_all(vm, launcher_attacks(os.path.join(outside, "pwned")), outside)
    assert {p: open(os.path.join(vm.home, "Desktop", p)).read() for p in os.listdir(os.path.join(vm.home, "Desktop"))} == desktop
    # a text file may still say "desktop", and pcmanfm still opens folders
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "Documents/desktops.txt", "content": "my desktop"},
                                                 {"type": "launch", "argv": ["pcmanfm", "Documents"]}]})
    assert r.status_code == 200, r.text


def test_no_x_resource_file_is_made(agent_traps):
    vm, outside = agent_traps
    send_all(vm, xt_attacks(os.path.join(outside, "pwned")), outside)
    made = sorted(os.path.relpath(os.path.join(d, n), vm.home) for d, _, files in os.walk(vm.home) for n in files
                  if n.lower().startswith(vm_rules.XT_CLASSES))
    assert made == ["Desktop/xcalc.desktop", "xtsrc/XTerm"]  # the template's icon and the agent's file, nothing else


def test_date_only_prints(agent_traps):
    vm, outside = agent_traps
    for argv in CLOCK_ARGVS:  # never sent unless refused here first (see refused_here)
        assert refused_here(argv), argv
    wall, mono = time.time(), time.monotonic()
    send_all(vm, date_attacks(os.path.join(outside, "pwned")), outside)
    assert abs((time.time() - wall) - (time.monotonic() - mono)) < 5  # the clock did not jump
    r = vm_call(vm, "POST", "/evaluate", {"checks": [command("date", "+%Y", regex=r"^\d{4}$"),
                                                     command("date", "-u", "-d", "2024-02-29 12:00", "+%F %H", stdout="2024-02-29 12"),
                                                     command("date", "-d", "@0", "-u", "-R", stdout="1970")]})
    assert r.status_code == 200 and r.json()["score"] == 1.0, r.text


def test_a_request_is_refused_whole_never_half_run_or_500(agent_traps):
    vm, outside = agent_traps
    before = open(os.path.join(vm.home, "notes.txt")).read()
    send_all(vm, whole_request_attacks(os.path.join(outside, "pwned")), outside)
    assert open(os.path.join(vm.home, "notes.txt")).read() == before  # not truncated
    assert not os.path.exists(os.path.join(vm.home, "first.txt"))    # the valid first step did not run


def test_home_quota_and_time_budget_are_checked_before_anything_runs(agent_traps):
    vm, outside = agent_traps
    t = time.monotonic()
    send_all(vm, quota_attacks(os.path.join(outside, "pwned")), outside)
    assert time.monotonic() - t < 60  # refused up front: no command ran to its 120 s


def test_request_shapes_never_get_a_500(armed):
    """Random wrong types and nesting in every field of valid steps and checks: answers are 200 or
    a 4xx JSON error, never a 500 (the server keeps serving)."""
    vm, _ = armed
    rng = random.Random(11)

    def junk(depth=0):
        kinds = [None, True, 0, -1, 2**70, 1.5, float("1e308"), "", "x", "\ud800", "a\udc80", "../..", "Desktop/x.desktop",
                 "XTerm", "notes.txt/x.txt", "x" * 300 + "/y.txt"]
        if depth < 3:
            kinds += [[junk(depth + 1) for _ in range(rng.randrange(3))], {str(rng.randrange(9)): junk(depth + 1)}]
        return rng.choice(kinds)
    steps = [{"type": "write_file", "path": "fuzz.txt", "content": "x"}, {"type": "sleep", "seconds": 0},
             command("true"), {"type": "open", "path": "Documents"}, {"type": "launch", "argv": ["xclock"]}]
    checks = [{"type": "file_exists", "path": "x"}, {"type": "file_contains", "path": "notes.txt", "text": "x"},
              {"type": "window_exists", "title": "x"}, command("true")]
    bad = []
    for _ in range(150):
        items = steps if rng.random() < 0.5 else checks
        item = dict(rng.choice(items))
        for key in rng.sample(sorted(item), 1 if rng.random() < 0.6 else rng.randrange(1, len(item) + 1)):
            item[key] = junk()
        if rng.random() < 0.2:
            item[rng.choice(["argv", "path", "x"])] = junk()
        body = {"steps": [item]} if items is steps else {"checks": [item], "conj": rng.choice(["and", "or", junk()])}
        if rng.random() < 0.2:
            body = rng.choice([[body], {"steps": body}, {"checks": [[item]]}, junk()])
        r = vm_call(vm, "POST", "/setup" if items is steps else "/evaluate", body)
        if r.status_code >= 500 or (r.status_code != 200 and not r.json().get("error", "").endswith(".")):
            bad.append((json.dumps(body)[:200], r.status_code, r.text[:200]))
    assert not bad, bad[:5]
    assert vm_call(vm, "GET", "/health").status_code == 200


def test_home_grown_from_outside_the_request_stops_it_at_the_step(armed):
    """HOME past its quota before the request (the agent filled it): a writing step is refused up
    front. Grown past it DURING a request (the agent's background process): the next writing step
    is refused when it comes to run, and the error says which steps ran."""
    vm, _ = armed
    big = os.path.join(vm.home, "Downloads", "big.bin")
    with open(big, "wb") as f:
        f.truncate(vm_rules.HOME_QUOTA)  # sparse, but its size counts
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "a.txt", "content": "x"}]})
    assert r.status_code == 413 and "quota" in r.json()["error"] and not os.path.exists(os.path.join(vm.home, "a.txt")), r.text
    os.unlink(big)

    def fill():
        with open(big, "wb") as f:
            f.truncate(vm_rules.HOME_QUOTA)
    filler = threading.Timer(0.3, fill)
    filler.start()
    r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "write_file", "path": "a.txt", "content": "x"},
                                                 {"type": "sleep", "seconds": 1}, {"type": "write_file", "path": "b.txt", "content": "x"}]})
    filler.join()
    assert r.status_code == 413 and "steps 1-2 ran" in r.json()["error"], r.text
    assert os.path.exists(os.path.join(vm.home, "a.txt")) and not os.path.exists(os.path.join(vm.home, "b.txt"))


# ------------------------------------------------------------------------------------------------
# The formulas, with hand-computed numbers (no desktop needed)


def fake_desk(tmp_path):
    return types.SimpleNamespace(home=str(tmp_path), allow=vm_rules.DEFAULT_ALLOW, env=dict(os.environ))


def test_usage_counts_bytes_plus_one_entry_cost_each(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a").write_text("x" * 10)
    (tmp_path / "b").write_text("y" * 20)
    os.symlink("/etc/passwd", tmp_path / "l")  # not followed: an entry, no bytes
    e = vm_rules.ENTRY_BYTES
    # entries: tmp_path, d, d/a, b, l = 5; bytes 10 + 20
    assert vm_tasks.usage(str(tmp_path)) == 5 * e + 30
    assert vm_tasks.usage(str(tmp_path / "d")) == 2 * e + 10
    assert vm_tasks.usage(str(tmp_path), limit=e) <= 2 * e + 20  # stops early once past the limit


def test_plan_predicts_the_worst_case_of_each_step(tmp_path, monkeypatch):
    desk, e = fake_desk(tmp_path), vm_rules.ENTRY_BYTES
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f").write_text("x" * 1000)  # usage(a) = 2e + 1000
    s = 2 * e + 1000
    cp = {"type": "command", "argv": ["cp", "-r", "a", "b"], "timeout": 1}
    assert vm_tasks._growth(desk, cp, 0) == (s + e, 0)                # its source, plus one entry
    assert vm_tasks._growth(desk, cp, 7) == (s + 7 + e, 0)            # plus whatever earlier steps added
    assert vm_tasks._growth(desk, {"type": "command", "argv": ["mv", "a", "c"]}, 5) == (0, s)
    assert vm_tasks._growth(desk, {"type": "command", "argv": ["mkdir", "-p", "x/y/z"]}, 0) == (3 * e, 0)
    assert vm_tasks._growth(desk, {"type": "write_file", "path": str(tmp_path / "n" / "t.txt"), "content": "héllo"}, 0) == (6 + 2 * e, 0)
    assert vm_tasks._growth(desk, {"type": "command", "argv": ["cat", "a/f"]}, 99) == (0, 0)
    # HOME = root + a + a/f = 3e + 1000. Steps cp a b, cp b a: growth s+e, then 0 + (s+e) + e.
    home = 3 * e + 1000
    monkeypatch.setattr(vm_tasks, "HOME_QUOTA", home + (s + e) + (s + 2 * e))
    vm_tasks.plan(desk, [cp, {**cp, "argv": ["cp", "-r", "b", "a"]}], "step")  # exactly at the quota: fits
    monkeypatch.setattr(vm_tasks, "HOME_QUOTA", home + (s + e) + (s + 2 * e) - 1)
    with pytest.raises(vm_rules.BadRequest, match="step 2 could take HOME"):
        vm_tasks.plan(desk, [cp, {**cp, "argv": ["cp", "-r", "b", "a"]}], "step")


def test_plan_sums_sleeps_and_command_timeouts(tmp_path):
    desk = fake_desk(tmp_path)
    sleep, cmd = {"type": "sleep", "seconds": 30}, {"type": "command", "argv": ["true"], "timeout": 30}
    vm_tasks.plan(desk, [sleep, sleep, cmd, cmd, {"type": "launch", "argv": ["xclock"], "timeout": 30}], "step")  # 120 s
    with pytest.raises(vm_rules.BadRequest, match="add up to 120.5 s"):
        vm_tasks.plan(desk, [sleep, sleep, cmd, cmd, {"type": "sleep", "seconds": 0.5}], "step")


def test_evaluate_past_its_time_budget_fails_the_checks_left(tmp_path, monkeypatch):
    desk = fake_desk(tmp_path)
    monkeypatch.setattr(vm_tasks, "REQUEST_SECONDS", 1.0)
    t = time.monotonic()
    out = vm_tasks.evaluate(desk, {"checks": [{"type": "command", "argv": ["sleep", "60"], "timeout": 60},
                                              {"type": "file_exists", "path": "x", "exists": False}]})
    assert time.monotonic() - t < 30  # the command was killed at the 1 s budget, not run to its 60 s
    assert [d["passed"] for d in out["details"]] == [False, False]
    assert out["details"][0]["info"] == "timed out" and out["details"][1]["info"].startswith("not run")
