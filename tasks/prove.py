"""prove.py: prove task files on a real desktop: after a task's setup, doing nothing scores 0 and
the scripted solution in its file (`solution`) scores 1.

    python tasks/prove.py tasks/my-task.json            # one task, on a local desktop it starts
    python tasks/prove.py tasks/a.json tasks/b.json     # several, one after the other
    python tasks/prove.py tasks/ --vms 3                # every task here, on 3 local desktops at once
    python tasks/prove.py tasks/my-task.json --vms http://10.0.0.5:8000 --token SECRET  # a running vm_server.py
    python tasks/prove.py --icons                       # where the desktop icons are (for a solution's clicks)

For each task, on one desktop over real HTTP, the way a trainer drives it: POST /reset, the task's
/setup, then
  1. doing nothing must score 0 (an infeasible task: ending at once with `done`, or with `done`
     after a `wait`, must score 0 too);
  2. its solution, each action sent with `?settle=watch` (the server answers once the screen has
     settled, so a solution needs no `wait` for an app to come up), must score 1.
The score is the trainers' rule (train_arpo.outcome_scores; tests/test_tasks.py checks that every episode played
here agrees with it): the evaluator's, except that an infeasible task scores 1 iff the episode's
last action is `fail` (UI-TARS call_user(); no /evaluate call), and a `fail` scores 0 on a feasible
one. Before a desktop is touched the solution is checked on paper (`solution_problems`): it exists,
stays on the 1280x720 screen, and clicks only desktop icons, at their centres (desktop.desktop_icons).

Prints one line per task with its time, then a summary. Exit status 0 when every task is proven,
1 when one is not (its lines give the evaluator's details and a screenshot of the screen it left),
2 when nothing could be tried (a malformed task file, no desktop).

tests/test_tasks.py proves every task in tasks/ with the same `prove` (`-k <task-id>`: one task).
Where this departs from OSWorld: its task files hold no solution, so nothing replays one; here each
task file ships a scripted solution, and this command proves it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vm.desktop import desktop_icons  # noqa: E402
from env import VMClient, VMError, VMPool  # noqa: E402
from env import Task, TaskError, load_tasks  # noqa: E402

SCREEN = (1280, 720)  # the `vm_server.py --xvfb` desktop's screen: solutions are in its pixels
ENDS = ("done", "fail")  # actions that end an episode: scored, never sent to the desktop


# ---------------------------------------------------------------------------------------------
# On paper: what a solution must be before a desktop is worth starting


def solution_problems(task: Task, icons: dict[str, tuple[int, int]] | None = None) -> list[str]:
    """Why `task.solution` cannot prove the task, without a desktop: [] when nothing is wrong.
    (load_tasks already checked each action's fields, and that `done`/`fail` come last.)

    Every point a solution's action aims at must be a desktop icon's centre: icons are the only
    things on this desktop that never move (a window opens where the window manager puts it), so
    anything else is reached by keys. Checking the numbers against desktop.desktop_icons makes a
    change of the icon layout fail here, loudly, instead of as a click into empty desktop."""
    if not task.solution:
        return ["has no `solution`: add the actions that solve it (tasks/README.md, Writing a solution)."]
    icons = desktop_icons(SCREEN) if icons is None else icons
    at = {xy: label for label, xy in icons.items()}
    problems = []
    for j, a in enumerate(task.solution):
        for kx, ky in (("x", "y"), ("x2", "y2")):
            if kx not in a:
                continue
            xy = (a[kx], a[ky])
            if not (0 <= xy[0] < SCREEN[0] and 0 <= xy[1] < SCREEN[1]):
                problems.append(f"solution[{j}] ({a['type']}) points at {xy}, off the {SCREEN[0]}x{SCREEN[1]} screen.")
            elif xy not in at:
                near = min(icons, key=lambda k: (icons[k][0] - xy[0]) ** 2 + (icons[k][1] - xy[1]) ** 2)
                problems.append(f"solution[{j}] ({a['type']}) points at {xy}, which is no desktop icon's centre "
                                f"(nearest: {near} at {icons[near]}); a solution clicks only desktop icons "
                                f"(`python tasks/prove.py --icons` lists them) and uses keys for the rest.")
    last = task.solution[-1]["type"]
    if task.infeasible and last != "fail":
        problems.append(f"is infeasible, so its solution must end with `fail` (it ends with `{last}`).")
    if not task.infeasible and last == "fail":
        problems.append("is feasible, so its solution must not end with `fail` (a `fail` scores 0 on it).")
    return problems


# ---------------------------------------------------------------------------------------------
# On a desktop


@dataclass
class Proof:
    """What proving one task found. ok: doing nothing scored 0, every other ending of an infeasible
    task 0, the solution 1, and nothing went wrong on the way."""
    task: str
    actions: int = 0
    nothing: float | None = None   # score right after the setup
    solved: float | None = None    # score after the solution
    also: dict = field(default_factory=dict)      # infeasible: other endings -> score ("done": ...)
    details: dict = field(default_factory=dict)   # "doing nothing" / "the solution" -> the evaluator's checks, when that scored wrong
    problems: list = field(default_factory=list)  # on paper, or an error on the desktop
    screenshot: str = ""           # where the screen it left is saved, when not proven
    seconds: float = 0.0
    episodes: list = field(default_factory=list)  # (actions, evaluator score or None, score) of each ending scored

    @property
    def ok(self) -> bool:
        return (not self.problems and self.nothing == 0.0 and self.solved == 1.0
                and all(v == 0.0 for v in self.also.values()))

    def line(self) -> str:
        """One line for the console (more, indented, when the task is not proven)."""
        head = f"{'ok' if self.ok else 'FAIL':4s}  {self.task:32s} {self.actions:2d} action{'s' if self.actions != 1 else ' '}"
        if self.ok:
            also = "".join(f", {k} {v:g}" for k, v in self.also.items())
            return f"{head}  nothing {self.nothing:g}{also}, solution {self.solved:g}  {self.seconds:5.1f} s"
        why = list(self.problems)
        if self.nothing not in (None, 0.0):
            why.append(f"doing nothing scores {self.nothing:g}, not 0: the evaluator passes on the untouched setup.")
        why += [f"ending with {k} scores {v:g}, not 0." for k, v in self.also.items() if v != 0.0]
        if self.solved not in (None, 1.0):
            why.append(f"the solution scores {self.solved:g}, not 1.")
        out = [f"{head}  {self.seconds:5.1f} s"] + [f"      {w}" for w in why]
        out += [f"      evaluator after {k}: {json.dumps(d)}" for k, ds in self.details.items() for d in ds]
        out += [f"      screenshot: {self.screenshot}"] if self.screenshot else []
        return "\n".join(out)


def score(vm: VMClient, task: Task, actions: list[dict], proof: Proof) -> tuple[float, list]:
    """(score, evaluator details) of an episode that played `actions` and ended there, by
    train_arpo.outcome_scores' rule for such an episode (no step limit reached)."""
    last = actions[-1]["type"] if actions else None
    if task.infeasible:
        s, checks, details = float(last == "fail"), None, []
    else:
        ev = vm.evaluate(task.evaluator)
        checks, details = ev["score"], ev["details"]
        s = 0.0 if last == "fail" else float(checks)
    proof.episodes.append((list(actions), checks, s))
    return s, details


def prove(vm: VMClient, task: Task, shots: str | None = None) -> Proof:
    """Prove one task on the desktop `vm` (it is reset first). `shots`: the folder for the
    screenshot of a task that is not proven (default: the temp folder)."""
    t0, proof = time.monotonic(), Proof(task.id, len(task.solution))
    proof.problems = solution_problems(task)
    if proof.problems:
        return proof
    try:
        vm.reset()
        vm.setup(task.setup)
        proof.nothing, details = score(vm, task, [], proof)
        if proof.nothing:
            proof.details["doing nothing"] = details
        if task.infeasible:  # ending with `done`, at once or after a step, is no way out either
            proof.also["done"], _ = score(vm, task, [{"type": "done"}], proof)
            proof.also["wait+done"], _ = score(vm, task, [{"type": "wait"}, {"type": "done"}], proof)
        for a in task.solution:
            if a["type"] not in ENDS:
                vm.act(a, settle="watch")  # the server answers once the screen has settled
        proof.solved, details = score(vm, task, task.solution, proof)
        if proof.solved != 1.0:
            proof.details["the solution"] = details
    except Exception as e:  # noqa: BLE001 -- a refused action, a dead desktop: this task's failure, not the run's
        proof.problems.append(f"stopped by {type(e).__name__}: {e}")
    if not proof.ok:
        try:  # the evidence: what the screen showed when we stopped
            proof.screenshot = os.path.join(shots or tempfile.gettempdir(), f"prove-{task.id}.png")
            vm.screenshot().save(proof.screenshot)
        except (VMError, OSError) as e:
            proof.screenshot = f"(none: {e})"
    proof.seconds = time.monotonic() - t0
    return proof


def prove_all(clients: list[VMClient], tasks: list[Task], shots: str | None = None, report=None) -> dict[str, Proof]:
    """Prove `tasks` on `clients`' desktops at once, one thread per desktop taking the next task from
    a common queue (a desktop is reused with /reset). `report(proof)` is called as each one ends.
    -> {task id: Proof}."""
    todo: queue.Queue = queue.Queue()
    for t in sorted(tasks, key=lambda t: -len(t.solution)):  # the long ones first: no long tail on one desktop
        todo.put(t)
    proofs: dict[str, Proof] = {}
    lock = threading.Lock()

    def worker(vm: VMClient) -> None:
        while True:
            try:
                task = todo.get_nowait()
            except queue.Empty:
                return
            p = prove(vm, task, shots)
            with lock:
                proofs[task.id] = p
                if report:
                    report(p)

    threads = [threading.Thread(target=worker, args=(c,)) for c in clients]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return proofs


# ---------------------------------------------------------------------------------------------
# The command


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Prove task files on a real desktop: doing nothing scores 0, "
                                             "the task's `solution` scores 1.")
    ap.add_argument("paths", nargs="*", help="task files (.json) or folders of them")
    ap.add_argument("--vms", default="1", help="how many local desktops to start (default 1), or the URLs "
                                               "of running vm_server.py desktops, comma-separated")
    ap.add_argument("--token", default=None, help="the secret remote desktops' tokens derive from "
                                                  "(as the trainers' --token)")
    ap.add_argument("--shots", default=None, help="folder for the screenshots of tasks not proven "
                                                  "(default: the temp folder)")
    ap.add_argument("--icons", action="store_true", help="print the desktop icons' centres and exit")
    args = ap.parse_args(argv)
    if args.icons:
        for label, (x, y) in desktop_icons(SCREEN).items():
            print(f"{label:14s} {x:4d} {y:4d}")
        return 0
    if not args.paths:
        ap.error("give task files or folders to prove (e.g. tasks/my-task.json).")
    tasks: dict[str, Task] = {}
    try:
        for p in args.paths:
            for t in load_tasks(p):
                if tasks.setdefault(t.id, t) != t:  # tasks/ and tasks/x.json together prove x once
                    raise TaskError(f"{p}: task id {t.id!r} is also in another file given, with other contents; "
                                    f"ids must be unique.")
    except TaskError as e:
        print(f"prove: {e}", file=sys.stderr)
        return 2
    t0, n = time.monotonic(), len(tasks)
    # What fails on paper needs no desktop: said at once, and only the rest waits for one.
    proofs = {i: Proof(i, len(t.solution), problems=solution_problems(t)) for i, t in tasks.items()}
    todo = [t for t in tasks.values() if not proofs[t.id].problems]
    for p in proofs.values():
        if p.problems:
            print(p.line(), flush=True)
    if todo:
        try:
            vms = int(args.vms) if args.vms.strip().isdigit() else args.vms
            pool = VMPool(min(vms, len(todo)) if isinstance(vms, int) else vms, token=args.token, timeout=60,
                          screen=SCREEN)
        except (VMError, ValueError) as e:
            print(f"prove: no desktop to prove on: {e}", file=sys.stderr)
            return 2
        try:
            print(f"proving {len(todo)} task{'s' * (len(todo) != 1)} on {pool.size} desktop"
                  f"{'s' * (pool.size != 1)} (started in {time.monotonic() - t0:.1f} s)", flush=True)
            proofs |= prove_all(pool.clients, todo, args.shots, report=lambda p: print(p.line(), flush=True))
        finally:
            pool.close()
    bad = sorted(p.task for p in proofs.values() if not p.ok)
    print(f"{n - len(bad)}/{n} proven in {time.monotonic() - t0:.1f} s" + (f"; not proven: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
