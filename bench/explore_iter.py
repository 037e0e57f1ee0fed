"""Benchmark: where one ScreenExplorer iteration's wall time goes, for 2 and 8 local desktops.

    python bench/explore_iter.py                          # N = 2, 8; 3 iterations of 10 steps each
    python bench/explore_iter.py --ns 8 --iterations 4 --rewards all,no_text,no_intent,no_intent_click
    python bench/explore_iter.py --ns 8 --iterations 6 --against all,no_text,no_intent,no_intent_click
                                  # the paper's reward against the image terms alone, one run after the other

With --against R2, each N runs twice, --rewards and then R2, on the same model and settings; the
last line is the ratio of their median iteration times at the largest N (`explore_text_cost_8vms:
all / image 1.83`: what the OCR text and intent terms cost an iteration, all included).

Each N runs the real `train_explore.py --vms N` as a subprocess (tiny Qwen2.5-VL on the CPU, every
reward component on, the actor updated every iteration) and reads the per-phase timings it logs in
metrics.jsonl. Screenshots reach the model at --max-pixels (default 12544: 140x84, 15 visual tokens).
The model is the tiny one fine-tuned for a few seconds to answer in the explore
format (tests/test_train_explore.py's `speaking_tiny`), so actions really execute and the OCR,
world model and update see real valid steps; the untrained tiny model would fail the format on
every step and skip most of that work.

Columns (seconds per iteration, median over the iterations after the first, which pays warm-ups):
  vm        the learner idle, waiting on the desktops (time/vm_wait: they step on their own threads,
            rollout.py, so this is what their screenshots, actions, settle and resets cost the
            learner, not their sum)
  generate  the batched generates                   features  screen features + OCR + embedder
  wm        world-model training (3 epochs)        update    GRPO update          save  trajectories + checkpoint
vm share = vm / iteration. On a GPU, generate and update shrink by orders of magnitude while vm and
OCR do not, so the share printed here (CPU, tiny model) understates how much a real run waits on
VMs and OCR. Last line: the vm share at the largest N.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/test_train_explore.py imports conftest

import transformers  # noqa: E402

from tests.test_train_explore import speaking_tiny  # noqa: E402

transformers.utils.logging.disable_progress_bar()

PHASES = {"vm": ("time/vm_wait",), "generate": ("time/generation",),
          "features": ("time/features",), "wm": ("time/world_model",), "rewards": ("time/rewards",),
          "update": ("time/update", "time/sync"), "save": ("time/save",)}


def run_one(n: int, model: str, a, folder: str, rewards: str) -> list[dict]:
    """One train_explore.py run with n desktops and these reward terms; its metrics lines."""
    run = os.path.join(folder, f"vms{n}-{len(os.listdir(folder))}")
    cmd = [sys.executable, os.path.join(ROOT, "train_explore.py"), "--vms", str(n), "--model", model,
           "--iterations", str(a.iterations), "--steps", str(a.steps), "--update-actor-delay", "0",
           "--settle", str(a.settle), "--max-new-tokens", str(a.max_new_tokens), "--rewards", rewards,
           "--max-pixels", str(a.max_pixels), "--run-name", run]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"train_explore.py --vms {n} failed: {p.stderr.strip()[-500:]}")
    print(f"  vms {n}: {time.perf_counter() - t0:.0f} s in all (startup included)", flush=True)
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", default="2,8", help="desktop counts to compare")
    p.add_argument("--iterations", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--settle", default="watch", help="watch, or seconds of a fixed sleep (the release: 1)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-pixels", type=int, default=12544,
                   help="screenshot size for the model (the tiny model is taught to speak at this size)")
    p.add_argument("--rewards", default="all")
    p.add_argument("--against", default="", help="a second --rewards, run after the first at every N")
    a = p.parse_args()
    ns = [int(x) for x in a.ns.split(",")]
    kinds = [a.rewards] + ([a.against] if a.against else [])
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        model = speaking_tiny(os.path.join(folder, "speaker"), max_pixels=a.max_pixels)
        print(f"format-speaking tiny model: {time.perf_counter() - t0:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
        rows = {}
        for n in ns:
            for rewards in kinds:
                lines = run_one(n, model, a, folder, rewards)
                use = lines[1:] or lines  # the first iteration pays model and OCR warm-ups
                med = lambda keys: statistics.median(sum(m.get(k, 0.0) for k in keys) for m in use)  # noqa: E731
                r = rows[(n, rewards)] = {name: med(keys) for name, keys in PHASES.items()}
                r["iteration"] = med(("time/iteration",))
                r["steps"] = statistics.median(m["steps"] for m in use)
                r["format"] = statistics.median(m["reward/format"] for m in use)
    cols = ["iteration", *PHASES, "steps", "format"]
    print(f"{'vms':>4s}" + "".join(f"{c:>10s}" for c in cols) + f"{'vm share':>10s}{'s/step':>10s}  rewards")
    for (n, rewards), r in rows.items():
        print(f"{n:4d}" + "".join(f"{r[c]:10.2f}" for c in cols)
              + f"{r['vm'] / r['iteration']:10.2f}{r['iteration'] / max(r['steps'], 1):10.3f}  {rewards}")
    n = max(ns)
    print(f"explore_vm_share_{n}vms: {rows[(n, a.rewards)]['vm'] / rows[(n, a.rewards)]['iteration']:.3f}")
    if a.against:
        print(f"explore_text_cost_{n}vms: {a.rewards} / {a.against} "
              f"{rows[(n, a.rewards)]['iteration'] / rows[(n, a.against)]['iteration']:.2f}")


if __name__ == "__main__":
    main()
