"""Benchmark: VM faults in the middle of real training iterations, and what they cost.

    python bench/vm_faults.py                         # both parts below; last line = headline
    python bench/vm_faults.py --timeouts 5,10 --explore-iterations 6

1. train_arpo.py's `iteration` (in process, the tiny real model, 4 local desktops in 2 groups
   of 2), for each --vm-timeout T: a warm-up and a clean iteration, then one where desktop 1 is SIGKILLed and
   desktop 2 SIGSTOPped while the model answers step 1, then the next iteration (both restarted).
   Columns: T, clean s, faulty s, extra = faulty - clean (ideally about T: the frozen VM's one
   call that has to expire), restarted s, dropped, trained-on VMs.
2. train_explore.py as a subprocess on 4 local desktops: once iteration 1 is logged, its vm_server
   children are found by their command lines; 1 s into iteration 2's rollout (after its reset; 8 steps)
   one is SIGKILLed (its whole
   process group) and one SIGSTOPped. The run must finish every iteration; printed: each
   iteration's time and live desktops, and that no desktop process is left (the frozen one is
   woken with SIGCONT and stopped by the trainer's own restart; we SIGCONT it again at the end in
   case).
Headline: the faulty iteration's extra seconds over the clean one, per second of timeout (ARPO,
largest T): about 1.0 means a frozen VM costs one timeout and nothing more.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import train_arpo as T  # noqa: E402
from grpo import ReplayBuffer  # noqa: E402
from conftest import proc_alive as alive, proc_children as children, proc_group as group_pids  # noqa: E402
from env import VMPool  # noqa: E402
from model import load_policy  # noqa: E402
from env import load_tasks  # noqa: E402

SMALL = 64 * 28 * 28
TASK = {"id": "notes-there", "instruction": "Look at the notes.", "setup": [], "max_steps": 3,
        "evaluator": {"conj": "and", "checks": [{"type": "file_exists", "path": "notes.txt"}]}}


def arpo_faults(timeout: float, tasks_dir: str) -> dict:
    args = T.Args(vms="4", group_size=2, model="tiny", max_steps=3, max_pixels=SMALL, max_new_tokens=8,
                  vm_timeout=timeout, lr=1e-3, settle=0.1, stop_on_format_error=False, tasks=tasks_dir)
    pool = VMPool(4, timeout=timeout)
    try:
        policy = load_policy("tiny", seed=0, max_pixels=SMALL)
        opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
        model_fn = T.model_policy(policy, args, 1.0)
        tr = T.Trainer(args, pool, policy, opt, ReplayBuffer(), model_fn, None, load_tasks(tasks_dir))
        pick = lambda n: ["notes-there"] * n  # noqa: E731
        T.iteration(tr, 0, pick)  # the first one warms up (model, desktops): not the yardstick
        t = time.perf_counter()
        T.iteration(tr, 1, pick)
        clean = time.perf_counter() - t
        killed, frozen, fired = pool.local[1].proc.pid, pool.local[2].proc.pid, []

        def faulty(obs):
            if not fired and any(o.step == 1 for o in obs):
                fired.extend(group_pids(killed) + group_pids(frozen))
                os.killpg(killed, signal.SIGKILL)
                os.killpg(frozen, signal.SIGSTOP)
            return model_fn(obs)
        tr.policy_fn = faulty
        t = time.perf_counter()
        m1, _ = T.iteration(tr, 2, pick)
        faulty_s = time.perf_counter() - t
        tr.policy_fn = model_fn
        t = time.perf_counter()
        m2, _ = T.iteration(tr, 3, pick)
        restarted = time.perf_counter() - t
        time.sleep(2)
        left = [p for p in fired if alive(p)]
        return {"timeout": timeout, "clean": clean, "faulty": faulty_s, "restarted": restarted,
                "dropped": m1["dropped"], "trained": sorted(b["vm"] for b in m1["batch"]),
                "after": (m2["episodes"], m2["dropped"]), "left": left}
    finally:
        pool.close()


def explore_faults(iterations: int, run: str) -> dict:
    cmd = [sys.executable, os.path.join(ROOT, "train_explore.py"), "--vms", "4", "--model", "tiny",
           "--iterations", str(iterations), "--steps", "8", "--max-pixels", "12544", "--max-new-tokens", "8",
           "--threads", "1", "--settle", "0.3", "--vm-timeout", "8", "--update-actor-delay", "0", "--run-name", run]
    # Output to a file, not a pipe we only read at the end: a full pipe would stall the trainer.
    log = tempfile.TemporaryFile("w+")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    metrics = os.path.join(run, "metrics.jsonl")
    victims = []
    try:
        deadline = time.time() + 300
        while p.poll() is None and time.time() < deadline:
            n = sum(1 for _ in open(metrics)) if os.path.exists(metrics) else 0
            if n >= 2:
                break
            time.sleep(0.05)
        # into iteration 2's rollout (8 steps): past its reset (as long as the earlier ones took) + 1 s
        time.sleep(max(json.loads(x).get("time/reset", 0) for x in open(metrics)) + 1.0)
        servers = [c for c in children(p.pid) if b"vm_server.py" in open(f"/proc/{c}/cmdline", "rb").read()]
        victims = [(servers[1], group_pids(servers[1])), (servers[2], group_pids(servers[2]))]
        os.killpg(servers[1], signal.SIGKILL)
        os.killpg(servers[2], signal.SIGSTOP)
        p.wait(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
        for pgid, _ in victims:  # whatever happened, wake the frozen one so the trainer's stop reaches it
            try:
                os.killpg(pgid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    time.sleep(2)
    log.seek(0)
    out = log.read()
    lines = [json.loads(x) for x in open(metrics)] if os.path.exists(metrics) else []
    return {"rc": p.returncode, "lines": lines, "left": [x for _, g in victims for x in g if alive(x)],
            "tail": out[-1500:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeouts", default="5,10,20", help="--vm-timeout values for the ARPO part")
    ap.add_argument("--explore-iterations", type=int, default=5)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="vm_faults-")
    os.makedirs(os.path.join(tmp, "tasks"))
    with open(os.path.join(tmp, "tasks", "t.json"), "w") as f:
        json.dump(TASK, f)
    rows = [arpo_faults(float(t), os.path.join(tmp, "tasks")) for t in a.timeouts.split(",") if t]
    print("train_arpo.iteration, 4 desktops (groups [0,1], [2,3]); VM 1 SIGKILLed + VM 2 SIGSTOPped at step 1")
    print(f"{'timeout s':>9} {'clean s':>8} {'faulty s':>9} {'extra s':>8} {'extra/T':>8} {'restarted s':>12} "
          f"{'dropped':>8} {'trained on':>11} {'next it (eps, dropped)':>23} {'procs left':>10}")
    for r in rows:
        extra = r["faulty"] - r["clean"]
        print(f"{r['timeout']:>9.0f} {r['clean']:>8.1f} {r['faulty']:>9.1f} {extra:>8.1f} {extra / r['timeout']:>8.2f} "
              f"{r['restarted']:>12.1f} {r['dropped']:>8} {str(r['trained']):>11} {str(r['after']):>23} {len(r['left']):>10}")
    e = explore_faults(a.explore_iterations, os.path.join(tmp, "explore"))
    print(f"train_explore.py --vms 4, VM 1 SIGKILLed + VM 2 SIGSTOPped in iteration 2's rollout (--vm-timeout 8): "
          f"exit {e['rc']}, iterations completed {len(e['lines'])}/{a.explore_iterations}, processes left {len(e['left'])}")
    for m in e["lines"]:
        print(f"  it {m['iteration']}: {m['vms']} desktops, {m['steps']} steps, {m['time/iteration']:.1f} s "
              f"(reset {m.get('time/reset', 0):.1f} s)")
    if e["rc"] != 0:
        print(e["tail"])
    if rows:
        r = rows[-1]
        print(f"vm_fault_extra_per_timeout_s: {(r['faulty'] - r['clean']) / r['timeout']:.2f}")


if __name__ == "__main__":
    main()
