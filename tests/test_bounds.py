"""A desktop's agent cannot starve the host: each attack typed by the agent into a real desktop's Terminal.

Run: python -m pytest -q tests/test_bounds.py      (about a minute; root, bwrap, `bash setup.sh`)

Three local desktops started as a trainer starts them (env.VMPool, sandboxed), with small bounds so
the attacks hit them fast (vm_server.py --limits; the defaults are vm/limits.py's). On desktop 0
the agent does what a policy can do through POST /action alone: a double-click on the Terminal
icon, then a typed command line. Meanwhile the trainer plays a task (its scripted solution, ARPO's
own episode code) on desktops 1 and 2, and every one of those episodes must succeed: a desktop at
its limit costs only its own episode. The host's view is read from /proc, the desktop's cgroups and
its files. Each attack is bounded in size and time, and each test fails on the code before the
bounds (7fed0cd): there the allocation, the files and the processes all landed on the host
(`python bench/attacks.py --before 7fed0cd` runs the same attacks on both, side by side).

- memory: a 700 MB bytearray is OOM-killed at the desktop's 400 MB (its cgroup's peak stays under
  the limit); the desktop's server and X server live on, and every desktop process is the OOM
  killer's first choice (oom_score_adj 1000) before the trainer (0).
- memory no process holds: /tmp, /var/tmp and /dev/shm are tmpfs of `tmp` bytes each: a 100 MB
  file stops at 32 MB; the reset empties them and XDG_RUNTIME_DIR.
- processes: 400 sleepers stop at the desktop's 160 (fork fails); the host gains no more than that.
- disk: HOME (and run/) is a tmpfs of `disk` bytes: a 100 MB file in HOME stops at 48 MB, and the
  host's root filesystem does not lose it.
- CPU: four busy loops in new sessions use at most the desktop's 0.5 CPU.
- a reset nobody can dodge: a shell that ignores SIGTERM and takes a new PID every few ms is gone
  after POST /reset, with every other process of the agent's.
- zombies: 300 orphans that exit at once are reaped while no request is served.
The full run folder (a trainer's disk that fills up) is tests/test_crash_resume.py's.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from functools import partial

import pytest

from conftest import proc_comm as comm, wait_for

import rollout  # noqa: E402
import train_arpo as T  # noqa: E402
from env import VMPool, load_tasks  # noqa: E402
from vm import limits as L  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = "memory=400m,pids=160,cpus=0.5,disk=48m,tmp=32m"
pytestmark = pytest.mark.skipif(L.available() is not None, reason=f"per-desktop bounds need root ({L.available()})")


class Agent:
    """Desktop 0 of the pool as its agent sees it (a Terminal) and as the host sees it (its HOME
    on the host, its cgroups)."""

    def __init__(self, pool: VMPool):
        self.pool, self.client = pool, pool.clients[0]
        vm = pool.local[0]
        text = open(vm.log).read()
        self.home = re.search(r" home (\S+)", text)[1]
        self.launcher = vm.proc.pid
        self.cg = {c: os.path.join(L.parent_dir(c), f"desktop-{self.launcher}") for c in ("memory", "pids", "cpuacct")}

    def read(self, controller: str, name: str) -> int:
        return int(open(os.path.join(self.cg[controller], name)).read())

    def members(self) -> set[int]:
        return {int(p) for p in open(os.path.join(self.cg["pids"], "cgroup.procs")).read().split()}

    def type(self, line: str, done: str, timeout: float = 60) -> str:
        """The agent opens the Terminal (double-click) and types `line; echo $? > ~/done`. -> what
        ~/done holds once it is there (read from HOME on the host)."""
        self.client.reset()
        x, y = desktop_icons()["Terminal"]
        self.client.act({"type": "double_click", "x": x, "y": y})
        wait_for(lambda: "xterm" in [w["title"] for w in self.client.windows()], "the Terminal")
        wait_for(self.shell_up, "the Terminal's shell")
        path = os.path.join(self.home, done)
        sep = " " if line.rstrip().endswith("&") else "; "  # `cmd &; echo` would be a syntax error
        assert self.client.act({"type": "type", "text": f"{line}{sep}echo $? > ~/{done}\n"})["ok"] is True
        return wait_for(lambda: os.path.exists(path) and open(path).read().endswith("\n") and open(path).read(),
                        f"{done} in HOME", timeout)

    def shell_up(self) -> bool:
        for p in self.members():
            try:
                ppid = int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if comm(p) in ("sh", "bash", "dash") and comm(ppid) == "xterm":
                return True
        return False


@pytest.fixture(scope="module")
def pool():
    p = VMPool(3, timeout=60, limits=LIMITS)
    yield p
    p.close()


@pytest.fixture(scope="module")
def agent(pool):
    return Agent(pool)


def play_calc(pool: VMPool, desktops: list[int], episodes: int) -> list[float]:
    """ARPO's own episode code plays the calc-open task (its scripted solution) `episodes` times on
    `desktops`. -> the scores; AssertionError if any episode failed."""
    [task] = [t for t in load_tasks(os.path.join(ROOT, "tasks")) if t.id == "calc-open"]
    args = T.Args(vms="3", group_size=2, model="tiny", max_steps=4, max_pixels=12544, settle="watch")
    solution = task.solution

    def policy(observations):
        out = []
        for o in observations:
            a = solution[o.step] if o.step < len(solution) else {"type": "done"}
            box = lambda x, y: f"({round(x * o.image_size[0] / o.screen[0])},{round(y * o.image_size[1] / o.screen[1])})"  # noqa: E731
            out.append(f"Thought: step.\nAction: left_double(start_box='{box(a['x'], a['y'])}')" if a["type"] == "double_click"
                       else "Thought: done.\nAction: finished(content='done')")
        return out
    jobs = [partial(T.episode, task=task, args=args, job=k) for k in range(episodes)]
    out = rollout.play(pool, jobs, policy, desktops=desktops, desc="trainer")
    assert out.failures == [], out.failures
    return [r.score for r in out.results]


@pytest.fixture
def trainer_plays(pool):
    """The trainer plays a task on desktops 1 and 2 (play_calc, twice each) for the whole test;
    every episode must score 1, with no failure."""
    results = []
    t = threading.Thread(target=lambda: results.append(play_calc(pool, [1, 2], 4)))
    t.start()
    yield
    t.join(timeout=300)
    assert results == [[1.0] * 4], results


def test_memory_is_bounded_and_the_oom_killer_takes_the_agents_process(agent, trainer_plays):
    avail = lambda: int(re.search(r"MemAvailable:\s+(\d+)", open("/proc/meminfo").read())[1]) << 10  # noqa: E731
    lowest, done = [avail()], []

    def watch():  # the host's available memory, all through the attack
        while not done:
            lowest[0] = min(lowest[0], avail())
            time.sleep(0.05)
    before = lowest[0]
    threading.Thread(target=watch, daemon=True).start()
    try:  # 700 MB, touched page by page, then held for 5 s
        rc = agent.type("python3 -c \"b = bytearray(700 << 20); b[::4096] = b'x' * len(b[::4096]); "
                        "import time; time.sleep(5)\"", "mem.rc")
    finally:
        done.append(True)
    assert rc.strip() == "137", rc  # SIGKILLed (128 + 9) by the OOM killer, in its desktop
    assert agent.read("memory", "memory.max_usage_in_bytes") <= 400 << 20
    oom = open(os.path.join(agent.cg["memory"], "memory.oom_control")).read()
    assert int(re.search(r"oom_kill (\d+)", oom)[1]) >= 1, oom  # the kill was the desktop's OOM killer's
    assert before - lowest[0] < 500 << 20  # the host never lost the 700 MB
    assert agent.client.health()["ok"] and agent.client.screenshot().size == (1280, 720)  # its desktop lives on
    scores = {comm(p): int(open(f"/proc/{p}/oom_score_adj").read()) for p in agent.members()}
    assert scores and set(scores.values()) == {1000}, scores  # every desktop process goes first ...
    assert int(open("/proc/self/oom_score_adj").read()) == 0  # ... before the trainer
    # what the limit cost: the attack's own programs; the desktop's next episode plays as on any other
    assert play_calc(agent.pool, [0], 1) == [1.0]


def test_tmpfs_files_are_bounded_and_a_reset_empties_them(agent, trainer_plays):
    for folder in ("/tmp", "/var/tmp", "/dev/shm", "$XDG_RUNTIME_DIR"):
        # 100 MB into it (head stops at ENOSPC), its size noted, the file removed, the size into HOME
        agent.type(f"head -c 100M /dev/zero > {folder}/fill; kb=$(du -k {folder}/fill | cut -f1); "
                   f"rm -f {folder}/fill; echo $kb > ~/kb.txt", "tmp.rc")
        kb = int(open(os.path.join(agent.home, "kb.txt")).read())
        assert 0 < kb <= (48 if folder == "$XDG_RUNTIME_DIR" else 32) * 1024, (folder, kb)  # stopped at its size
    rc = agent.type("touch /tmp/a /var/tmp/b /dev/shm/c $XDG_RUNTIME_DIR/d ~/e", "touch.rc")
    assert rc.strip() == "0"
    agent.client.reset()
    rc = agent.type("ls -A /tmp /var/tmp /dev/shm $XDG_RUNTIME_DIR > ~/ls.txt", "ls.rc")
    listed = open(os.path.join(agent.home, "ls.txt")).read().split()
    assert not {"a", "b", "c", "d", "fill"} & set(listed), listed  # as fresh as HOME
    assert ".X11-unix" in listed  # the X server's socket stays
    assert not os.path.exists(os.path.join(agent.home, "e"))


def test_processes_are_bounded(agent, trainer_plays):
    # (dash, which gives up on a failed fork at once where bash would retry it for a while)
    agent.type("sh -c 'i=0; while [ $i -lt 400 ]; do sleep 60 & i=$((i + 1)); done' 2> ~/fork.err", "fork.rc")
    err = open(os.path.join(agent.home, "fork.err")).read()
    assert "fork" in err.lower(), err  # "Cannot fork": the limit, inside the desktop
    # the desktop's whole count (every process and thread of it, as the host counts them) held
    assert agent.read("pids", "pids.current") <= 160 and agent.read("pids", "pids.peak") <= 160
    events = open(os.path.join(agent.cg["pids"], "pids.events")).read()
    assert int(events.split()[1]) > 0, events  # forks were refused at the limit
    agent.client.reset()
    assert not [p for p in agent.members() if comm(p) == "sleep"]


def test_disk_is_bounded(agent, trainer_plays):
    agent.type("head -c 100M /dev/zero > ~/fill; kb=$(du -k ~/fill | cut -f1); rm -f ~/fill; echo $kb > ~/kb.txt",
               "disk.rc")
    assert 0 < int(open(os.path.join(agent.home, "kb.txt")).read()) <= 48 * 1024  # stopped at HOME's size
    home = os.statvfs(agent.home)
    assert home.f_blocks * home.f_frsize == 48 << 20  # HOME is a filesystem of its own, that size ...
    assert os.stat(agent.home).st_dev != os.stat(ROOT).st_dev  # ... not the disk the run folder is on


def test_cpu_is_bounded(agent, trainer_plays):
    agent.type("for i in 1 2 3 4; do setsid sh -c 'while :; do :; done' & done", "cpu.rc")
    used, t0 = agent.read("cpuacct", "cpuacct.usage"), time.monotonic()
    time.sleep(3)
    seconds = (agent.read("cpuacct", "cpuacct.usage") - used) / 1e9
    assert seconds <= 0.5 * (time.monotonic() - t0) * 1.2, seconds  # its 0.5 CPU, however many loops
    agent.client.reset()
    assert not [p for p in agent.members() if comm(p) == "sh"]


def test_a_reset_nobody_can_dodge(agent, trainer_plays):
    # a shell that ignores SIGTERM and starts a new one every 5 ms, in a session of its own
    line = "setsid sh -c 'trap \"\" TERM; while :; do sh -c \"trap \\\"\\\" TERM; sleep 600\" & sleep 0.005; done' &"
    agent.type(line, "dodge.rc")
    wait_for(lambda: sum(comm(p) == "sleep" for p in agent.members()) > 5, "the storm to run")
    agent.client.reset()
    left = [(p, comm(p)) for p in agent.members() if comm(p) in ("sh", "sleep", "xterm")]
    assert left == [], left


def test_zombies_are_reaped_between_requests(agent, trainer_plays):
    def stat(p):
        try:
            return open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return []
    server = next(p for p in agent.members() if b"vm_server.py" in open(f"/proc/{p}/cmdline", "rb").read()
                  and len(open(f"/proc/{p}/status").read().split("NSpid:")[1].split("\n")[0].split()) == 2)
    zombies = lambda: [p for p in os.listdir("/proc") if p.isdigit() and stat(p)[:2] == ["Z", str(server)]]  # noqa: E731
    # 300 orphans that exit at once: each becomes the server's (a subreaper), then a zombie
    agent.type("for i in $(seq 300); do (sh -c 'exit 0' &); done; sleep 1", "zombie.rc")
    time.sleep(1)  # no request meanwhile: only the server's own reaping can clear them
    assert len(zombies()) < 5, len(zombies())
    assert agent.read("pids", "pids.current") < 100  # (a zombie holds its PID until it is reaped)


def test_a_sigkilled_launcher_leaves_nothing_once_the_next_desktop_starts():
    """A launcher killed with SIGKILL never runs its cleanup: its sandbox dies with it (bubblewrap's
    --die-with-parent), but its cgroups and its desktop's sized disk (memory, as a tmpfs) stay. The
    next launcher removes a dead launcher's."""
    def mounted():
        return [line.split()[4] for line in open("/proc/self/mountinfo") if f"/vm_server-{pid}-" in line]
    first = VMPool(1, limits=LIMITS)
    pid = first.local[0].proc.pid
    cgroups = Agent(first).cg.values()
    assert len(mounted()) == 1 and all(os.path.isdir(d) for d in cgroups)
    with L.sweep_lock():  # a desktop another test starts meanwhile would sweep it before we look
        first.local[0].proc.kill()
        first.local[0].proc.wait()
        wait_for(lambda: not any(open(os.path.join(d, "cgroup.procs")).read().split() for d in cgroups),
                 "the sandbox's end", 10)
        assert len(mounted()) == 1 and all(os.path.isdir(d) for d in cgroups)  # left behind
    first.close()
    second = VMPool(1, limits=LIMITS)
    try:
        assert mounted() == [] and not any(os.path.isdir(d) for d in cgroups)
        second.clients[0].health()  # and the new desktop serves
    finally:
        second.close()


def test_launchers_that_sweep_at_once_all_start():
    """Launchers start in parallel (a pool's all at once), and each first sweeps what killed ones
    left. Two sweeping the same dead launcher's cgroups raced: the second read the cgroup.procs of
    one the first had just removed, and died at start (FileNotFoundError; 8 of 12 launchers in 3
    rounds of 4 before the sweep took a lock). Here 100 dead launchers' cgroups (PIDs above
    pid_max: never a live process's) are swept by 4 launchers' sweeps at once, three times."""
    pid_max = int(open("/proc/sys/kernel/pid_max").read())
    parents = [L.parent_dir(c) for c in ("memory", "pids", "cpu", "cpuacct")]
    dead = [os.path.join(p, f"desktop-{pid_max + 1 + k}") for p in parents for k in range(100)]
    code = "from vm import limits as L; from vm.desktop import remove_tree; L.sweep(remove_tree)"
    for _ in range(3):
        for d in dead:
            os.makedirs(d, exist_ok=True)
        sweeps = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True)
                  for _ in range(4)]
        stderr = [p.communicate(timeout=60)[1] for p in sweeps]
        errors = [err.strip()[-200:] for p, err in zip(sweeps, stderr) if p.returncode != 0]
        assert errors == [] and not any(os.path.isdir(d) for d in dead)
