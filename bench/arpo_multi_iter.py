"""Benchmark: one two-step ARPO iteration on the two-step learning bench's own setting, before and now.

    python bench/arpo_multi_iter.py                 # builds seed 0's warm start first (about 75 s)
    python bench/arpo_multi_iter.py --model runs/learning/arpo-multi/seed0/warm_start --blocks 3 --block 20
    python bench/arpo_multi_iter.py --model tiny --vms 2 --blocks 1 --block 2   # a smoke run (tests/test_learning.py)

The setting is `bench/learning.py --method arpo-multi`'s, its flags as it passes them (4 local
desktops, one group of 4 a task, episodes of 2 steps with both screenshots in the prompt, 48 new
tokens, 15 visual tokens a screenshot, the watched settle, lr 3e-4, trajectories saved every
iteration as train_arpo.py does by default), and its warm start (learning_warm.warm_start_multi),
so the actions open real windows as in a bench run. One process, one trainer: blocks of --block
iterations alternate between the two ways (before, now, before, now, ...), so both see the same
desktops, the same load and the same policy as it trains.

  before  torch computes on every core (2 here), next to the desktops; every screenshot is encoded
          as PNG again where it is stored (the trajectory files, the replay buffer); and an
          episode's last action answers with its settled screen, sent and decoded though nothing
          looks at it (its evaluation is all that follows)
  now     torch on half the cores on a CPU run (rundir.cpu_threads, as train_explore.py already
          did: OpenMP threads spin while they wait, on the cores the desktops need); a screenshot
          stored as the PNG the VM sent (env.png_bytes: the same pixels, PNG is lossless); the
          last action settles but answers no screen (rollout.Desktop.act)

What the model sees and how a task scores are the same both ways: the same screenshots reach the
model (tests/test_env.py: png_bytes gives back the bytes that decode to the very pixels), and the
last action still settles before the evaluation. The learning bench's passes before and after
are in docs/log.md.

Columns, per iteration (median over the blocks' iterations, the run's first excluded: warm-ups):
  iteration   wall seconds, its trajectories and metrics line included (what a run's minutes are)
  generate / update / vm / save
              train_arpo's time/generation, time/update, time/vm_wait (the learner idle), time/save
  cpu         CPU seconds of the whole machine (/proc/stat: the trainer, the desktops, their apps)
Last line: `arpo_multi_iter: before <s> now <s> per iteration: <ratio>x (cpu <ratio>x)`.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import env  # noqa: E402
import learning  # noqa: E402
import rollout  # noqa: E402
import train_arpo  # noqa: E402
from plumbing import logs, rundir  # noqa: E402


def machine_cpu() -> float:
    """CPU seconds every process of this machine has used so far (the first line of /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def before_way():
    """The code as it was: torch on every core, screenshots decoded without keeping their PNG (so
    png_bytes encodes them again), and every action answering with its screen."""
    decode, act = env.decode_image, rollout.Desktop.act
    torch.set_num_threads(os.cpu_count() or 1)  # torch's own default, which train_arpo.py kept

    def plain_decode(data):
        img = env.Image.open(env.BytesIO(data))
        img.load()
        return img if img.mode == "RGB" else img.convert("RGB")

    env.decode_image = plain_decode
    rollout.Desktop.act = lambda self, action, settle, screenshot=True: act(self, action, settle, True)
    try:
        yield
    finally:
        env.decode_image, rollout.Desktop.act = decode, act


@contextlib.contextmanager
def now_way():
    """The code as it is (train_arpo.main's thread count on a CPU)."""
    rundir.cpu_threads(None, on_gpu=False)
    yield


WAYS = {"before": before_way, "now": now_way}
COLUMNS = (("generate", "time/generation"), ("update", "time/update"), ("vm", "time/vm_wait"), ("save", "time/save"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="", help="a warm start folder (default: build seed 0's, about 75 s)")
    p.add_argument("--blocks", type=int, default=3, help="blocks of each way (alternating)")
    p.add_argument("--block", type=int, default=20, help="iterations a block")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vms", type=int, default=4, help="local desktops (the bench's 4; fewer for a smoke run)")
    a = p.parse_args()
    bench = learning.resolve(learning.parse_args(["--method", "arpo-multi", "--vms", str(a.vms)]))  # its recipe
    tmp = tempfile.mkdtemp(prefix="arpo_iter_")
    model = a.model
    if not model:
        model = os.path.join(tmp, "warm_start")
        w = learning.warm_start_multi(model, a.seed, learning.MULTI_TASK_IDS.split(","), bench.warm_epochs, bench.warm_lr)
        print(f"warm start: {w['seconds']:.0f} s", flush=True)
    total = 2 * a.blocks * a.block
    argv = ["--model", model, "--task-ids", learning.MULTI_TASK_IDS, *learning.common_flags(bench),
            "--iterations", str(total), "--lr", str(bench.lr), "--lr-warmup", str(max(1, total // 10)),
            "--lr-schedule", bench.lr_schedule, "--format-penalty", str(bench.format_penalty),
            "--format-penalty-on", bench.format_penalty_on, "--seed", str(a.seed), "--runs-dir", tmp,
            "--run-name", "train"]
    args, _, _ = train_arpo.resolve_args(argv)
    tasks = train_arpo.load_task_list(args)
    run = os.path.join(tmp, "train")
    rundir.make_run_dir(run, args)
    policy = train_arpo.make_policy(args, None)
    pool, _, _ = rundir.open_desktops(args.vms, args.token, args.vm_timeout, train_arpo.screen_size(args))
    rows = {name: [] for name in WAYS}
    try:
        tr, _ = train_arpo.setup(args, pool, policy, run, None, tasks)
        ids = [t.id for t in tr.tasks]
        trackers = rundir.open_trackers(run, args)
        it = 0
        for b in range(2 * a.blocks):
            name = list(WAYS)[b % 2]
            with WAYS[name]():
                for _ in range(a.block):
                    t0, c0 = time.perf_counter(), machine_cpu()
                    m, eps = train_arpo.iteration(tr, it, lambda n: train_arpo.pick_tasks(ids, tr.picker, n, args.seed))
                    with rundir.timed(m, "save"):
                        logs.save_episodes(run, it, eps)
                    rundir.end_iteration(run, trackers, m, logs.arpo_line(m, args.beta))
                    if it > 0:
                        rows[name].append({**{k: m.get(key, 0.0) for k, key in COLUMNS},
                                           "iteration": time.perf_counter() - t0, "cpu": machine_cpu() - c0})
                    it += 1
    finally:
        pool.close()
    print(f"\n{'':8}" + "".join(f"{c:>11}" for c in ("iteration", "generate", "update", "vm", "save", "cpu")))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
    for name, m in med.items():
        print(f"{name:8}" + "".join(f"{m[c]:11.3f}" for c in ("iteration", "generate", "update", "vm", "save", "cpu"))
              + f"   ({len(rows[name])} iterations)")
    b, n = med["before"], med["now"]
    print(f"arpo_multi_iter: before {b['iteration']:.3f} s now {n['iteration']:.3f} s per iteration: "
          f"{b['iteration'] / n['iteration']:.2f}x (cpu {b['cpu'] / n['cpu']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
