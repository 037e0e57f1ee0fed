"""arpo_eval.py: ARPO's evaluation (standard and hard success rates) and task selection.

    python train_arpo.py --eval-only --resume runs/<name>       # evaluate_policy on the run's checkpoint
    python train_arpo.py --select-tasks 16 ...                  # select_and_record before training

Both play many episodes (arpo_episode.py) with a fixed policy and count what they scored; under
torchrun every rank plays a contiguous share of the episodes on its own desktops and the results
are gathered in job order (run_shared_jobs). `args` is train_arpo.py's Args (read here:
eval_episodes, eval_temperature, eval_out, select_tasks, success_threshold, save_trajectories, and
what arpo_episode.py reads).

Where this departs from ARPO: an episode lost to a VM failure is played once more on another
desktop and, if lost again, counted apart (`lost`), never as a failure of the policy. Success is
OSWorld's: the mean score, under the standard protocol (running out of steps counts as FAIL) and the
hard one (ARPO's OSWorld-Hard: what the agent did); arpo_episode.outcome_scores has the rule.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import replace

from plumbing import dist
from arpo_episode import run_jobs, save_episodes
from env import VMPool


def run_shared_jobs(pool: VMPool, jobs: list, policy_fn, args, vm_offset: int = 0, save=None) -> tuple[list, int]:
    """run_jobs on this rank's share of `jobs` (a contiguous slice; one process: all of them).
    save(episode), if given, runs on the rank that played it. -> (every rank's episodes, as
    dicts in job order, VMs numbered among all ranks'; episodes lost to VM failures, all ranks')."""
    mine = dist.shard_range(len(jobs))
    eps, lost = run_jobs(pool, jobs[mine.start:mine.stop], policy_fn, args, first_job=mine.start)
    rows = []
    for e in eps:
        if save is not None:
            save(e)
        rows.append({"task": e.task.id, "vm": vm_offset + e.vm, "job": e.job, "end": e.end, "steps": len(e.actions),
                     "score_standard": e.score_standard, "score_hard": e.score, "actions": e.actions,
                     "format_ok": e.format_ok, "texts": e.texts})
    rows = sorted((r for part in dist.gather(rows) for r in part), key=lambda r: r["job"])
    return rows, int(dist.all_sum([lost])[0])


def select_tasks(pool: VMPool, tasks: list, k: int, policy_fn, args, vm_offset: int = 0) -> tuple[list, dict]:
    """ARPO's task selection: k rollouts per task with the starting policy; keep the tasks solved
    (score > success threshold) at least once. Returns (kept tasks, {task id: successes})."""
    eps, _ = run_shared_jobs(pool, [t for t in tasks for _ in range(k)], policy_fn, args, vm_offset)
    counts = {t.id: 0 for t in tasks}
    for e in eps:
        counts[e["task"]] += e["score_hard"] > args.success_threshold  # ALGO: "solved at least once"
    return [t for t in tasks if counts[t.id] > 0], counts


def evaluate_policy(pool: VMPool, tasks: list, policy_fn, args, save_to: str | None = None,
                    vm_offset: int = 0) -> dict:
    """Success rate (mean score, as OSWorld reports it) per task and overall, under both protocols,
    and per episode what it did (details: every step's action, whether it parsed, the answer text).
    save_to: a folder that gets the episodes as a run's trajectories (view.py reads it), one
    "iteration" per task in the order given, one "vm" per rollout of it."""
    t0 = time.perf_counter()
    n = args.eval_episodes
    save = None if not save_to else (lambda e: save_episodes(save_to, e.job // n, [replace(e, job=e.job % n)],
                                                             vm_offset=vm_offset, clear=False))
    eps, lost = run_shared_jobs(pool, [t for t in tasks for _ in range(n)], policy_fn, args, vm_offset, save)
    out = {"episodes": len(eps), "lost": lost, "episodes_per_task": n,
           "temperature": args.eval_temperature, "seconds": time.perf_counter() - t0}
    for proto, key in (("standard", "score_standard"), ("hard", "score_hard")):
        per_task = {}
        for t in tasks:
            s = [e[key] for e in eps if e["task"] == t.id]
            per_task[t.id] = sum(s) / len(s) if s else None
        all_s = [e[key] for e in eps]
        out[proto] = {"overall": sum(all_s) / len(all_s) if all_s else None, "per_task": per_task}
    out["details"] = eps
    steps = [ok for e in eps for ok in e["format_ok"]]
    out["format_rate"] = sum(steps) / len(steps) if steps else None  # share of answers that parsed
    return out


def eval_table(result: dict) -> str:
    fmt = lambda v: "  -  " if v is None else f"{v:5.2f}"  # noqa: E731
    rows = [f"{'task':32s} standard  hard"]
    for tid in result["standard"]["per_task"]:
        rows.append(f"{tid:32s} {fmt(result['standard']['per_task'][tid])}   {fmt(result['hard']['per_task'][tid])}")
    rows.append(f"{'overall':32s} {fmt(result['standard']['overall'])}   {fmt(result['hard']['overall'])}"
                f"   ({result['episodes']} episodes, {result['lost']} lost to VM failures)")
    return "\n".join(rows)


def run_eval(pool: VMPool, tasks: list, policy_fn, args, run: str, iteration: int, vm_offset: int = 0) -> None:
    """--eval-only: eval_it<N>.json (or --eval-out) and the episodes beside it in eval_it<N>/
    (`python view.py runs/<name>/eval_it<N>` shows what was clicked), and the table printed."""
    out = args.eval_out or os.path.join(run, f"eval_it{iteration:06d}.json")
    root, ext = os.path.splitext(out)
    folder = root if ext else out + "_episodes"  # never the JSON's own path
    if dist.is_main():
        shutil.rmtree(folder, ignore_errors=True)  # a second eval of the same checkpoint replaces the first
    dist.barrier()
    result = evaluate_policy(pool, tasks, policy_fn, args, save_to=folder if args.save_trajectories else None,
                             vm_offset=vm_offset)
    result.update(model=args.model, run=run, iteration=iteration, protocols={
        "standard": "an episode that runs out of steps counts its last action as FAIL (OSWorld)",
        "hard": "the last action is what the agent did (OSWorld-Hard in ARPO)"})
    if dist.is_main():
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
        print(eval_table(result))
        print(f"eval written to {out}")


def select_and_record(pool: VMPool, tasks: list, policy_fn, args, run: str, vm_offset: int = 0) -> list:
    """--select-tasks K: run the selection with the starting policy, write selected_tasks.json."""
    path = os.path.join(run, "selected_tasks.json")
    if os.path.exists(path):  # killed after selecting, before the first checkpoint: reuse it
        with open(path) as f:
            keep = json.load(f)["selected"]
        kept = [t for t in tasks if t.id in keep]
    else:
        print(f"task selection: {args.select_tasks} rollouts of each of {len(tasks)} tasks ...", flush=True)
        kept, counts = select_tasks(pool, tasks, args.select_tasks, policy_fn, args, vm_offset)
        if dist.is_main():
            with open(path, "w") as f:
                json.dump({"k": args.select_tasks, "success_threshold": args.success_threshold,
                           "successes": counts, "selected": [t.id for t in kept]}, f, indent=2)
        print(f"task selection kept {len(kept)}/{len(tasks)} tasks: {[t.id for t in kept]} (written to {path})")
    if not kept:
        raise SystemExit(f"no task was solved even once in {args.select_tasks} tries; raise --select-tasks, "
                         "use an easier task set, or train without --select-tasks.")
    return kept
