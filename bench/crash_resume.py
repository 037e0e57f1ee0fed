"""Benchmark: SIGKILL the train scripts at random moments, resume, and check nothing was lost.

    python bench/crash_resume.py                     # 10 kills per script; last line = headline
    python bench/crash_resume.py --kills 5 --seed 1

The long version of tests/test_crash_resume.py (its helpers do the work), with LOCAL desktops
(--vms 2, started by the trainer itself), so every kill also tests that the trainer's desktops go
with it. For train_explore.py (the tiny model SFT'd to answer in the format, image + curiosity
rewards) and train_arpo.py (tiny model, a task every episode passes, so the replay buffer fills):
--kills SIGKILLs at seeded random moments (after 0-2 new checkpoints, then 0-1.2 s into an
iteration; or anywhere in the first 8 s), each followed by a resume; then a last run to the end.
Checked after every kill: the checkpoint a resume would load is complete (COMPLETE + loadable,
never a `ckpt` without COMPLETE); every desktop process of the killed trainer is gone within 10 s.
At the end: metrics.jsonl has every iteration exactly once; optimizer (and world-model) step
counters equal an unbroken run's; across each kill, the world model and adapter moved by at most
what the optimizer steps in between allow, and ARPO's replay buffer kept what it held; no
ckpt.tmp-* is left. Headline: kills survived (all checks passed) / kills tried, both scripts.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import test_crash_resume as C  # noqa: E402
from conftest import proc_alive, proc_children  # noqa: E402
from test_train_explore import speaking_tiny  # noqa: E402


def desktop_watch():
    """before_kill / between hooks: note the trainer's desktop processes at the kill, count the
    ones still alive 10 s later (they should exit with their parent)."""
    noted, orphans = [], []

    def before_kill(p):
        servers = [c for c in proc_children(p.pid) if b"vm_server.py" in open(f"/proc/{c}/cmdline", "rb").read()]
        noted[:] = servers + [d for s in servers for d in proc_children(s)]

    def after_kill():
        deadline = time.time() + 10
        while any(map(proc_alive, noted)) and time.time() < deadline:
            time.sleep(0.2)
        orphans.extend(p for p in noted if proc_alive(p))
        for p in noted:
            if proc_alive(p):
                os.kill(p, 9)  # do not leak them into the rest of the bench
        noted.clear()
    return before_kill, after_kill, orphans


def check(name: str, ok: bool, failures: list) -> None:
    if not ok:
        failures.append(name)


def run_script(script: str, fresh: list, run: str, seed: int, kills: int, n: int, between_extra=None) -> dict:
    before_kill, after_kill, orphans = desktop_watch()
    starts = []

    def between(run, before):
        after_kill()
        starts.append(before["next_iteration"] if before else None)
        if between_extra:
            between_extra(run, before)
    t0 = time.time()
    r = C.crash_and_resume(script, [str(a) for a in fresh], run, seed, kills, between=between, before_kill=before_kill)
    r["seconds"], r["orphans"], r["starts"] = time.time() - t0, orphans, starts
    fails = []
    its = [m["iteration"] for m in r["metrics"]]
    check("every iteration exactly once", its == list(range(n)), fails)
    check("no ckpt.tmp-* or ckpt.old left", sorted(x for x in os.listdir(run) if x.startswith("ckpt")) == ["ckpt"], fails)
    check("no desktop outlived its trainer", not orphans, fails)
    r["fails"] = fails
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs per script")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="crash_resume-")
    results = {}

    # -- train_explore.py
    speaker = speaking_tiny(os.path.join(tmp, "speaker"))
    n = 4 + 2 * a.kills
    run = os.path.join(tmp, "explore")
    fresh = ["--vms", 2, "--model", speaker, "--iterations", n, "--steps", 2, "--max-pixels", 12544,
             "--max-new-tokens", 40, "--settle", 0.2, "--threads", 1, "--update-actor-delay", 0,
             "--rewards", "none,image,immediate,world_model", "--wm-epochs", 1, "--run-name", run]
    r = run_script("train_explore.py", fresh, run, a.seed, a.kills, n)
    wm_trained = [m["wm/loss"] is not None for m in r["metrics"]]
    if r["final"] is not None:
        check("policy optimizer steps = iterations", C.opt_steps(r["final"]["optimizer"]) == n, r["fails"])
        check("world-model steps = iterations that trained it", C.opt_steps(r["final"]["wm_opt"]) == sum(wm_trained), r["fails"])
    for old, new in r["pairs"]:
        k, j = old["next_iteration"], new["next_iteration"]
        dwm = C.opt_steps(new["wm_opt"]) - C.opt_steps(old["wm_opt"])
        check(f"world model continued across the kill at {k}", C.max_diff(old["wm"], new["wm"]) <= 5e-3 * dwm + 1e-6, r["fails"])
        check(f"adapter continued across the kill at {k}", C.max_diff(old["adapter"], new["adapter"]) <= 2e-4 * (j - k) + 1e-7, r["fails"])
    results["train_explore.py"] = r

    # -- train_arpo.py
    n = 4 + 2 * a.kills
    os.makedirs(os.path.join(tmp, "tasks"))
    with open(os.path.join(tmp, "tasks", "t.json"), "w") as f:
        json.dump({"id": "notes-there", "instruction": "Look at the notes.", "setup": [], "max_steps": 2,
                   "evaluator": {"conj": "and", "checks": [{"type": "file_exists", "path": "notes.txt"}]}}, f)
    run = os.path.join(tmp, "arpo")
    fresh = ["--vms", 2, "--group-size", 2, "--model", "tiny", "--iterations", n, "--max-steps", 2,
             "--max-pixels", 12544, "--max-new-tokens", 8, "--tasks", os.path.join(tmp, "tasks"), "--settle", 0.1,
             "--run-name", run]
    r = run_script("train_arpo.py", fresh, run, a.seed + 1, a.kills, n)
    if r["final"] is not None:
        check("optimizer steps = iterations", C.opt_steps(r["final"]["optimizer"]) == n, r["fails"])

    def ids(state):
        return [(t["iteration"], t["vm"]) for t, _ in state["replay"]["data"].get("notes-there", [])]
    for old, new in r["pairs"]:
        added = [x for x in ids(new) if x[0] >= old["next_iteration"]]
        kept = ids(new)[:len(ids(new)) - len(added)]
        check(f"replay buffer continued across the kill at {old['next_iteration']}",
              bool(added) and kept == ids(old)[len(ids(old)) - len(kept):] and len(kept) == min(len(ids(old)), 8 - len(added)),
              r["fails"])
    results["train_arpo.py"] = r

    # -- figures
    print(f"{'script':18s} {'kills':>6} {'survived':>9} {'pre-ckpt':>9} {'pairs':>6} {'iterations':>11} "
          f"{'orphans':>8} {'seconds':>8}  failed checks")
    tried = survived = 0
    for name, r in results.items():
        ok = r["survived"] if not r["fails"] else 0
        tried, survived = tried + r["tried"], survived + ok
        print(f"{name:18s} {r['tried']:>6} {ok:>9} {sum(s is None for s in r['starts']):>9} {len(r['pairs']):>6} "
              f"{len(r['metrics']):>11} {len(r['orphans']):>8} {r['seconds']:>8.0f}  {', '.join(r['fails']) or '-'}")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"crash_resume_kills_survived: {survived}/{tried}")


if __name__ == "__main__":
    main()
