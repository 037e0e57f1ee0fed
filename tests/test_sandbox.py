"""The local desktop's sandbox (bubblewrap) and its X resource environment, attacked as an agent would.

Run: python -m pytest -q tests/test_sandbox.py     (~40 s; needs bwrap, `bash setup.sh` installs it)

- The agent opens the Terminal through POST /action (a double-click on its icon) and types
  commands that write into the host's /tmp, the real /root, / and the desktop's folder outside
  HOME, read a file in /root, then write into HOME. Nothing appears on the host, nothing is read;
  the HOME file appears; the desktop still works. What /dev, /proc, /sys and `id` look like from that terminal is checked too.
- From the host's side (/proc/<pid>/...): every process of the desktop, the server included, is in
  its own PID and network namespaces, without capabilities, not root (inside, nor on the host),
  sees only the host's system folders (read-only) and of the project exactly vm.FILES (read-only,
  wherever the checkout lives: under /tmp they are bound into the sandbox's private /tmp), /tmp
  private, HOME writable, /proc/sys read-only. (tests/test_containment.py types the attacks this stops.)
- A crash of the server inside takes the whole sandbox with it and the launcher removes the folder;
  a `kill -9` of the launcher is tests/test_vm_server.py::test_parallel_desktops_are_isolated_and_stop_cleanly.
- The modes: the server says once on stderr which one it runs in; without bwrap it stops with one
  sentence; --no-sandbox runs unconfined.
- Xt resource files in HOME (~/XTerm, ~/XCalc, ~/.Xdefaults-<host>), written straight to disk, have
  no effect on a real xterm and xcalc: no red background, no translation typing into the shell.
"""
from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

from PIL import Image, ImageChops

from conftest import ROOT, SERVER, proc_alive, proc_descendants, start_vm_server, vm_call
from conftest import mouse, wait_for, x11

sys.path.insert(0, os.path.dirname(SERVER))
from vm import desktop  # noqa: E402
from vm import sandbox  # noqa: E402
from vm import FILES as VM_FILES  # noqa: E402

# What bwrap's --dev leaves in /dev: no disks, no /dev/mem, no host ttys.
SANDBOX_DEV = {"console", "core", "fd", "full", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout",
               "tty", "urandom", "zero"}


def screenshot(vm) -> Image.Image:
    r = vm_call(vm, "GET", "/screenshot")
    assert r.status_code == 200
    return Image.open(io.BytesIO(r.content)).convert("RGB")


def changed(a: Image.Image, b: Image.Image) -> bool:
    return ImageChops.difference(a, b).getbbox() is not None


def titles(vm) -> list[str]:
    return [w["title"] for w in vm_call(vm, "GET", "/windows").json()["windows"]]


def inside(vm) -> list[int]:
    """The host pids of the desktop's processes inside the sandbox (below the two bwraps)."""
    return [p for p in proc_descendants(vm.proc.pid) if proc_alive(p) and comm(p) != "bwrap"]


def comm(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/comm").read().strip()
    except OSError:
        return ""


def window_rect(vm, title: str) -> tuple[int, int, int, int]:
    """(x, y, w, h) of the window called `title`, from xwininfo on the desktop's display."""
    out = x11(vm, "xwininfo", "-name", title).stdout
    info = dict(line.strip().split(":", 1) for line in out.splitlines() if line.count(":") == 1)
    return tuple(int(info[k]) for k in ("Absolute upper-left X", "Absolute upper-left Y", "Width", "Height"))


def mounts(pid: int) -> dict[str, tuple[set[str], str]]:
    """Mount point -> (options, filesystem type) as process `pid` sees them (the top mount wins)."""
    out = {}
    for line in open(f"/proc/{pid}/mountinfo"):
        left, right = line.split(" - ", 1)
        f = left.split()
        out[f[4]] = (set(f[5].split(",")), right.split()[0])
    return out


# ------------------------------------------------------------------------------------------------
# The agent's attack, through the Terminal it opens itself


def test_the_agents_terminal_cannot_touch_the_host(vm_desktop):
    vm, u = vm_desktop, f"sandbox-{uuid.uuid4().hex[:10]}"
    folder = os.path.dirname(vm.home)  # the desktop's folder: template/, home/, run/
    targets = [f"/tmp/{u}", f"/root/{u}", f"/{u}", os.path.join(folder, u), os.path.join(folder, "template", u)]
    secret = f"/root/{u}-secret"  # a user's file the agent must not read either
    assert vm_call(vm, "POST", "/reset").status_code == 200
    try:
        with open(secret, "w") as f:
            f.write("the user's secret\n")
        before = screenshot(vm)
        x, y = desktop.desktop_icons()["Terminal"]
        assert vm_call(vm, "POST", "/action", {"type": "double_click", "x": x, "y": y}).status_code == 200
        wait_for(lambda: "xterm" in titles(vm), "the Terminal the agent double-clicked")
        time.sleep(0.5)  # the shell prints its prompt
        opened = screenshot(vm)
        assert changed(before, opened)
        cmd = (f"touch {' '.join(targets)}; cat {secret} > ~/leak.txt; ls /dev > ~/dev.txt; ls /proc > ~/proc.txt; "
               f"ls /sys > ~/sys.txt; id -u > ~/uid.txt; echo x > ~/ok\n")
        assert vm_call(vm, "POST", "/action", {"type": "type", "text": cmd}).status_code == 200
        ok = os.path.join(vm.home, "ok")
        wait_for(lambda: os.path.exists(ok) and open(ok).read() == "x\n", "~/ok written from the Terminal")
        assert changed(opened, screenshot(vm))  # the typed line and touch's complaints are on screen

        assert [t for t in targets if os.path.lexists(t)] == []  # nothing on the host
        read = lambda name: open(os.path.join(vm.home, name)).read().split()  # noqa: E731
        assert read("leak.txt") == []  # /root is an empty folder inside
        dev = set(read("dev.txt"))
        assert "null" in dev and dev <= SANDBOX_DEV, dev - SANDBOX_DEV
        pids = [int(p) for p in read("proc.txt") if p.isdigit()]
        # only the sandbox's own: bwrap as PID 1, the desktop, and the shell's commands of the moment
        assert 1 in pids and len(pids) <= len(inside(vm)) + 6 < 50, pids
        assert "kernel" in read("sys.txt")  # the host's /sys, read-only (test below)
        assert read("uid.txt") != ["0"]  # not root inside
        assert vm_call(vm, "GET", "/health").json()["ok"] is True
    finally:
        for t in [*targets, secret]:  # should the sandbox ever fail, leave nothing behind
            if os.path.lexists(t):
                os.unlink(t)
        vm_call(vm, "POST", "/reset")


def test_every_process_of_the_desktop_is_confined(vm_desktop):
    vm = vm_desktop
    assert vm.stderr().count(sandbox.SANDBOX_LINE) == 1 and "sandbox: off" not in vm.stderr()
    procs = inside(vm)
    names = {comm(p) for p in procs}
    assert {"python", "Xvfb", "openbox", "tint2", "pcmanfm"} <= names, names  # the server runs inside too
    # What the sandbox shows of the host, with whatever is mounted below: the system folders, bwrap's
    # /dev, /proc and /sys, what the server runs from (Python's prefix and path, not the project nor
    # the tests/ pytest put on our path), the desktop's folder. And its own empty mounts, whose
    # insides are counted: /, the private /tmp and /var/tmp, the emptied folder of every desktop's
    # folder. The deepest above a mount decides: a checkout under /tmp has its files bound into
    # the private /tmp, and they count as the project's (not as /tmp, not as /var).
    ours = lambda d: d == ROOT or d.startswith(ROOT + "/")  # noqa: E731
    shown = (*sandbox.SYSTEM, "/dev", "/proc", "/sys", sys.prefix, sys.base_prefix, os.path.dirname(vm.home),
             *[p for p in sys.path if p.startswith("/") and not ours(p)])
    empty = ("/", "/tmp", "/var/tmp", os.path.dirname(os.path.dirname(vm.home)))

    def accounted(d: str) -> bool:
        above = max((s for s in (*shown, *empty) if d == s or d.startswith(s.rstrip("/") + "/")), key=len)
        return d == above or above in shown
    project = sorted(os.path.join(ROOT, f) for f in VM_FILES)
    for p in procs:
        status = dict(line.split(":", 1) for line in open(f"/proc/{p}/status").read().splitlines() if ":" in line)
        assert len(status["NSpid"].split()) == 2, (comm(p), status["NSpid"])  # a PID namespace of its own
        assert os.readlink(f"/proc/{p}/ns/net") != os.readlink("/proc/self/ns/net"), comm(p)  # and a network one
        assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0, comm(p)
        assert open(f"/proc/{p}/uid_map").read().split()[0] != "0", comm(p)  # not root inside
        assert "0" not in status["Uid"].split() and "0" not in status["Gid"].split(), comm(p)  # nor on the host
        m = mounts(p)
        assert "ro" in m["/"][0] and "ro" in m["/proc/sys"][0] and "ro" in m["/sys"][0], comm(p)
        assert m["/tmp"][1] == "tmpfs" and "rw" in m["/tmp"][0]
        assert m["/dev"][1] == "tmpfs"
        assert "rw" in m[vm.home][0] and "ro" in m[os.path.dirname(vm.home)][0]
        # Nothing of the host but its system folders and what the server runs from: no /root,
        # /home, /run, /srv; of this project exactly what a VM needs (vm.FILES: vm_server.py,
        # actions.py, vm/), not the trainers, tasks/ (the evaluators) or runs/.
        extra = sorted(d for d in m if not accounted(d))
        assert extra == project, (f"{comm(p)} sees {extra} of the host beyond its system folders and Python, not "
                                  f"exactly the project's {project}" + ("" if extra else ": the checkout lies in a "
                                  "system folder, which the sandbox shows whole (tasks/ too); clone it elsewhere"))
        assert all("ro" in m[f][0] for f in project), comm(p)
        assert not {"/root", "/home", "/run", "/srv", "/mnt", "/opt"} & set(m), comm(p)
    # and the X server works: the host's xdotool reaches it (in its network namespace, with its
    # cookie), and it moves the pointer we asked for
    assert vm_call(vm, "POST", "/action", {"type": "move", "x": 77, "y": 55}).status_code == 200
    assert mouse(vm) == (77, 55)


def test_a_crashed_server_takes_its_sandbox_along():
    vm = start_vm_server()
    try:
        procs = inside(vm)
        server = [p for p in procs if comm(p) == "python"]
        assert len(server) == 1 and len(procs) >= 4
        os.kill(server[0], signal.SIGKILL)  # the server inside dies; bwrap's PID 1 and all it ran follow
        vm.proc.wait(15)
        assert vm.proc.returncode != 0
        wait_for(lambda: not any(map(proc_alive, procs)), "every process of the sandbox to exit", 10)
        assert not os.path.exists(os.path.dirname(vm.home))  # the launcher removed the folder
    finally:
        vm.stop(signal.SIGKILL)


def test_removing_a_desktops_folder_leaves_the_folder_around_it_alone(tmp_path):
    """The desktop's folder sits in /tmp: removing it, even after it is gone or with a folder the agent
    locked (chmod 000) inside, must never loosen /tmp's own mode (1777 -> 0755 broke every user's /tmp)."""
    tmp_path.chmod(0o1777)
    desktop.remove_tree(str(tmp_path / "gone"))
    (tmp_path / "t" / "a" / "b").mkdir(parents=True)
    (tmp_path / "t" / "a").chmod(0)
    desktop.remove_tree(str(tmp_path / "t"))
    assert not (tmp_path / "t").exists() and oct(tmp_path.stat().st_mode & 0o7777) == oct(0o1777)


# ------------------------------------------------------------------------------------------------
# Modes


def test_without_bwrap_it_says_so_in_one_sentence(tmp_path):
    env = {**os.environ, "PATH": str(tmp_path)}  # no bwrap (nor anything else) on PATH
    r = subprocess.run([sys.executable, SERVER, "--xvfb", "--port", "0"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0 and r.stderr.count("\n") == 1, r.stderr
    assert "bwrap" in r.stderr and "--no-sandbox" in r.stderr and r.stdout == ""


def test_no_sandbox_runs_unconfined_and_says_so():
    vm = start_vm_server("--no-sandbox")
    try:
        err = vm.stderr()
        assert err.count("sandbox: off (--no-sandbox)") == 1 and sandbox.SANDBOX_LINE not in err, err
        kids = [p for p in proc_descendants(vm.proc.pid) if proc_alive(p)]
        assert "Xvfb" in map(comm, kids) and "bwrap" not in map(comm, kids)
        status = open(f"/proc/{kids[0]}/status").read()
        assert len(status.split("NSpid:")[1].split("\n")[0].split()) == 1  # the host's PID namespace
        assert vm_call(vm, "GET", "/health").status_code == 200
        # It still serves as documented: the screen, and an action that lands (its display, in our
        # network namespace, wants its cookie too)
        assert vm_call(vm, "GET", "/screenshot").headers["Content-Type"] == "image/png"
        assert vm_call(vm, "POST", "/action", {"type": "move", "x": 33, "y": 44}).status_code == 200
        assert mouse(vm) == (33, 44)
    finally:
        vm.stop()


# ------------------------------------------------------------------------------------------------
# Xt resource files in HOME are not read


def test_xt_resource_files_in_home_have_no_effect(vm_desktop):
    vm = vm_desktop
    assert vm_call(vm, "POST", "/reset").status_code == 200
    red = "*background: red\n*Background: red\n"
    typed = '*VT100.translations: #override <Expose>: string("touch xt_pwned") string(0x0d)\n'
    host = socket.gethostname()
    files = {"XTerm": red + typed, "XCalc": red, f".Xdefaults-{host}": red + typed}
    try:
        for name, text in files.items():  # written on disk directly, as a task or an earlier episode might have
            with open(os.path.join(vm.home, name), "w") as f:
                f.write(text)
        r = vm_call(vm, "POST", "/setup", {"steps": [{"type": "launch", "argv": ["xterm", "-geometry", "60x15+300+100"]},
                                                     {"type": "launch", "argv": ["xcalc"]}]})
        assert r.status_code == 200, r.text
        wait_for(lambda: {"xterm", "Calculator"} <= set(titles(vm)), "xterm and xcalc")
        time.sleep(1.0)
        shot = screenshot(vm)
        for title in ("xterm", "Calculator"):
            x, y, w, h = window_rect(vm, title)
            reds = shot.crop((x, y, x + w, y + h)).getcolors(w * h)
            reds = sum(n for n, px in reds if px == (255, 0, 0))
            assert reds < w * h // 20, f"{title}: {reds} of {w * h} pixels red: an Xt resource file in HOME was read"
        assert not os.path.exists(os.path.join(vm.home, "xt_pwned"))
    finally:
        vm_call(vm, "POST", "/reset")
