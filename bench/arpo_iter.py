"""Benchmark: an ARPO iteration's wall time and the learner's idle share, watched settle vs fixed sleeps.

    python bench/arpo_iter.py                                   # 8 desktops, groups of 4, tiny model
    python bench/arpo_iter.py --settles watch,2.0,0.5 --iterations 5 --vms 8
    python bench/arpo_iter.py --vms 4 --iterations 1 --max-steps 3     # a small sanity run

Runs real `train_arpo.iteration`s (rollout.py's stepper: each desktop resets, sets up, plays and
is scored on its own thread while generation batches whatever observations are waiting; then the
GRPO update) with the tiny Qwen2.5-VL on CPU, once per --settle setting per round, the settings
taking turns so machine noise falls on all of them alike (after one warm-up iteration: the first
generate and update are slow). Per setting, side by side:
    iteration  the median wall seconds of an iteration
    VM wait    the learner's idle share, sum(time/vm_wait) / sum(time/iteration): the part of the
               iteration the main thread had nothing to generate or update (no observation was
               waiting, or it held some back for the gather window). In the old lockstep loop every
               VM phase was idle time, so this is the number that loop reported as its VM-wait share
               (docs/log.md has what it was).
    gen, upd   seconds the learner computed: generation (in policy_fn), the update
    batch      mean observations per policy call
    per desktop  seconds each desktop spent in reset + setup, act + settle + screenshot, evaluate
               (they overlap each other and generation)
and the ratio of each setting's iteration time to the fixed 2.0 s one. Targets (a quiet machine):
VM wait <= 0.35 with the watched settle, and its iteration <= 0.5x the fixed 2.0 s one.

`--act random` (default): the model generates as usual (real compute, real token ids), but its
answer is replaced by a random valid UI-TARS action (click / scroll / type / hotkey), so every step
acts on the desktop as a trained agent's would; the random-weight model's own answers never parse,
so with `--act model` no step acts and the VM side is only screenshots.
Caveat: the compute side here is a ~0.3M-parameter model on a shared CPU; with a 7B model on a GPU
both sides change. The numbers describe this machine, not a GPU run.
Last line: `arpo_iter: watch <s> s (VM wait <share>) | 2.0 <s> s (...) | ... | watch / 2.0 = <ratio>`.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from plumbing import logs  # noqa: E402
import train_arpo as T  # noqa: E402
from grpo import ReplayBuffer  # noqa: E402
from env import VMPool  # noqa: E402
from model import load_policy  # noqa: E402
from env import SETTLE_HELP, parse_settle  # noqa: E402
from env import load_tasks  # noqa: E402


def acting(policy_fn, seed: int):
    """Wrap the model's policy_fn: keep its generation (the compute), swap in a random valid action."""
    rng = random.Random(seed)

    def fn(observations):
        gens = policy_fn(observations)
        for g, o in zip(gens, observations):
            x, y = rng.randrange(o.image_size[0]), rng.randrange(o.image_size[1])
            act = rng.choice([f"click(start_box='({x},{y})')", f"scroll(start_box='({x},{y})', direction='down')",
                              "type(content='hello')", "hotkey(key='ctrl a')"])
            g.text = f"Thought: Look around.\nAction: {act}"
        return gens
    return fn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vms", type=int, default=8)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--settles", default="watch,2.0,0.5", help="--settle settings to compare, comma-separated")
    p.add_argument("--iterations", type=int, default=3, help="measured iterations per setting")
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-pixels", type=int, default=256 * 28 * 28, help="~256 visual tokens per screenshot")
    p.add_argument("--act", choices=["random", "model"], default="random")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    settles = [s.strip() for s in a.settles.split(",") if s.strip()]
    if any(parse_settle(s) is None for s in settles):  # now, not after the desktops started
        sys.exit(f"--settles: {SETTLE_HELP}, e.g. watch,2.0,0.5.")

    args = T.Args(vms=str(a.vms), group_size=a.group_size, model="tiny", max_steps=a.max_steps,
                  max_new_tokens=a.max_new_tokens, max_pixels=a.max_pixels, stop_on_format_error=False,
                  iterations=a.iterations, seed=a.seed, lr=1e-5)
    tasks = load_tasks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks"))
    policy = load_policy("tiny", seed=a.seed, max_pixels=a.max_pixels)
    t0 = time.perf_counter()
    pool = VMPool(a.vms, timeout=args.vm_timeout)
    print(f"{a.vms} local desktops up in {time.perf_counter() - t0:.1f} s; {a.iterations} iteration(s) per setting "
          f"{settles}, groups of {a.group_size}, up to {a.max_steps} steps, actions: {a.act}", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in settles}
    try:
        opt = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
        fn = T.model_policy(policy, args, args.temperature)
        tr = T.Trainer(args, pool, policy, opt, ReplayBuffer(), acting(fn, a.seed) if a.act == "random" else fn,
                       None, tasks)
        picker, ids = {"epoch": 0, "pos": 0}, [t.id for t in tasks]
        # One warm-up iteration (the first generate and update are slow), then the settings in turns.
        plan = [(settles[0], True)] + [(s, False) for _ in range(a.iterations) for s in settles]
        for it, (s, warm_up) in enumerate(plan):
            tr.args = replace(args, settle=s)
            m, _ = T.iteration(tr, it, lambda n: T.pick_tasks(ids, picker, n, a.seed))
            if not warm_up:
                runs[s].append(m)
            print(f"[settle {s}{' warm-up' if warm_up else ''}] {logs.arpo_line(m)}", flush=True)
    finally:
        pool.close()

    def total(ms, k):
        return sum(m.get(k, 0.0) for m in ms)
    rows = {}
    for s, ms in runs.items():
        rows[s] = {"iteration": statistics.median(m["time/iteration"] for m in ms),
                   "vm_wait": total(ms, "time/vm_wait") / total(ms, "time/iteration"),
                   "gen": total(ms, "time/generation") / len(ms), "upd": total(ms, "time/update") / len(ms),
                   "batch": statistics.mean(m["rollout/batch_mean"] for m in ms),
                   "steps": statistics.mean(m["steps_mean"] for m in ms),
                   "reset": total(ms, "time/reset") / len(ms), "env": total(ms, "time/env") / len(ms),
                   "evaluate": total(ms, "time/evaluate") / len(ms),
                   "failures": sum(m["env_failures"] for m in ms)}
    base = next((s for s in settles if s != "watch" and parse_settle(s) == 2.0), None)
    print(f"\n{'settle':>8s} {'iteration':>10s} {'VM wait':>8s} {'gen':>6s} {'upd':>6s} {'batch':>6s} {'steps':>6s} "
          f"{'reset':>6s} {'env':>6s} {'eval':>6s} {'failed':>6s} {'vs 2.0':>7s}   (seconds; reset/env/eval per desktop)")
    for s, x in rows.items():
        ratio = f"{x['iteration'] / rows[base]['iteration']:.2f}x" if base else "-"
        print(f"{s:>8s} {x['iteration']:10.2f} {x['vm_wait']:8.2f} {x['gen']:6.2f} {x['upd']:6.2f} {x['batch']:6.1f} "
              f"{x['steps']:6.1f} {x['reset']:6.2f} {x['env']:6.2f} {x['evaluate']:6.2f} {x['failures']:6d} {ratio:>7s}")
    line = " | ".join(f"{s} {x['iteration']:.2f} s (VM wait {x['vm_wait']:.2f})" for s, x in rows.items())
    if base and "watch" in rows:
        line += f" | watch / {base} = {rows['watch']['iteration'] / rows[base]['iteration']:.2f}"
    print(f"arpo_iter: {line}")


if __name__ == "__main__":
    main()
