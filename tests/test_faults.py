"""VM faults in the middle of a real training iteration: one desktop killed, one frozen.

Run: python -m pytest -q -s tests/test_faults.py        (~1 min; 4 local Xvfb desktops)

train_arpo.py's own `iteration` (reset, setup, rollout, evaluate, replay, GRPO update) runs with
the tiny real Qwen2.5-VL on 4 local desktops in 2 groups of 2. In the middle of the rollout (while
the model answers step 1) desktop 1 is killed (SIGKILL to its vm_server's process group) and
desktop 2 is frozen (SIGSTOP to its process group: it accepts connections and never answers). Must
hold: the frozen desktop costs the iteration one --vm-timeout and no more (one call to it expires,
no call goes to it after that; the killed one fails on its broken connection, no timeout at all;
each desktop's calls run in its own thread, so the others' episodes never wait for them); both
drop out of their groups and nothing of theirs is trained on; the update still runs on the other
two; the next iteration restarts both desktops (the frozen one is woken and stopped, no process
left behind) and plays on all 4. The figures (clean / faulty / restarted iteration times against
the timeout) are printed, not asserted; `python bench/vm_faults.py` measures them, and also runs
train_explore.py as a subprocess with a desktop killed and one frozen from outside.
"""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

import train_arpo as T
from grpo import ReplayBuffer
from conftest import proc_alive, proc_group
from env import VMPool
from model import load_policy
from env import load_tasks

SMALL = 64 * 28 * 28
VM_TIMEOUT = 8.0


@pytest.fixture
def trainer(tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "t.json").write_text(json.dumps({
        "id": "notes-there", "instruction": "Look at the notes.", "setup": [{"type": "sleep", "seconds": 0}],
        "max_steps": 3, "evaluator": {"conj": "and", "checks": [{"type": "file_exists", "path": "notes.txt"}]}}))
    args = T.Args(vms="4", group_size=2, model="tiny", max_steps=3, max_pixels=SMALL, max_new_tokens=8,
                  vm_timeout=VM_TIMEOUT, lr=1e-3, settle=0.1, stop_on_format_error=False, tasks=str(tasks),
                  mini_batch=4)  # one optimizer step per iteration: the step counts below assume it
    pool = VMPool(4, timeout=VM_TIMEOUT)
    policy = load_policy("tiny", seed=0, max_pixels=SMALL)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, policy, opt, ReplayBuffer(), T.model_policy(policy, args, 1.0), None,
                   load_tasks(tasks))
    yield tr
    pool.close()


def test_a_killed_and_a_frozen_vm_mid_iteration(trainer):
    tr, pick = trainer, (lambda n: ["notes-there"] * n)
    pool, model_fn, faults = tr.pool, tr.policy_fn, {}

    def steps(opt):
        return int(max(float(s["step"]) for s in opt.state_dict()["state"].values())) if opt.state_dict()["state"] else 0

    # 0. a warm-up iteration (the first generate and update are slow), then a clean one: the yardstick
    T.iteration(tr, 0, pick)
    t = time.perf_counter()
    m0, _ = T.iteration(tr, 1, pick)
    clean = time.perf_counter() - t
    assert (m0["episodes"], m0["dropped"]) == (4, 0) and steps(tr.optimizer) == 2

    # 1. the faults, while the model answers step 1 (after the step-1 screenshots, before the actions)
    killed, frozen = pool.local[1].proc.pid, pool.local[2].proc.pid  # one in each group: [0, 1], [2, 3]

    def faulty(observations):
        if not faults and any(o.step == 1 for o in observations):
            faults["killed"], faults["frozen"] = proc_group(killed), proc_group(frozen)
            os.killpg(killed, signal.SIGKILL)
            os.killpg(frozen, signal.SIGSTOP)
            faults["at"] = time.perf_counter()
        return model_fn(observations)
    tr.policy_fn = faulty
    calls, pool_call = [], pool.call  # every VM call of the iteration: (call, VM, its error or None)

    def logged_call(i, fn_name, *args, **kwargs):
        try:
            res = pool_call(i, fn_name, *args, **kwargs)
        except Exception as e:
            calls.append((fn_name, i, str(e)))
            raise
        calls.append((fn_name, i, None))
        return res
    pool.call = logged_call
    t = time.perf_counter()
    m1, eps = T.iteration(tr, 2, pick)
    faulty_s = time.perf_counter() - t
    tr.policy_fn = model_fn
    del pool.call
    assert faults, "the faults never fired: the rollout did not reach step 1"
    assert eps[1].end == "dropped" and eps[2].end == "dropped", [(e.vm, e.end, e.error) for e in eps]
    assert "frozen" in eps[2].error or "within" in eps[2].error, eps[2].error  # dropped by the deadline
    assert [e.end for e in (eps[0], eps[3])] == ["max_steps", "max_steps"] and eps[0].score == eps[3].score == 1.0
    assert (m1["episodes"], m1["dropped"]) == (2, 2)
    # both groups go on with their one survivor; only survivors are trained on, and the update ran
    assert [(g["group"], g["n"]) for g in m1["groups"]] == [(0, 1), (1, 1)]
    assert sorted(b["vm"] for b in m1["batch"]) == [0, 3] and m1["actor/tokens"] > 0
    assert steps(tr.optimizer) == 3
    # One call waited out the timeout, the frozen VM's ("<url> did not answer within ..."), and no
    # call went to it after that; the killed one failed at once (a refused connection) and was not
    # called again either. Each VM's thread did its own calls: nobody else waited for them.
    expired = [(fn, i) for fn, i, e in calls if e and "did not answer within" in e]
    assert expired and [i for _, i in expired] == [2], calls
    for vm in (1, 2):
        mine = [e for _, i, e in calls if i == vm]
        assert mine[-1] is not None and all(e is None for e in mine[:-1]), (vm, mine)
    assert "did not answer within" not in next(e for _, i, e in calls if i == 1 and e)
    assert not pool.alive[1] and not pool.alive[2]
    assert m1["env_failures"] == 2 and sorted(m1["env_errors"]) == ["1", "2"]

    # 2. the next iteration restarts both desktops and plays on all 4
    t = time.perf_counter()
    m2, eps = T.iteration(tr, 3, pick)
    restarted = time.perf_counter() - t
    assert (m2["episodes"], m2["dropped"]) == (4, 0) and all(pool.alive)
    assert pool.local[1].proc.pid != killed and pool.local[2].proc.pid != frozen
    assert steps(tr.optimizer) == 4
    deadline = time.time() + 10  # the old desktops are gone: nothing killed or frozen is left behind
    while any(map(proc_alive, faults["killed"] + faults["frozen"])) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in faults["killed"] + faults["frozen"] if proc_alive(p)]
    print(f"\nvm faults (4 desktops, --vm-timeout {VM_TIMEOUT:g} s): clean iteration {clean:.1f} s, "
          f"iteration with 1 killed + 1 frozen VM {faulty_s:.1f} s (+{faulty_s - clean:.1f} s), "
          f"next iteration with both restarted {restarted:.1f} s; iterations completed 4/4")
