"""task_files.py: ARPO's task files (tasks/*.json): `Task`, and `load_tasks`, which checks each file
against the server's own schema before a run starts.

    python -c "from task_files import load_tasks; print(len(load_tasks('tasks')))"
    python tasks/prove.py <task id>        # prove one task solvable on one desktop (tasks/README.md)

A file holds one task object or a list of them (tasks/README.md has the format). The schema of
the setup steps and checks is vm/tasks.py's (STEP_FIELDS, CHECK_FIELDS), the one the server checks
requests with, so a typo fails when the tasks load, not in the middle of a run; a solution's
actions are checked with actions.py's schema. Tested by `python -m pytest -q tests/test_env.py -k task`
(the files) and tests/test_tasks.py (every shipped task proved on a real desktop).

Where this departs from OSWorld: see vm/tasks.py (what a setup step and a check may do).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actions import Action
from vm.tasks import CHECK_FIELDS, STEP_FIELDS


class TaskError(ValueError):
    """A malformed task file; the message names the file and the field."""


@dataclass
class Task:
    """One task file (tasks/README.md has the format). `solution` is its scripted solution, Action
    dicts in screen pixels, replayed by `python tasks/prove.py` and tests/test_tasks.py to prove the
    task solvable. The trainers never show it to a model: a prompt is built from `instruction` and
    the screenshots alone (chat.uitars_messages takes the instruction string), and a trajectory file
    records the task's id and instruction only (tests/test_tasks.py checks both)."""
    id: str
    instruction: str
    setup: list[dict]
    evaluator: dict
    max_steps: int = 15
    infeasible: bool = False
    apps: tuple[str, ...] = ()
    solution: list[dict] = field(default_factory=list)


# A task file is checked against the server's own schema of steps and checks (vm.tasks.STEP_FIELDS,
# CHECK_FIELDS), so a typo fails when the tasks load, not in the middle of a run.
# `notes` is free text for the people who read the file (why the solution does what it does); nothing
# loads it.
_TASK = {"id": (str, True), "instruction": (str, True), "apps": (list, False), "setup": (list, False),
         "evaluator": (dict, True), "max_steps": (int, False), "infeasible": (bool, False),
         "solution": (list, False), "notes": (str, False)}


def _check_fields(item: dict, fields_: dict, where: str, fail) -> None:
    """Unknown fields, missing required ones, wrong types (a bool is not a number here)."""
    for k in item:
        if k != "type" and k not in fields_:
            fail(f"{where}{k}", f"is unknown here (allowed: {sorted(fields_)})")
    for k, (types, required) in fields_.items():
        v = item.get(k)
        if v is None and required:
            fail(f"{where}{k}", "is missing")
        if v is not None and (isinstance(v, bool) and types is not bool or not isinstance(v, types)):
            fail(f"{where}{k}", f"must be of type {getattr(types, '__name__', 'number')}, got {v!r}")


def _check_entry(item: Any, schema: dict, where: str, fail) -> None:
    """One setup step or evaluator check."""
    if not isinstance(item, dict) or item.get("type") not in schema:
        fail(where, f"must be an object whose 'type' is one of {sorted(schema)}")
    _check_fields(item, schema[item["type"]], where + ".", fail)
    if "argv" in item and not (item["argv"] and all(isinstance(a, str) and a for a in item["argv"])):
        fail(f"{where}.argv", "must be a non-empty list of strings")
    if "regex" in item:
        try:
            re.compile(item["regex"])
        except re.error as e:
            fail(f"{where}.regex", f"is not a valid regular expression ({e})")
    if item["type"] == "sleep" and not 0 <= item["seconds"] <= 30:
        fail(f"{where}.seconds", "must be between 0 and 30")
    if item["type"] == "file_contains" and ("text" in item) == ("regex" in item):
        fail(where, "needs exactly one of 'text' or 'regex'")


def _task_from_dict(d: Any, where: str) -> Task:
    def fail(field_: str, problem: str):
        raise TaskError(f"{where}: field '{field_}' {problem}; fix the task file.")

    if not isinstance(d, dict):
        raise TaskError(f"{where}: a task must be a JSON object; fix the task file.")
    _check_fields(d, _TASK, "", fail)
    for k in ("id", "instruction"):
        if not d[k].strip():
            fail(k, "is empty")
    if not 1 <= d.get("max_steps", 15) <= 100:
        fail("max_steps", f"must be from 1 to 100, got {d['max_steps']}")
    if not all(isinstance(a, str) for a in d.get("apps", [])):
        fail("apps", "must be a list of strings")
    setup, ev, infeasible = d.get("setup", []), d["evaluator"], d.get("infeasible", False)
    if len(setup) > 64:
        fail("setup", "has more than 64 steps")
    for j, step in enumerate(setup):
        _check_entry(step, STEP_FIELDS, f"setup[{j}]", fail)
    _check_fields(ev, {"conj": (str, False), "checks": (list, True)}, "evaluator.", fail)
    if ev.get("conj", "and") not in ("and", "or"):
        fail("evaluator.conj", "must be 'and' or 'or'")
    if not 0 < len(ev["checks"]) <= 64 and not (infeasible and not ev["checks"]):
        fail("evaluator.checks", "must hold 1 to 64 checks (only an infeasible task may have none)")
    for j, check in enumerate(ev["checks"]):
        _check_entry(check, CHECK_FIELDS, f"evaluator.checks[{j}]", fail)
    solution = []
    for j, a in enumerate(d.get("solution", [])):  # the server's own action schema (actions.py)
        try:
            solution.append(Action.from_dict(a).to_dict())
        except ValueError as e:
            fail(f"solution[{j}]", f"is not a valid action ({str(e).rstrip('.')})")
        # `done` and `fail` end an episode: whatever came after them could never be played
        if a["type"] in ("done", "fail") and j < len(d["solution"]) - 1:
            fail(f"solution[{j}]", f"ends the episode ('{a['type']}') before the last action")
    if len(solution) > d.get("max_steps", 15):
        fail("solution", f"has {len(solution)} actions, more than max_steps ({d.get('max_steps', 15)}) allows")
    return Task(d["id"], d["instruction"], setup, {"conj": ev.get("conj", "and"), "checks": ev["checks"]},
                d.get("max_steps", 15), infeasible, tuple(d.get("apps", [])), solution)


def load_tasks(path: str | os.PathLike) -> list[Task]:
    """Load one task file or every *.json in a directory (sorted). Each file holds a task object
    or a list of them. Any problem raises TaskError naming the file and the field."""
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("*.json"))
        if not files:
            raise TaskError(f"{path}: no *.json task files in this directory.")
    elif path.is_file():
        files = [path]
    else:
        raise TaskError(f"{path}: no such task file or directory.")
    tasks, seen = [], {}
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise TaskError(f"{f}: cannot read it ({e}).") from None
        except json.JSONDecodeError as e:
            raise TaskError(f"{f}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}).") from None
        items = data if isinstance(data, list) else [data]
        for k, d in enumerate(items):
            task = _task_from_dict(d, f"{f}" + (f"[{k}]" if isinstance(data, list) else ""))
            if task.id in seen:
                raise TaskError(f"{f}: field 'id': duplicate task id {task.id!r} (also in {seen[task.id]}); ids must be unique.")
            seen[task.id] = f
            tasks.append(task)
    return tasks
