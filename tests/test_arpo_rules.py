"""The rules of train_arpo.py with hand-computed numbers, on no desktop: OSWorld's scores and ARPO's
reward for every ending, the advantages (GRPO, Dr. GRPO, the format penalty on the reward or on the
advantage), tied groups, flat groups, the lr schedule, the task order and groups, the flags, the console line.

    python -m pytest -q tests/test_arpo_rules.py      (~20 s; the tiny model for one real update)

The runs on real desktops are tests/test_train_arpo.py.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plumbing import logs, rundir  # noqa: E402
import train_arpo as T  # noqa: E402
from model import load_policy  # noqa: E402
from env import load_tasks  # noqa: E402

SMALL = 64 * 28 * 28  # screenshots of ~64 visual tokens for the tiny model: fast on CPU
TASKS = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}


def small_args(**kw) -> T.Args:
    base = dict(vms="2", group_size=2, model="tiny", max_steps=2, max_pixels=SMALL, max_new_tokens=8,
                vm_timeout=30.0, lr=1e-3)
    return T.Args(**{**base, **kw})



def test_rewards_and_protocols_by_hand():
    args = small_args(format_penalty=0.5)
    task = TASKS["infeasible-email"]

    def ep(end, actions, ok):
        return T.Episode(task, 0, end=end, actions=actions, format_ok=ok)
    timed_out = ep("max_steps", [{"type": "wait"}, None], [True, False])
    gave_up = ep("fail", [{"type": "wait"}, {"type": "fail"}], [True, True])
    bad_fail = ep("fail", [None, {"type": "fail"}], [False, True])
    formatted = ep("format", [None], [False])
    eps = [timed_out, gave_up, bad_fail, formatted]
    for e in eps:
        T.score_episode(e, None, args)  # infeasible: scored client side, no evaluator score
    # timed out: hard 0 (last action wait), standard 1 (FAIL substituted); reward 0 - 0.5 = -0.5
    assert (timed_out.score, timed_out.score_standard, timed_out.reward) == (0.0, 1.0, -0.5)
    # call_user at the end, all answers parsed: 1 under both; reward 1 - 0 = 1
    assert (gave_up.score, gave_up.score_standard, gave_up.reward) == (1.0, 1.0, 1.0)
    # call_user at the end but one unparseable answer: 1 - 0.5 = 0.5 (the penalty is paid once)
    assert (bad_fail.score, bad_fail.reward) == (1.0, 0.5)
    # ended by an unparseable answer (ARPO: DONE): 0 under both; 0 - 0.5
    assert (formatted.score, formatted.score_standard, formatted.reward) == (0.0, 0.0, -0.5)


@pytest.mark.parametrize("infeasible, actions, end, checks, hard, standard", [
    # feasible, the checks pass (1.0) or half pass (0.5): OSWorld's DesktopEnv.evaluate
    (False, ["click", "done"], "done", 1.0, 1.0, 1.0),       # finished(): the checks decide
    (False, ["click", "done"], "done", 0.5, 0.5, 0.5),
    (False, ["click", "fail"], "fail", 1.0, 0.0, 0.0),       # call_user(): 0 whatever the checks say
    (False, ["click", "click"], "max_steps", 1.0, 1.0, 0.0),  # timeout: standard turns it into FAIL
    (False, ["click", "click"], "max_steps", 0.5, 0.5, 0.0),
    (False, ["click", None], "format", 1.0, 1.0, 1.0),       # unparseable end: no FAIL (ARPO: DONE)
    (False, [], None, 0.0, 0.0, 0.0),
    # infeasible: FAIL is the success; no checks run
    (True, ["wait", "done"], "done", None, 0.0, 0.0),        # claimed success
    (True, ["wait", "fail"], "fail", None, 1.0, 1.0),        # declared infeasible
    (True, ["wait", "wait"], "max_steps", None, 0.0, 1.0),   # timeout: passes standard only
    (True, ["wait", None], "format", None, 0.0, 0.0),
    (True, [], None, None, 0.0, 0.0),                         # did nothing
])
def test_outcome_scores_by_hand(infeasible, actions, end, checks, hard, standard):
    # The pure rule score_episode (and tests/test_tasks.py) use: (hard, standard).
    acts = [None if a is None else {"type": a} for a in actions]
    assert T.outcome_scores(infeasible, acts, end, checks) == (hard, standard)


def test_flat_groups_are_the_ones_the_update_learns_nothing_from():
    # Group 0: rewards 1.0 and 0.99 (std 0.0071, "flat" by ARPO's std < 0.01) still get advantages
    # +-0.707 (0.005 / (0.00707 + eps 1e-6)) and are learned from; group 1 (equal rewards) and group 2 (one member) get 0.
    from grpo import group_advantages
    groups, rewards = [0, 0, 1, 1, 2], [1.0, 0.99, 0.5, 0.5, 1.0]
    adv = group_advantages(rewards, groups).tolist()
    assert adv[:2] == pytest.approx([0.707, -0.707], abs=1e-3) and adv[2:] == [0.0, 0.0, 0.0]
    assert logs.flat_groups(groups, adv) == 2


def test_dr_grpo_advantages_in_a_real_update(tmp_path):
    """--no-scale-rewards (Dr. GRPO): the advantages are reward - group mean, not divided by the std.
    Group 0 rewards [1.0, -0.5]: mean 0.25 -> +0.75 / -0.75 (GRPO: +-0.7071); group 1 [0.5, 0.5]: 0."""
    policy = load_policy("tiny", seed=0, max_pixels=SMALL)
    task = TASKS["calc-open"]
    eps = []
    for g, (r0, r1) in enumerate([(1.0, -0.5), (0.5, 0.5)]):
        for vm, r in enumerate((r0, r1)):  # one-step episodes of the blank screen, answered "finished()"
            e = T.Episode(task, vm, g, screenshots=[Image.new("RGB", (1280, 720))], answers=["Thought: done.\nAction: finished()"],
                          logprobs=[None], reward=r)
            eps.append(e)
    for scale, want in ((False, [0.75, -0.75, 0.0, 0.0]), (True, [0.70711, -0.70711, 0.0, 0.0])):
        args = small_args(scale_rewards=scale, lr=0.0)
        opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
        tr = T.Trainer(args, None, policy, opt, None, None, str(tmp_path), [task])
        adv = T.advantages(eps, args)
        pieces = [T.episode_samples(policy, e, args, x) for e, x in zip(eps, adv)]
        upd = T.update(tr, [p for ps in pieces for p in ps], 0)
        assert adv == pytest.approx(want, abs=1e-4) and [p[0].advantage for p in pieces] == adv
        assert upd["steps"] == 2 and upd["adv_mean"] == pytest.approx(0.0, abs=1e-6)  # ARPO: 2 optimizer steps
    assert rundir.parse_args(T.Args, ["--no-scale-rewards"], T.PROG)[0].scale_rewards is False


def test_lr_schedule_by_hand():
    """lr_at: warm-up lr * (it + 1) / W, then towards 0 at --iterations, never 0 itself."""
    lin = small_args(lr=1.0, lr_warmup=2, lr_schedule="linear", iterations=10)
    # warm-up 0.5, 1.0; then 1 - (it - 2) / 8
    assert [T.lr_at(i, lin) for i in (0, 1, 2, 6, 9)] == [0.5, 1.0, 1.0, 0.5, 0.125]
    cos = small_args(lr=2.0, lr_warmup=0, lr_schedule="cosine", iterations=4)
    # 2 * 0.5 * (1 + cos(pi * it / 4)): 2, 1.7071, 1, 0.2929
    assert [T.lr_at(i, cos) for i in range(4)] == pytest.approx([2.0, 1.70711, 1.0, 0.29289], abs=1e-5)
    const = small_args(lr=3e-4, lr_warmup=3)
    assert [T.lr_at(i, const) for i in (0, 2, 50)] == pytest.approx([1e-4, 3e-4, 3e-4])


def test_sample_seed_drives_sampling_and_leaves_the_task_order():
    rundir.seed_all(0, 7)
    a = torch.rand(3)
    rundir.seed_all(5, 7)  # another --seed, the same --sample-seed
    assert torch.equal(a, torch.rand(3))
    rundir.seed_all(0, None)  # None: sampling follows --seed
    b = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(b, torch.rand(3)) and not torch.equal(a, b)


def test_task_order_and_groups():
    state = {"epoch": 0, "pos": 0}
    ids = ["a", "b", "c"]
    first = T.pick_tasks(ids, state, 2, seed=7) + T.pick_tasks(ids, state, 1, seed=7)
    assert sorted(first) == ids and state == {"epoch": 1, "pos": 0}  # one pass = every task once
    again = {"epoch": 0, "pos": 0}
    assert T.pick_tasks(ids, again, 3, seed=7) == first  # seeded: the same order again
    assert len(T.pick_tasks(ids, state, 5, seed=7)) == 5 and state == {"epoch": 2, "pos": 2}
    # 7 desktops in groups of 3: two groups, one desktop idle; fewer than a group (even a lone
    # desktop): one group, played in turns; none: nothing
    assert T.n_groups(7, 3) == 2 and T.n_groups(6, 3) == 2 and T.n_groups(2, 8) == 1
    assert T.n_groups(1, 8) == 1 and T.n_groups(0, 8) == 0
    # --groups: that many tasks an iteration whatever the desktops (in turns), none without a desktop
    assert T.n_groups(4, 4, groups=3) == 3 and T.n_groups(16, 4, groups=2) == 2 and T.n_groups(0, 4, groups=3) == 0


def test_flags():
    args, given = rundir.parse_args(T.Args, ["--no-replay", "--lr", "2e-6", "--vms", "http://a:1,http://b:2"], T.PROG)
    assert (args.replay, args.lr, args.vms, args.group_size, args.stop_on_format_error) == \
        (False, 2e-6, "http://a:1,http://b:2", 8, True)
    assert given == {"replay": False, "lr": 2e-6, "vms": "http://a:1,http://b:2"}
    T.check_args(T.Args(beta=0.04))  # full fine-tuning's reference is a frozen copy of --model
    with pytest.raises(SystemExit, match="three model copies"):
        T.check_args(T.Args(beta=0.04, engine="vllm"))
    with pytest.raises(SystemExit, match="--beta must be"):
        T.check_args(T.Args(beta=-1.0))


def test_the_format_penalty_on_the_reward_or_on_the_advantage():
    """Two groups of 4, penalty 0.5. Group 0: scores [1, 0, 0, 0], the last answer broken; group 1:
    all failed, the last broken. Hand-computed (unbiased std, as torch.std):
    reward (ARPO): group 0 rewards [1, 0, 0, -0.5], mean 0.125, std sqrt(1.1875 / 3) = 0.62915
      -> [1.3908, -0.1987, -0.1987, -0.9934]; group 1 rewards [0, 0, 0, -0.5], mean -0.125,
      std sqrt(0.1875 / 3) = 0.25 -> [0.5, 0.5, 0.5, -1.5]: the three failures are rewarded.
    advantage: group 0 scores normalised, mean 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5], the
      broken one -0.5 more -> -1.0; group 1 scores all equal -> 0, the broken one -0.5."""
    batch = [T.Episode(task=None, vm=k, group=g, score=s, format_ok=[True, ok], reward=s - 0.5 * (not ok))
             for g, scores in enumerate([[1, 0, 0, 0], [0, 0, 0, 0]])
             for k, (s, ok) in enumerate(zip(scores, [True, True, True, False]))]
    got = T.advantages(batch, small_args(format_penalty=0.5))
    assert got == pytest.approx([1.3908, -0.1987, -0.1987, -0.9934, 0.5, 0.5, 0.5, -1.5], abs=1e-4)
    got = T.advantages(batch, small_args(format_penalty=0.5, format_penalty_on="advantage"))
    assert got == pytest.approx([1.5, -0.5, -0.5, -1.0, 0.0, 0.0, 0.0, -0.5], abs=1e-4)
    # Dr. GRPO's advantages (no std) take the penalty the same way: group 0 [0.75, -0.25, -0.25, -0.75].
    got = T.advantages(batch, small_args(format_penalty=0.5, format_penalty_on="advantage", scale_rewards=False))
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.75, 0.0, 0.0, 0.0, -0.5], abs=1e-6)


def test_the_console_says_kl_n_a_when_no_kl_is_computed():
    """--beta 0 computes no KL: `kl n/a`, not a measured-looking 0.0000; with a beta, the number."""
    m = {"iteration": 3, "tasks": ["calc-open"], "reward_mean": 0.5, "reward_std": 0.5, "success_rate": 0.5,
         "format_rate": 1.0, "n_injections": 0, "replay_injections": [], "replay_size": 0, "flat_groups": 0,
         "groups": [0], "actor/kl": 0.0123, "actor/clip_low": 0.0, "actor/clip_high": 0.0, "actor/clip_dual": 0.0,
         "actor/steps": 2, "time/iteration": 1.0, "time/generation": 0.2, "rollout/batches": 3, "time/update": 0.1,
         "vm_wait_share": 0.3, "time/reset": 0.3, "time/env": 0.4, "time/evaluate": 0.0, "env_failures": 0}
    assert "| kl n/a clip" in logs.arpo_line(m, beta=0.0)
    assert "| kl 0.0123 clip" in logs.arpo_line(m, beta=0.04)
    assert "env failures" not in logs.arpo_line(m) and "env failures 2" in logs.arpo_line({**m, "env_failures": 2})
