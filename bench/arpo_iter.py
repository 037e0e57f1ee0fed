"""Benchmark: where an ARPO iteration's wall time goes, VM waits vs compute, on local desktops.

    python bench/arpo_iter.py                         # 8 desktops, groups of 4, 2 iterations, tiny model
    python bench/arpo_iter.py --act model --iterations 1

Runs real `train_arpo.run_iteration`s (reset + setup, lockstep rollout, evaluation, GRPO update) with
the tiny Qwen2.5-VL on CPU and splits each iteration's wall time into
    VM waits: reset/setup, env steps (screenshots + actions), evaluation
    compute:  generation, update (re-encoding + forward/backward + optimizer step)
and reports the ideal overlap: how much faster an iteration would be if VM waits and compute
overlapped perfectly, wall / max(vm_time, compute_time) (ARPO's rollout is lockstep too: the
generator waits for the slowest VM at every step, and the VMs wait for the generator).

`--act random` (default): the model generates as usual (real compute, real token ids), but its
answer is replaced by a random valid UI-TARS action (click / scroll / type / hotkey), so every step
acts on the desktop as a trained agent's would; the random-weight model's own answers never parse,
so with `--act model` no step acts and the VM side is only screenshots.
Caveat: the compute side here is a ~0.3M-parameter model on a shared 2-core CPU; with a 7B model on a
GPU both sides change. The numbers describe this machine, not a GPU run.
Last line: `arpo_vm_wait_share: <share of wall time spent waiting on VMs>`.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import train_arpo as T  # noqa: E402
from env import VMPool, load_tasks  # noqa: E402
from grpo import ReplayBuffer  # noqa: E402
from model import load_policy  # noqa: E402

PHASES = [("reset", "vm", "reset + task setup"), ("env", "vm", "env steps (screenshots + actions)"),
          ("evaluate", "vm", "evaluation"), ("generation", "compute", "generation"),
          ("update", "compute", "update")]


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
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--max-pixels", type=int, default=256 * 28 * 28, help="~256 visual tokens per screenshot")
    p.add_argument("--act", choices=["random", "model"], default="random")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    args = T.Args(vms=str(a.vms), group_size=a.group_size, model="tiny", max_steps=a.max_steps,
                  max_new_tokens=a.max_new_tokens, max_pixels=a.max_pixels, stop_on_format_error=False,
                  iterations=a.iterations, seed=a.seed, lr=1e-5)
    tasks = load_tasks(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tasks"))
    policy = load_policy("tiny", seed=a.seed, max_pixels=a.max_pixels)
    t0 = time.perf_counter()
    pool = VMPool(a.vms, timeout=args.vm_timeout)
    print(f"{a.vms} local desktops up in {time.perf_counter() - t0:.1f} s; {a.iterations} iteration(s), "
          f"groups of {a.group_size}, up to {a.max_steps} steps, actions: {a.act}")
    try:
        opt = torch.optim.AdamW(policy.model.parameters(), lr=args.lr)
        fn = T.model_policy(policy, args, args.temperature)
        tr = T.Trainer(args, pool, policy, opt, ReplayBuffer(), acting(fn, a.seed) if a.act == "random" else fn,
                       None, tasks)
        picker, ids, ms = {"epoch": 0, "pos": 0}, [t.id for t in tasks], []
        for it in range(a.iterations):
            m, _ = T.run_iteration(tr, it, lambda n: T.pick_tasks(ids, picker, n, a.seed))
            ms.append(m)
            print(T.summary_line(m), flush=True)
    finally:
        pool.close()

    total = {k: sum(m[f"time/{k}"] for m in ms) for k, _, _ in PHASES}
    wall = sum(m["time/iteration"] for m in ms)
    vm = sum(total[k] for k, side, _ in PHASES if side == "vm")
    compute = sum(total[k] for k, side, _ in PHASES if side == "compute")
    steps = sum(m["steps_mean"] * m["episodes"] for m in ms)
    print(f"\n{'phase':38s} {'seconds':>8s} {'share':>6s}")
    for k, side, label in PHASES:
        print(f"{label + ' [' + side + ']':38s} {total[k]:8.1f} {total[k] / wall:6.1%}")
    print(f"{'other (grouping, bookkeeping)':38s} {wall - vm - compute:8.1f} {(wall - vm - compute) / wall:6.1%}")
    print(f"{'wall':38s} {wall:8.1f}   ({steps:.0f} agent steps, {wall / max(steps, 1):.2f} s per step)")
    print(f"waiting on VMs {vm:.1f} s ({vm / wall:.1%}), computing {compute:.1f} s ({compute / wall:.1%})")
    print(f"ideal overlap: wall / max(vm, compute) = {wall:.1f} / {max(vm, compute):.1f} = "
          f"{wall / max(vm, compute):.2f}x faster if VM waits and compute overlapped perfectly")
    print(f"arpo_vm_wait_share: {vm / wall:.3f}")


if __name__ == "__main__":
    main()
