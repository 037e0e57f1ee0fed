"""Tests for the task suite (tasks/*.json): every shipped task is proven on a real desktop.

Run: python -m pytest -q tests/test_tasks.py   (needs Xvfb & co from setup.sh; ~30 s)

For every task, on a real `vm_server.py --xvfb` desktop over real HTTP: /reset, the task's /setup,
then (a) doing nothing must score 0.0 and (b) replaying its scripted solution
(tests/task_solutions.py) must score 1.0, each action sent as a trainer sends it, with
`?settle=watch` (the server answers once the desktop has settled; no fixed sleeps). Every episode
is scored by arpo_episode.outcome_scores, the rule training uses; infeasible tasks the way
ARPO/OSWorld score them, client side: 1.0 iff the agent's last action is `fail` (no /evaluate
call), so a solution ending in `fail` scores 1 and doing nothing or `done` scores 0.

Speed: the tasks are spread over DESKTOPS desktops (the session's shared one from conftest.py plus
extra ones), one thread per desktop pulling from a common queue; a desktop is reused across tasks
with /reset. The runs happen once, in a module fixture; one parametrized test per task reads the
result, so a failure names its task and shows the evaluator's details.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from conftest import start_vm_server
from actions import Action
from env import Task, VMClient, load_tasks
from task_solutions import SCREEN, SOLUTIONS
from arpo_episode import outcome_scores

TASKS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks")
TASKS = load_tasks(TASKS_DIR)
DESKTOPS = 3  # 2 would do on 2 cores, but the desktops mostly wait on app starts, setups and resets


def episode_score(task: Task, actions: list[dict], vm: VMClient) -> float:
    """The score of an episode that played `actions`, by the rule train_arpo.py trains and evaluates
    with (arpo_episode.outcome_scores): an infeasible task scores 1 iff the last action is `fail`
    (decided client side, never sent to /evaluate); otherwise the evaluator's. These episodes end
    with done/fail or are stopped by the test, never by the step limit, so the standard protocol
    must agree with the hard one."""
    last = actions[-1]["type"] if actions else None
    end = last if last in ("done", "fail") else None
    score = None if task.infeasible else vm.evaluate(task.evaluator)["score"]
    hard, standard = outcome_scores(task.infeasible, actions, end, score)
    assert hard == standard, (task.id, actions, hard, standard)
    return hard


# ---------------------------------------------------------------------------------------------
# The suite as a whole: loads, has the promised shape, has a solution per task


def test_load_tasks_reads_every_file():
    files = sorted(f for f in os.listdir(TASKS_DIR) if f.endswith(".json"))
    assert len(TASKS) == len(files) >= 24
    # one task per file, named after its id, so a task is easy to find from a log line
    assert sorted(t.id + ".json" for t in TASKS) == files


def test_suite_covers_apps_and_difficulty():
    apps = Counter(a for t in TASKS for a in t.apps)
    assert {"xterm", "mousepad", "galculator", "pcmanfm"} <= set(apps)
    assert sum(len(t.apps) >= 2 for t in TASKS) >= 3, "some tasks must span two apps"
    assert 3 <= sum(t.infeasible for t in TASKS) <= 5
    n_actions = [len(SOLUTIONS[t.id]) for t in TASKS if not t.infeasible]
    assert min(n_actions) <= 2 and max(n_actions) >= 8
    for t in TASKS:  # every solution fits in the task's step budget (waits count as steps too)
        assert len(SOLUTIONS[t.id]) <= t.max_steps, t.id


def test_every_task_has_a_valid_solution():
    assert set(SOLUTIONS) == {t.id for t in TASKS}
    for t in TASKS:
        actions = SOLUTIONS[t.id]
        assert actions, t.id
        for a in actions:  # each one survives env's schema and lies on the screen
            assert Action.from_dict(a).to_dict() == a, (t.id, a)
            for kx, ky in (("x", "y"), ("x2", "y2")):
                if kx in a:
                    assert 0 <= a[kx] < SCREEN[0] and 0 <= a[ky] < SCREEN[1], (t.id, a)
        ends = [a["type"] for a in actions if a["type"] in ("done", "fail")]
        # infeasible: exactly one `fail`, at the end; feasible: the test evaluates after the last
        # action, and neither `done` nor `fail` belongs in the middle of a solution
        assert ends == (["fail"] if t.infeasible else []), t.id
        if t.infeasible:
            assert actions[-1]["type"] == "fail" and t.evaluator["checks"] == [], t.id


# ---------------------------------------------------------------------------------------------
# Every task on a real desktop


@dataclass
class Run:
    nothing: float = -1.0       # score after setup, before any action
    solved: float = -1.0        # score after the scripted solution
    also: dict = field(default_factory=dict)  # infeasible: score of other endings ("done")
    details: list = field(default_factory=list)  # the evaluator's details after the solution
    error: str = ""
    seconds: float = 0.0


def run_task(vm: VMClient, task: Task) -> Run:
    run, t0 = Run(), time.time()
    try:
        vm.reset()
        vm.setup(task.setup)
        run.nothing = episode_score(task, [], vm)
        if task.infeasible:  # the desktop is untouched by ending with `done` or `fail`
            run.also["done"] = episode_score(task, [{"type": "done"}], vm)
            run.also["wait+done"] = episode_score(task, [{"type": "wait"}, {"type": "done"}], vm)
        for a in SOLUTIONS[task.id]:
            if a["type"] not in ("done", "fail"):
                vm.act(a, settle="watch")  # the server answers once the screen has settled
        run.solved = episode_score(task, SOLUTIONS[task.id], vm)
        if not task.infeasible:
            run.details = vm.evaluate(task.evaluator)["details"]
        if run.solved != 1.0:  # keep the evidence: what the screen showed at the end
            path = os.path.join(tempfile.gettempdir(), f"test_tasks-{task.id}.png")
            vm.screenshot().save(path)
            run.details.append({"screenshot": path})
    except Exception as e:  # noqa: BLE001 -- reported by the task's own test, not the fixture
        run.error = f"{type(e).__name__}: {e}"
    run.seconds = time.time() - t0
    return run


@pytest.fixture(scope="module")
def task_runs(vm_desktop):
    """Run every task once, on DESKTOPS desktops in parallel; -> {task id: Run}."""
    extra = []
    try:
        extra = [start_vm_server() for _ in range(DESKTOPS - 1)]
        clients = [VMClient(d.url, d.token, timeout=60) for d in [vm_desktop, *extra]]
        todo: queue.Queue = queue.Queue()
        # longest first, so the slow multi-app tasks do not all end up at the tail of one queue
        for t in sorted(TASKS, key=lambda t: -len(SOLUTIONS[t.id])):
            todo.put(t)
        runs: dict[str, Run] = {}

        def worker(vm: VMClient):
            while True:
                try:
                    task = todo.get_nowait()
                except queue.Empty:
                    return
                runs[task.id] = run_task(vm, task)

        t0 = time.time()
        threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        print(f"\n{len(TASKS)} tasks on {len(clients)} desktops in {time.time() - t0:.1f} s "
              f"(sum of per-task times {sum(r.seconds for r in runs.values()):.1f} s)")
        clients[0].reset()  # leave the shared desktop as we found it
        yield runs
    finally:
        for d in extra:
            d.stop()


@pytest.mark.parametrize("task_id", [t.id for t in TASKS])
def test_task_on_desktop(task_runs, task_id):
    run = task_runs[task_id]
    assert not run.error, f"{task_id}: {run.error}"
    assert run.nothing == 0.0, f"{task_id}: doing nothing must score 0"
    assert run.solved == 1.0, f"{task_id}: the scripted solution scored {run.solved}: {run.details}"
    assert all(v == 0.0 for v in run.also.values()), f"{task_id}: {run.also}"
