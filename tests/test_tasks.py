"""Tests for the task suite (tasks/*.json): every shipped task is proven on a real desktop.

Run: python -m pytest -q tests/test_tasks.py              (needs Xvfb & co from setup.sh; ~40 s)
     python -m pytest -q tests/test_tasks.py -k files-rename   (one task: its checks and its desktop run)

For every task, on a real `vm_server.py --xvfb` desktop over real HTTP, tasks/prove.py's `prove`
(what `python tasks/prove.py tasks/<id>.json` runs): /reset, the task's /setup, then doing nothing
must score 0.0 (infeasible tasks: ending with `done` too) and replaying the `solution` of its file,
each action sent as a trainer sends it with `?settle=watch`, must score 1.0. Every episode prove
scored is scored again here by train_arpo.outcome_scores, the rule training uses, under both
protocols (hard and standard): they must agree with prove's.

Speed: the selected tasks are spread over up to DESKTOPS desktops (the session's shared one from
conftest.py plus extra ones), one thread per desktop pulling from a common queue (prove_all). The
runs happen once, in a module fixture, for the tasks whose test_task_on_desktop[<id>] pytest
selected (`-k <id>`: that one, on the shared desktop alone); one parametrized test per task reads
the result, so a failure names its task and shows the evaluator's details and a screenshot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections import Counter

import pytest

from plumbing import logs
from train_arpo import outcome_scores
from conftest import start_vm_server
from vm.desktop import desktop_icons
from env import VMClient, VMPool
from env import Task, load_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS_DIR = os.path.join(ROOT, "tasks")
sys.path.insert(0, TASKS_DIR)
import prove as P  # noqa: E402 -- tasks/prove.py, the command a task author runs

TASKS = load_tasks(TASKS_DIR)
BY_ID = {t.id: t for t in TASKS}
IDS = [t.id for t in TASKS]
DESKTOPS = 3  # 2 would do on 2 cores, but the desktops mostly wait on app starts, setups and resets


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
    n_actions = [len(t.solution) for t in TASKS if not t.infeasible]
    assert min(n_actions) <= 2 and max(n_actions) >= 8


# Ours, untuned: about twice OSWorld's share of infeasible tasks (about 8% of its tasks).
GIVE_UP_AT_MOST = 0.16


def test_infeasible_tasks_teach_giving_up_without_paying_for_it():
    """OSWorld, and so ARPO's training, holds tasks the desktop cannot do, where the right answer is
    call_user() (FAIL): a policy that never meets one never learns to say so. Each of them pays a
    policy that gives up, so they must stay few: a policy that answers call_user() at once on every
    task, scored by the rule training uses (train_arpo.outcome_scores, both protocols), scores at
    most GIVE_UP_AT_MOST. (That each is infeasible is the next test's; that `fail` is its only
    1 and `done` scores 0, test_solution_on_paper's and test_task_on_desktop's.)"""
    infeasible = [t.id for t in TASKS if t.infeasible]
    assert infeasible, ("no task is infeasible: add one the desktop cannot do (tasks/README.md, Infeasible tasks), "
                        "so the policy meets tasks where call_user() is the right answer")
    give_up = [outcome_scores(t.infeasible, [{"type": "fail"}], "fail") for t in TASKS]
    assert give_up == [(1.0, 1.0) if t.infeasible else (0.0, 0.0) for t in TASKS]
    share = sum(hard for hard, _ in give_up) / len(TASKS)
    assert share <= GIVE_UP_AT_MOST, (
        f"giving up on every task would score {share:.0%} ({len(infeasible)} of {len(TASKS)} tasks are infeasible), "
        f"more than {GIVE_UP_AT_MOST:.0%}: a policy could learn to give up; add feasible tasks or drop infeasible "
        f"ones (tasks/README.md, Infeasible tasks)")


def infeasible_table() -> dict[str, list[str]]:
    """tasks/README.md's table of infeasible tasks: task id -> the programs that would make it feasible."""
    text = open(os.path.join(TASKS_DIR, "README.md"), encoding="utf-8").read()
    rows = re.findall(r"^ *\| `([\w-]+)` \| [^|]+ \|([^|]*)\|$", text, re.M)
    return {task: re.findall(r"`([^`]+)`", programs) for task, programs in rows}


def test_infeasible_tasks_are_infeasible_here():
    """Each infeasible task is in tasks/README.md's table, which says what the desktop lacks for it,
    and none of the programs listed there is installed: the agent's terminal sees the host's
    /usr (vm/sandbox.py), so a machine that has one could do the task, and training would teach
    the policy to give up on a task it can do. (The network, which no desktop has, is
    tests/test_containment.py's.)"""
    table = infeasible_table()
    infeasible = sorted(t.id for t in TASKS if t.infeasible)
    missing = [i for i in infeasible if i not in table]
    assert not missing, (f"{', '.join(missing)}: add a row to tasks/README.md's table of infeasible tasks, saying "
                         f"what the desktop lacks for it and the programs that would make it feasible")
    extra = sorted(set(table) - set(infeasible))
    assert not extra, f"tasks/README.md's table of infeasible tasks names {', '.join(extra)}, no infeasible task here"
    found = [(task, p, shutil.which(p)) for task, programs in sorted(table.items()) for p in programs if shutil.which(p)]
    assert not found, "; ".join(f"{p} is installed ({where}), so {task} may be doable on this desktop: uninstall it, "
                                f"or drop the task (tasks/README.md, Infeasible tasks)" for task, p, where in found)


@pytest.mark.parametrize("task_id", IDS)
def test_solution_on_paper(task_id):
    """Each solution exists, is what load_tasks would write back, fits the task's step budget,
    stays on the screen, ends right, and clicks only desktop icons at desktop_icons' centres."""
    t = BY_ID[task_id]
    assert P.solution_problems(t) == []
    raw = json.load(open(os.path.join(TASKS_DIR, f"{task_id}.json")))
    assert raw["solution"] == t.solution  # normalised by Action.from_dict to itself: no None fields, no aliases
    assert len(t.solution) <= t.max_steps  # waits count as steps too
    ends = [a["type"] for a in t.solution if a["type"] in ("done", "fail")]
    # infeasible: exactly one `fail`, at the end; feasible: evaluated after the last action, and
    # neither `done` nor `fail` belongs in it
    assert ends == (["fail"] if t.infeasible else []), task_id
    if t.infeasible:
        assert t.evaluator["checks"] == [], task_id


def test_icon_clicks_follow_the_icon_layout():
    """Solutions hold icon positions as plain numbers; a layout change must fail them loudly. Every
    pointer action of the suite is on an icon of desktop.desktop_icons (solution_problems), the
    icons the suite clicks include the four apps, and with the icons moved by 10 px every task
    that clicks one is reported, naming the action and the icon it meant."""
    icons = desktop_icons(P.SCREEN)
    points = [(t.id, (a["x"], a["y"])) for t in TASKS for a in t.solution if "x" in a]
    assert points and all(xy in icons.values() for _, xy in points)
    label = {xy: k for k, xy in icons.items()}
    assert {"Terminal", "Text Editor", "Calculator", "File Manager"} <= {label[xy] for _, xy in points}
    moved = {k: (x + 10, y) for k, (x, y) in icons.items()}
    for t in TASKS:
        problems = P.solution_problems(t, moved)
        clicks = [(j, a) for j, a in enumerate(t.solution) if "x" in a]
        assert len(problems) == len(clicks), (t.id, problems)
        for (j, a), why in zip(clicks, problems):
            meant = label[(a["x"], a["y"])]
            assert why.startswith(f"solution[{j}] ({a['type']}) points at") and f"nearest: {meant}" in why, why


def test_readme_icon_table_is_desktop_icons():
    """tasks/README.md lists the icon centres a solution clicks; they are desktop_icons'."""
    text = open(os.path.join(TASKS_DIR, "README.md"), encoding="utf-8").read()
    table = {k: (int(x), int(y)) for k, x, y in re.findall(r"^ *\| ([A-Z][\w ]+?) \| (\d+), (\d+) \|$", text, re.M)}
    assert table == desktop_icons(P.SCREEN)


def test_solution_problems_by_hand():
    base = dict(id="t", instruction="Do it.", setup=[], evaluator={"conj": "and", "checks": []})
    assert P.solution_problems(Task(**base)) == ["has no `solution`: add the actions that solve it "
                                                 "(tasks/README.md, Writing a solution)."]
    off = Task(**base, solution=[{"type": "click", "x": 1280, "y": 5}, {"type": "drag", "x": 74, "y": 46,
                                                                          "x2": 75, "y2": 46}])
    assert P.solution_problems(off) == [
        "solution[0] (click) points at (1280, 5), off the 1280x720 screen.",
        "solution[1] (drag) points at (75, 46), which is no desktop icon's centre (nearest: Terminal at (74, 46)); "
        "a solution clicks only desktop icons (`python tasks/prove.py --icons` lists them) and uses keys for the rest."]
    assert P.solution_problems(Task(**base, infeasible=True, solution=[{"type": "done"}])) == [
        "is infeasible, so its solution must end with `fail` (it ends with `done`)."]
    assert P.solution_problems(Task(**base, solution=[{"type": "key", "keys": ["a"]}, {"type": "fail"}])) == [
        "is feasible, so its solution must not end with `fail` (a `fail` scores 0 on it)."]


def test_docs_hard_code_no_task_count():
    """The READMEs say "every task in tasks/", never how many there are: a fork that adds one would
    have to find and fix each number. (Other counts of tasks there are experiments' settings.)"""
    count = re.compile(rf"\b{len(TASKS)}\s+(?:[\w-]+\s+)?tasks\b")
    assert count.findall(f"{len(TASKS)} OSWorld-style tasks for the desktop; {len(TASKS)} tasks: 10 terminal") == [
        f"{len(TASKS)} OSWorld-style tasks", f"{len(TASKS)} tasks"]
    for doc in ("README.md", "tasks/README.md"):
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        assert not count.findall(text), f"{doc} counts the tasks: {count.findall(text)}"


# ---------------------------------------------------------------------------------------------
# The command a task author runs: python tasks/prove.py


def test_prove_command(vm_desktop, tmp_path):
    """`python tasks/prove.py` as a subprocess on the session's desktop (--vms URL --token): a
    shipped task is proven in one line; a solution that misses, a no-op that already passes and a
    click beside an icon are not, each with its reason, the evaluator's checks and a screenshot
    that exists; the exit status says so. A bad path is one sentence and status 2."""
    import subprocess
    base = {k: v for k, v in json.load(open(os.path.join(TASKS_DIR, "terminal-touch-file.json"))).items()
            if k != "notes"}
    bad = {"misses": dict(base, solution=[{"type": "type", "text": "touch ~/other.flag\n"}]),
           "passes-untouched": dict(base, evaluator={"conj": "and", "checks": [
               {"type": "file_exists", "path": "ready.flag", "exists": False}]}),
           "beside-icon": dict(base, solution=[{"type": "double_click", "x": 80, "y": 46}])}
    for name, t in bad.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(dict(t, id=name)))
    cmd = [sys.executable, os.path.join(TASKS_DIR, "prove.py"), "--vms", vm_desktop.url, "--token", vm_desktop.secret,
           "--shots", str(tmp_path)]
    p = subprocess.run(cmd + [str(tmp_path), os.path.join(TASKS_DIR, "terminal-touch-file.json")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    out = p.stdout
    assert re.search(r"^ok +terminal-touch-file +1 action +nothing 0, solution 1 +\d+\.\d s$", out, re.M), out
    assert re.search(r"^FAIL +misses .*\n +the solution scores 0, not 1\.\n +evaluator after the solution: "
                     r"\{\"type\": \"file_exists\", \"passed\": false", out, re.M), out
    assert re.search(r"^FAIL +passes-untouched .*\n +doing nothing scores 1, not 0", out, re.M), out
    assert re.search(r"^FAIL +beside-icon .*\n +solution\[0\] \(double_click\) points at \(80, 46\), which is no "
                     r"desktop icon's centre \(nearest: Terminal at \(74, 46\)\)", out, re.M), out
    shots = re.findall(r"screenshot: (\S+)", out)
    assert sorted(shots) == [str(tmp_path / "prove-misses.png"), str(tmp_path / "prove-passes-untouched.png")]
    assert all(os.path.getsize(s) > 1000 for s in shots)
    assert re.search(r"\n1/4 proven in \d+\.\d s; not proven: beside-icon, misses, passes-untouched\n$", out), out
    p = subprocess.run(cmd + [str(tmp_path / "nope.json")], capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", f"prove: {tmp_path / 'nope.json'}: no such task file or directory.\n")
    p = subprocess.run(cmd[:2] + ["--icons"], capture_output=True, text=True, timeout=60)
    assert [line.split()[-2:] for line in p.stdout.splitlines()] == [[str(x), str(y)] for x, y in desktop_icons(P.SCREEN).values()]


# ---------------------------------------------------------------------------------------------
# The solution is for proving, never for the model


def test_the_solution_reaches_no_prompt_and_no_trajectory(vm_desktop, tmp_path):
    """A task whose solution holds a marker, played by ARPO's own episode loop (train_arpo.episode) on a real
    desktop with a stand-in policy that records what a model would be shown: the marker is in no
    prompt (Observation.messages) and in no file of the trajectories the trainer writes."""
    import train_arpo as T
    marker = "SOLUTION-ONLY-7f3a9c"
    (tmp_path / "t.json").write_text(json.dumps({
        "id": "secret", "instruction": "Write a note.", "max_steps": 2,
        "evaluator": {"conj": "and", "checks": [{"type": "file_exists", "path": "note.txt"}]},
        "solution": [{"type": "type", "text": marker}]}))
    [task] = load_tasks(tmp_path / "t.json")
    assert task.solution == [{"type": "type", "text": marker}]
    seen = []

    def policy(observations):
        seen.extend(json.dumps(o.messages, default=str) for o in observations)
        return ["Thought: I wait.\nAction: wait()" if o.step == 0 else "Thought: Done.\nAction: finished(content='ok')"
                for o in observations]

    args = T.Args(vms="1", group_size=1, model="tiny", max_steps=2, max_pixels=64 * 28 * 28, vm_timeout=30.0)
    with VMPool([vm_desktop.url], token=vm_desktop.secret, timeout=30) as pool:
        eps, out = T.play_tasks(pool, [task], policy, args)
        lost = len(out.failures)
        pool.reset()  # leave the shared desktop as we found it
    assert lost == 0 and len(seen) == 2 and eps[0].end == "done"
    assert all("Write a note." in m and marker not in m for m in seen)
    run = tmp_path / "run"
    logs.save_episodes(str(run), 0, eps)
    files = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.suffix == ".jsonl" for p in files)
    assert [p for p in files if marker.encode() in p.read_bytes()] == []
    # nor in what the replay buffer (and so every checkpoint) keeps of a success
    record = T.to_dict(eps[0])
    assert marker not in json.dumps(record, default=str) and T.from_dict(record).task.id == "secret"


def test_an_alone_task_fails_while_a_wrong_app_is_open(vm_desktop):
    """The self-correction tasks (bench/claims.py arpo-self-correction) pay only for the asked-for app
    alone: from the spoiled start, opening it beside the wrong one scores 0; closing the wrong one
    first (alt+f4, its solution) scores 1, and it stays 1 when the asked-for app's icon is
    double-clicked again (one calculator window or two: either is the app alone)."""
    client = VMClient(vm_desktop.url, vm_desktop.token, timeout=60)
    task = BY_ID["calc-alone-spoiled"]
    calc = {"type": "double_click", "x": 74, "y": 246}
    try:
        client.reset()
        client.setup(task.setup)
        client.act(calc, settle="watch")  # the calculator beside the terminal the setup opened
        assert client.evaluate(task.evaluator)["score"] == 0
        client.reset()
        client.setup(task.setup)
        for action in (*task.solution, calc):  # close the terminal, open the calculator, and once more
            client.act(action, settle="watch")
        assert {w["title"] for w in client.windows()} == {"galculator"}
        assert client.evaluate(task.evaluator)["score"] == 1
    finally:
        client.reset()  # leave the shared desktop as we found it


# ---------------------------------------------------------------------------------------------
# Every task on a real desktop


def selected(request, name: str) -> list[str]:
    """The task ids of this module's `name[<id>]` tests pytest is about to run (after -k and the like)."""
    return [it.callspec.params["task_id"] for it in request.session.items
            if getattr(it, "module", None) is request.module and getattr(it, "originalname", None) == name]


@pytest.fixture(scope="module")
def task_runs(request, vm_desktop):
    """Prove the selected tasks once, on up to DESKTOPS desktops in parallel; -> {task id: Proof}."""
    ids = selected(request, "test_task_on_desktop")
    extra = []
    try:
        extra = [start_vm_server() for _ in range(min(DESKTOPS, len(ids)) - 1)]
        clients = [VMClient(d.url, d.token, timeout=60) for d in [vm_desktop, *extra]]
        t0 = time.time()
        proofs = P.prove_all(clients, [BY_ID[i] for i in ids])
        print(f"\n{len(ids)} tasks on {len(clients)} desktops in {time.time() - t0:.1f} s "
              f"(sum of per-task times {sum(p.seconds for p in proofs.values()):.1f} s)")
        clients[0].reset()  # leave the shared desktop as we found it
        yield proofs
    finally:
        for d in extra:
            d.stop()


@pytest.mark.parametrize("task_id", IDS)
def test_task_on_desktop(task_runs, task_id):
    proof, task = task_runs[task_id], BY_ID[task_id]
    assert proof.ok, "\n" + proof.line()
    # prove's scores are the trainer's: each ending it scored, by outcome_scores (hard, standard)
    assert len(proof.episodes) == (4 if task.infeasible else 2)
    for actions, checks, score in proof.episodes:
        last = actions[-1]["type"] if actions else None
        end = last if last in ("done", "fail") else None  # these episodes end by the agent, never by the step limit
        assert outcome_scores(task.infeasible, actions, end, checks) == (score, score), (task_id, actions)
