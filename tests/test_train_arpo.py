"""Tests for train_arpo.py on real local desktops (vm_server.py --xvfb) and the tiny real Qwen2.5-VL.

    python -m pytest -q tests/test_train_arpo.py

- smoke: `python train_arpo.py --vms 4 --group-size 2 --model tiny --iterations 2 --max-steps 3` end to
  end as a subprocess, then `--resume` for one more iteration, then `--eval-only` (both protocols);
- a desktop that dies (killed) or whose X server dies (503) mid-episode: the environment's failure;
- replay in a real iteration: a stored success of the forced task is injected into the tiny random
  policy's all-failed group and trained on; `--no-replay` leaves the group alone; a success is never
  injected into another group of the SAME iteration; the buffer survives a real `--resume`;
- user errors (bad flag values, --model, --tasks, --task-ids, unreachable VMs, the other script's
  run) end in one sentence and leave no run folder;
- task selection with a scripted stand-in policy (the task suite's solutions, as UI-TARS text) keeps
  exactly the tasks it solved at least once;
- standard vs hard evaluation (OSWorld's rule): a timeout passes an infeasible task and fails a
  feasible one under standard only; the rule itself by hand for every ending;
- the reward, task order and VM grouping rules with hand-computed numbers; GRPO's and Dr. GRPO's
  advantages in a real update; a lone desktop plays its group in turns and learns.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import arpo_episode as E  # noqa: E402
import arpo_eval  # noqa: E402
import arpo_log  # noqa: E402
import rundir  # noqa: E402
import train_arpo as T  # noqa: E402
from arpo_replay import ReplayBuffer  # noqa: E402
from conftest import free_port, kill_x_server  # noqa: E402
from env import VMPool  # noqa: E402
from model import load_policy  # noqa: E402
from task_files import load_tasks  # noqa: E402

SMALL = 64 * 28 * 28  # screenshots of ~64 visual tokens for the tiny model: fast on CPU
TASKS = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
SOLUTIONS = {i: t.solution for i, t in TASKS.items()}  # each task file's scripted solution


def small_args(**kw) -> T.Args:
    base = dict(vms="2", group_size=2, model="tiny", max_steps=2, max_pixels=SMALL, max_new_tokens=8,
                vm_timeout=30.0, lr=1e-3)
    return T.Args(**{**base, **kw})


@pytest.fixture(scope="module")
def pool():
    p = VMPool(2, timeout=30)
    yield p
    p.close()


@pytest.fixture(scope="module")
def tiny():
    return load_policy("tiny", seed=0, max_pixels=SMALL)


# ------------------------------------------------------------------------------------------------
# A scripted stand-in policy: the task suite's solutions (screen-pixel Action dicts) as UI-TARS text


def uitars_text(a: dict, image_size, screen) -> str:
    """One Action dict -> what UI-TARS-1.5 would write, coordinates in the image the model sees."""
    def box(x, y):
        return f"({round(x * image_size[0] / screen[0])},{round(y * image_size[1] / screen[1])})"
    t = a["type"]
    if t in ("click", "double_click", "right_click"):
        name = {"click": "click", "double_click": "left_double", "right_click": "right_single"}[t]
        act = f"{name}(start_box='{box(a['x'], a['y'])}')"
    elif t == "type":
        text = a["text"].replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")
        act = f"type(content='{text}')"
    elif t == "key":
        act = f"hotkey(key='{' '.join(a['keys'])}')"
    elif t == "wait":
        act = "wait()"
    elif t == "fail":
        act = "call_user()"
    elif t == "done":
        act = "finished(content='done')"
    else:
        raise ValueError(f"no UI-TARS text for {t}")
    return f"Thought: Next I do {t}.\nAction: {act}"


def scripted(plans):
    """policy_fn that follows, per episode, the action list plans(task_id, job) (job: the episode's
    index among those played together, Observation.job), then says finished(). Desktops step on
    their own, so the order episodes start in is timing's; the job index is not."""
    def fn(observations):
        out = []
        for o in observations:
            acts = plans(o.task.id, o.job)
            a = acts[o.step] if o.step < len(acts) else {"type": "done"}
            out.append(uitars_text(a, o.image_size, o.screen))
        return out
    return fn


def test_scripted_text_parses_back_to_the_solution():
    from actions import parse_action, smart_resize
    h, w = smart_resize(720, 1280, max_pixels=SMALL)
    for a in SOLUTIONS["calc-to-editor"] + SOLUTIONS["files-rename"]:
        p = parse_action(uitars_text(a, (w, h), (1280, 720)), "uitars", (1280, 720), (w, h))
        assert p is not None and p.action.type == a["type"]
        if "x" in a:  # coordinates survive the trip through the model's image up to its scale
            assert abs(p.action.x - a["x"]) <= 1280 / w and abs(p.action.y - a["y"]) <= 720 / h


# ------------------------------------------------------------------------------------------------
# Rules with hand-computed numbers (no VM needed)


def test_rewards_and_protocols_by_hand():
    args = small_args(format_penalty=0.5)
    task = TASKS["infeasible-email"]

    def ep(end, actions, ok):
        return E.Episode(task, 0, end=end, actions=actions, format_ok=ok)
    timed_out = ep("max_steps", [{"type": "wait"}, None], [True, False])
    gave_up = ep("fail", [{"type": "wait"}, {"type": "fail"}], [True, True])
    bad_fail = ep("fail", [None, {"type": "fail"}], [False, True])
    formatted = ep("format", [None], [False])
    eps = [timed_out, gave_up, bad_fail, formatted]
    for e in eps:
        E.score_episode(e, None, args)  # infeasible: scored client side, no evaluator score
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
    assert E.outcome_scores(infeasible, acts, end, checks) == (hard, standard)


def test_flat_groups_are_the_ones_the_update_learns_nothing_from():
    # Group 0: rewards 1.0 and 0.99 (std 0.0071, "flat" by ARPO's std < 0.01) still get advantages
    # +-0.707 (0.005 / (0.00707 + eps 1e-6)) and are learned from; group 1 (equal rewards) and group 2 (one member) get 0.
    from grpo import group_advantages
    groups, rewards = [0, 0, 1, 1, 2], [1.0, 0.99, 0.5, 0.5, 1.0]
    adv = group_advantages(rewards, groups).tolist()
    assert adv[:2] == pytest.approx([0.707, -0.707], abs=1e-3) and adv[2:] == [0.0, 0.0, 0.0]
    assert arpo_log.flat_groups(groups, adv) == 2


def test_dr_grpo_advantages_in_a_real_update(tmp_path):
    """--no-scale-rewards (Dr. GRPO): the advantages are reward - group mean, not divided by the std.
    Group 0 rewards [1.0, -0.5]: mean 0.25 -> +0.75 / -0.75 (GRPO: +-0.7071); group 1 [0.5, 0.5]: 0."""
    policy = load_policy("tiny", seed=0, max_pixels=SMALL)
    task = TASKS["calc-open"]
    eps = []
    for g, (r0, r1) in enumerate([(1.0, -0.5), (0.5, 0.5)]):
        for vm, r in enumerate((r0, r1)):  # one-step episodes of the blank screen, answered "finished()"
            e = E.Episode(task, vm, g, screenshots=[Image.new("RGB", (1280, 720))], assistant=["Thought: done.\nAction: finished()"],
                          logprobs=[None], reward=r)
            eps.append(e)
    for scale, want in ((False, [0.75, -0.75, 0.0, 0.0]), (True, [0.70711, -0.70711, 0.0, 0.0])):
        args = small_args(scale_rewards=scale, lr=0.0)
        opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
        tr = T.Trainer(args, None, policy, opt, None, None, str(tmp_path), [task])
        adv, pieces, upd = T.update(tr, eps, 0, {})
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
    rundir.seed_all(0, -1)  # -1: sampling follows --seed
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


# ------------------------------------------------------------------------------------------------
# Replay in a real iteration


def test_replay_injects_a_stored_success_into_a_failed_group(pool, tiny, tmp_path):
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1)  # the solution, then finished()
    # A stored success of calc-open, from an "earlier iteration": the scripted solution on a desktop.
    eps, _ = E.run_jobs(pool, [task], scripted(lambda tid, n: SOLUTIONS[tid]), args)
    assert eps[0].score == 1.0
    stored = E.to_record(eps[0])
    buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    assert buffer.add(task.id, stored, eps[0].score)
    # Its tokens as a training sample: what the update must see for the replayed member.
    want_tokens = sum(sum(p.target_mask) for p in T.episode_samples(tiny, E.from_record(stored), args))

    # No weight decay: any change of the weights below comes from the GRPO gradient.
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    tr = T.Trainer(args, pool, tiny, opt, buffer, T.model_policy(tiny, args, 1.0), str(tmp_path), [task])
    before = tiny.model.lm_head.weight.detach().clone()
    m, fresh = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    # The random tiny policy failed both rollouts -> the group is all-failed -> one member replaced.
    # groups[].scores are the fresh rollouts only; the replayed success is listed apart, labelled
    assert [(g["scores"], g["replayed_scores"]) for g in m["groups"]] == [([0.0], [1.0])]
    assert sorted(m["groups"][0]["members"]) == ["fresh", "replayed"] and m["success_rate"] == 0.0
    assert m["n_injections"] == 1
    inj = m["replay_injections"][0]
    assert (inj["task"], inj["from_iteration"], inj["score"]) == ("calc-open", 0, 1.0)
    replayed = [b for b in m["batch"] if b["replayed"]]
    assert len(m["batch"]) == 2 and len(replayed) == 1
    r, other = replayed[0], next(b for b in m["batch"] if not b["replayed"])
    assert r["target_tokens"] == want_tokens and r["reward"] == 1.0
    # rewards [1.0, -0.5] (format penalty 0.5): mean 0.25, std 1.0607 -> advantages +-0.7071
    assert r["advantage"] == pytest.approx(0.70711, abs=1e-4)
    assert other["advantage"] == pytest.approx(-0.70711, abs=1e-4)
    assert m["actor/tokens"] == r["target_tokens"] + other["target_tokens"]  # the update consumed both
    assert m["actor/grad_norm"] > 0 and not torch.equal(before, tiny.model.lm_head.weight)  # and learned from them
    assert len(buffer) == 1  # failures are never stored

    # The buffer survives a checkpoint (ARPO's own code loses it on resume).
    tr.picker = {"epoch": 0, "pos": 1}
    T.checkpoint(tr, 2)
    state, _ = rundir.load_checkpoint(str(tmp_path))
    back = ReplayBuffer()
    back.load_state_dict(state["replay"])
    again = E.from_record(back.sample(task.id))
    assert sum(sum(p.target_mask) for p in T.episode_samples(tiny, again, args)) == want_tokens

    # --no-replay: the same all-failed group trains as it is, with zero advantages.
    tr.replay = None
    m, _ = T.run_iteration(tr, 2, lambda n: [task.id] * n)
    assert m["n_injections"] == 0 and not any(b["replayed"] for b in m["batch"])
    assert [b["advantage"] for b in m["batch"]] == [0.0, 0.0] and m["actor/grad_norm"] == 0.0
    assert len(buffer) == 1


def test_the_format_penalty_on_the_reward_or_on_the_advantage():
    """Two groups of 4, penalty 0.5. Group 0: scores [1, 0, 0, 0], the last answer broken; group 1:
    all failed, the last broken. Hand-computed (unbiased std, as torch.std):
    reward (ARPO): group 0 rewards [1, 0, 0, -0.5], mean 0.125, std sqrt(1.1875 / 3) = 0.62915
      -> [1.3908, -0.1987, -0.1987, -0.9934]; group 1 rewards [0, 0, 0, -0.5], mean -0.125,
      std sqrt(0.1875 / 3) = 0.25 -> [0.5, 0.5, 0.5, -1.5]: the three failures are rewarded.
    advantage: group 0 scores normalised, mean 0.25, std 0.5 -> [1.5, -0.5, -0.5, -0.5], the
      broken one -0.5 more -> -1.0; group 1 scores all equal -> 0, the broken one -0.5."""
    batch = [E.Episode(task=None, vm=k, group=g, score=s, format_ok=[True, ok], reward=s - 0.5 * (not ok))
             for g, scores in enumerate([[1, 0, 0, 0], [0, 0, 0, 0]])
             for k, (s, ok) in enumerate(zip(scores, [True, True, True, False]))]
    got = T.advantages(batch, small_args(format_penalty=0.5))
    assert got == pytest.approx([1.3908, -0.1987, -0.1987, -0.9934, 0.5, 0.5, 0.5, -1.5], abs=1e-4)
    got = T.advantages(batch, small_args(format_penalty=0.5, format_penalty_on="advantage"))
    assert got == pytest.approx([1.5, -0.5, -0.5, -1.0, 0.0, 0.0, 0.0, -0.5], abs=1e-4)
    # Dr. GRPO's advantages (no std) take the penalty the same way: group 0 [0.75, -0.25, -0.25, -0.75].
    got = T.advantages(batch, small_args(format_penalty=0.5, format_penalty_on="advantage", scale_rewards=False))
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.75, 0.0, 0.0, 0.0, -0.5], abs=1e-6)


def test_epochs_and_the_lr_schedule_in_a_real_iteration(pool, tmp_path):
    """--epochs 3 with one trajectory per optimizer step: 2 trajectories x 3 passes = 6 steps; the
    optimizer runs at lr_at(iteration) (warm-up: iteration 1 of 4 -> lr / 2), logged as `actor/lr`."""
    task = TASKS["calc-open"]
    policy = load_policy("tiny", seed=1, max_pixels=SMALL)  # its own: this test trains it
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1, epochs=3, mini_batch=1, lr=1e-3, lr_warmup=4)
    # job 0 (VM 0) solves, job 1 (VM 1) says finished() at once: rewards 1 and 0, so both advantages
    # are nonzero
    fn = scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else [])
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, policy, opt, None, fn, str(tmp_path), [task])
    m, _ = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    assert m["groups"][0]["scores"] == [1.0, 0.0]
    assert m["actor/steps"] == 6 and m["actor/lr"] == 5e-4 and opt.param_groups[0]["lr"] == 5e-4


def test_beta_with_full_fine_tuning_pulls_towards_a_frozen_copy_of_the_start(pool, tmp_path):
    """--beta 0.04 without LoRA: the reference is a frozen copy of --model (rundir.reference_fn). ARPO's two
    optimizer steps: the first starts at the reference (KL 0), the second after a step away from
    it, so the run's KL is above 0, and the copy's weights never move."""
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1, beta=0.04, seed=1)
    policy = load_policy("tiny", seed=1, max_pixels=SMALL)  # the start = the reference's weights
    def load():
        return load_policy("tiny", seed=1, max_pixels=SMALL)
    ref_fn = rundir.reference_fn(args.beta, args.lora_rank, load)  # what train_arpo.setup builds
    assert rundir.reference_fn(0.0, 0, load) is None and rundir.reference_fn(0.04, 4, load) is None
    ref_model = ref_fn.args[0]  # partial(per_token_logps, the copy)
    assert not any(p.requires_grad for p in ref_model.parameters())
    frozen = ref_model.lm_head.weight.detach().clone()
    assert torch.equal(frozen, policy.model.lm_head.weight)
    fn = scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else [])  # rewards 1 and 0
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, policy, opt, None, fn, str(tmp_path), [task], ref_fn=ref_fn)
    m, _ = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    assert m["groups"][0]["scores"] == [1.0, 0.0] and m["actor/steps"] == 2
    assert m["actor/kl"] > 0, m["actor/kl"]
    assert torch.equal(frozen, ref_model.lm_head.weight) and not torch.equal(frozen, policy.model.lm_head.weight)
    assert "kl n/a" not in arpo_log.summary_line(m, args.beta)


def test_every_answer_is_trained_in_the_context_and_at_the_temperature_it_was_sampled(pool, tmp_path):
    # 3 steps with --max-images 1 at temperature 0.7: answer i saw only screenshot i. The trainer's
    # log-probs of every sampled token (old, before the update) must be the sampler's, and ARPO's
    # schedule makes two optimizer steps of the batch (lr 0 here: the weights stay as sampled).
    policy = load_policy("tiny", seed=0, max_pixels=SMALL)
    task = TASKS["calc-open"]
    # lr 0 in the args: run_iteration sets the optimizer's lr from them (lr_at) every iteration
    args = small_args(max_steps=3, max_images=1, temperature=0.7, stop_on_format_error=False, lr=0.0)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
    tr = T.Trainer(args, pool, policy, opt, None, T.model_policy(policy, args, args.temperature), str(tmp_path), [task])
    torch.manual_seed(0)
    m, eps = T.run_iteration(tr, 0, lambda n: [task.id] * n)
    assert [b["steps"] for b in m["batch"]] == [3, 3]
    # The first K = 1 answers share a sequence, each later answer is its own: 3 sequences each.
    assert [b["sequences"] for b in m["batch"]] == [3, 3]
    assert m["actor/logp_gap"] < 1e-4, m["actor/logp_gap"]
    assert m["actor/steps"] == 2 and "actor/clip_dual" in m

    # The trajectory re-encoded once with its last screenshot only trains answers 0 and 1 in a
    # context they never saw: nats away from what was sampled.
    from chat import encode_chat, uitars_messages
    from grpo import collate, per_token_logps, trajectory_sample
    ep = eps[0]
    pieces = T.episode_samples(policy, ep, args)
    assert [sum(p.target_mask) for p in pieces] == [len(a) for a in ep.assistant]
    assert sum(p.weight for p in pieces) == pytest.approx(1.0)
    whole = encode_chat(policy, uitars_messages(task.instruction, ep.screenshots, ep.assistant, max_images=1),
                          add_generation_prompt=False)
    one = trajectory_sample(whole, old_logps=[x for lp in ep.logprobs for x in lp])
    gaps = []
    for samples in (pieces, [one]):
        b = {**collate(samples), "temperature": 0.7, "suppressed": policy.suppressed_ids()}
        with torch.no_grad():
            lp = per_token_logps(policy.model, b)  # (B, T)
        on = b["completion_mask"].bool()
        gaps.append(float((lp[on] - b["old_logps"][on]).abs().mean()))
    assert gaps[0] < 1e-4 and gaps[1] > 0.1, gaps


def test_a_success_is_not_replayed_into_a_group_of_the_same_iteration(pool, tiny, tmp_path):
    """Two one-VM groups of the SAME task: group A solves it, group B fails (all-failed). B must not
    get A's success (stored only after this iteration's injections); the next iteration it may."""
    task = TASKS["calc-open"]
    args = small_args(group_size=1, max_steps=len(SOLUTIONS["calc-open"]) + 1)
    # iteration 1: job 0 (VM 0) solves, job 1 (VM 1) says finished() at once and fails
    fn = scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else [])
    buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, tiny, opt, buffer, fn, str(tmp_path), [task])
    m, _ = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    assert [(g["task"], g["scores"]) for g in m["groups"]] == [("calc-open", [1.0]), ("calc-open", [0.0])]
    assert m["n_injections"] == 0 and not any(b["replayed"] for b in m["batch"])
    assert len(buffer) == 1  # A's success is stored, after the injections
    # Iteration 2: both groups fail; each now gets the success of iteration 1.
    tr.policy_fn = scripted(lambda tid, job: [])
    m, _ = T.run_iteration(tr, 2, lambda n: [task.id] * n)
    assert m["n_injections"] == 2
    assert [(i["group"], i["from_iteration"], i["from_vm"]) for i in m["replay_injections"]] == [(0, 1, 0), (1, 1, 0)]


def test_replay_buffer_survives_a_real_resume(pool, tiny, tmp_path):
    """A checkpoint holding one stored success (written by T.checkpoint, as the loop does), then
    `train_arpo.py --resume` as a subprocess: the resumed run injects that success into its
    all-failed group, and its own checkpoint holds the very same buffer."""
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1, iterations=2)
    eps, _ = E.run_jobs(pool, [task], scripted(lambda tid, n: SOLUTIONS[tid]), args)
    assert eps[0].score == 1.0
    buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    buffer.add(task.id, E.to_record(eps[0]), eps[0].score)
    run = rundir.make_run_dir(str(tmp_path / "run"), args)
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    T.checkpoint(T.Trainer(args, pool, tiny, opt, buffer, None, run, [task], {"epoch": 0, "pos": 1}), 1)
    saved = buffer.state_dict()["data"]

    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_arpo.py"), "--resume", run, "--max-steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "(1 stored successes)" in p.stdout
    (m,) = _metrics(run)
    assert m["iteration"] == 1 and m["tasks"] == ["calc-open"]
    # the random tiny policy failed both rollouts: the restored success was injected
    assert [(i["task"], i["from_iteration"], i["score"]) for i in m["replay_injections"]] == [("calc-open", 0, 1.0)]
    state, _ = rundir.load_checkpoint(run)
    assert state["next_iteration"] == 2 and state["replay"]["data"] == saved  # byte for byte, screenshots too


# ------------------------------------------------------------------------------------------------
# Task selection and evaluation protocols with a scripted policy


def test_select_tasks_keeps_exactly_the_solved_ones(pool, tmp_path):
    tasks = [TASKS["calc-open"], TASKS["clock-open"], TASKS["infeasible-email"]]

    def plans(tid, job):  # the jobs: calc-open twice (0, 1), clock-open twice, infeasible-email twice
        if tid == "calc-open":  # solved on the second try only: "at least once" must keep it
            return SOLUTIONS[tid] if job == 1 else []
        if tid == "clock-open":
            return []  # finished() at once: never solved
        return SOLUTIONS[tid]  # call_user(): the right answer to an infeasible task
    args = small_args(select_tasks=2)
    kept = arpo_eval.select_and_record(pool, tasks, scripted(plans), args, str(tmp_path))
    assert [t.id for t in kept] == ["calc-open", "infeasible-email"]
    with open(tmp_path / "selected_tasks.json") as f:
        sel = json.load(f)
    assert sel["selected"] == ["calc-open", "infeasible-email"]
    assert sel["successes"] == {"calc-open": 1, "clock-open": 0, "infeasible-email": 2}


def test_a_timeout_passes_an_infeasible_task_and_fails_a_feasible_one_under_standard_only(pool, tmp_path):
    # OSWorld's standard protocol turns a timed-out episode's last action into FAIL: a win for an
    # infeasible task, a 0 for a feasible one whatever its checks say (here they pass: the
    # calculator is open). The hard protocol scores what the agent did.
    tasks = [TASKS["infeasible-browser"], TASKS["infeasible-email"], TASKS["calc-open"]]
    plans = {"infeasible-browser": [{"type": "wait"}] * 5, "infeasible-email": [{"type": "fail"}],
             "calc-open": SOLUTIONS["calc-open"] + [{"type": "wait"}] * 5}
    steps = len(SOLUTIONS["calc-open"]) + 1
    res = arpo_eval.evaluate_policy(pool, tasks, scripted(lambda tid, n: plans[tid]), small_args(max_steps=steps),
                            save_to=str(tmp_path / "eval"))
    assert res["standard"]["per_task"] == {"infeasible-browser": 1.0, "infeasible-email": 1.0, "calc-open": 0.0}
    assert res["hard"]["per_task"] == {"infeasible-browser": 0.0, "infeasible-email": 1.0, "calc-open": 1.0}
    assert (res["standard"]["overall"], res["hard"]["overall"]) == (2 / 3, 2 / 3)
    ends = {d["task"]: (d["end"], d["steps"]) for d in res["details"]}
    assert ends == {"infeasible-browser": ("max_steps", steps), "infeasible-email": ("fail", 1),
                    "calc-open": ("max_steps", steps)}
    assert "overall" in arpo_eval.eval_table(res) and json.dumps(res)
    # What each episode did: its actions, whether each answer parsed, the answers themselves
    acts = {d["task"]: [a["type"] for a in d["actions"]] for d in res["details"]}
    assert acts == {"infeasible-browser": ["wait"] * steps, "infeasible-email": ["fail"],
                    "calc-open": [a["type"] for a in SOLUTIONS["calc-open"]] + ["wait"]}
    assert all(d["format_ok"] == [True] * d["steps"] and len(d["texts"]) == d["steps"] for d in res["details"])
    assert res["format_rate"] == 1.0
    # ... and saved as trajectories, one "iteration" per task, that view.py reads and reports
    import view
    trajs = view.load_trajectories(str(tmp_path / "eval"))
    assert sorted(trajs) == [0, 1, 2] and [len(t[0]["steps"]) for t in trajs.values()] == [steps, 1, steps]
    assert trajs[1][0]["steps"][0]["action"]["type"] == "fail" and trajs[1][0]["final"]["score"] == 1.0
    assert os.path.exists(view.build_report(str(tmp_path / "eval")))


def test_a_lone_desktop_plays_its_group_in_turns_and_learns(tiny, tmp_path):
    """One desktop in service, groups of 2: the one task's two rollouts are played one after the
    other on it (a group of one would have advantage 0 and train nothing). Job 0 solves the task,
    job 1 says finished() at once: rewards 1 and 0 -> advantages +-0.7071, both trained on, and both
    episodes saved, numbered by job (trajectories/it000001/vm00 and vm01, each played on VM 0)."""
    task = TASKS["calc-open"]
    args = small_args(vms="1", max_steps=len(SOLUTIONS["calc-open"]) + 1)
    lone = VMPool(1, timeout=30)
    try:
        opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
        tr = T.Trainer(args, lone, tiny, opt, None, scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else []),
                       str(tmp_path), [task])
        m, eps = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    finally:
        lone.close()
    assert [(e.vm, e.job, e.score) for e in eps] == [(0, 0, 1.0), (0, 1, 0.0)]
    assert m["groups"][0]["scores"] == [1.0, 0.0] and m["flat_groups"] == 0
    assert [b["advantage"] for b in m["batch"]] == pytest.approx([0.70711, -0.70711], abs=1e-4)
    assert m["actor/grad_norm"] > 0
    E.save_episodes(str(tmp_path), 1, eps)
    finals = [json.loads(open(tmp_path / "trajectories" / "it000001" / f"vm{k:02d}.jsonl").read().splitlines()[-1])
              for k in (0, 1)]
    assert [(f["vm"], f["score"]) for f in finals] == [(0, 1.0), (0, 0.0)]


def test_a_dead_vm_drops_out_of_its_group_and_the_run_goes_on(pool, tiny):
    task = TASKS["calc-open"]
    solve, killed = scripted(lambda tid, n: SOLUTIONS[tid]), []

    def fn(observations):  # VM 1's desktop crashes (once) while its first answer is being generated
        if not killed and any(o.vm == 1 and o.step == 0 for o in observations):
            os.killpg(pool.local[1].proc.pid, signal.SIGKILL)
            killed.append(1)
        return solve(observations)
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1)  # the solution, then finished()
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, tiny, opt, None, fn, None, [task])
    m, eps = T.run_iteration(tr, 0, lambda n: [task.id] * n)
    assert eps[1].end == "dropped" and eps[0].end == "done" and eps[0].score == 1.0
    assert (m["episodes"], m["dropped"]) == (1, 1)
    assert m["groups"] == [{"group": 0, "task": "calc-open", "n": 1, "scores": [1.0], "replayed_scores": [],
                            "rewards": [1.0], "members": ["fresh"], "mean": 1.0, "std": 0.0, "replayed": False}]
    assert [b["vm"] for b in m["batch"]] == [0]  # the lost trajectory is not trained on
    # The next iteration's reset restarts the dead desktop: both VMs play again.
    m, eps = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    assert (m["episodes"], m["dropped"]) == (2, 0) and all(e.score == 1.0 for e in eps)


def test_a_desktop_whose_x_server_dies_is_the_environments_failure(pool, tiny):
    """The desktop's server lives on and answers 503 to everything: the episode is dropped as the
    environment's failure (env_failures), never charged to the model as a format failure."""
    task = TASKS["calc-open"]
    solve, killed = scripted(lambda tid, n: SOLUTIONS[tid]), []

    def fn(observations):  # VM 1's X server dies while its first answer is being generated
        if not killed and any(o.vm == 1 and o.step == 0 for o in observations):
            killed.append(kill_x_server(pool.local[1].proc.pid))
        return solve(observations)
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1)
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, tiny, opt, None, fn, None, [task])
    m, eps = T.run_iteration(tr, 0, lambda n: [task.id] * n)
    assert killed and eps[1].end == "dropped" and "503" in eps[1].error and eps[1].format_ok == [True]
    assert eps[0].end == "done" and eps[0].score == 1.0
    assert (m["episodes"], m["dropped"], m["env_failures"]) == (1, 1, 1) and "503" in m["env_errors"]["1"]
    assert m["format_rate"] == 1.0 and [b["vm"] for b in m["batch"]] == [0]
    # The next iteration restarts it (its health check fails) in its own thread: both play again.
    m, eps = T.run_iteration(tr, 1, lambda n: [task.id] * n)
    assert (m["episodes"], m["env_failures"]) == (2, 0) and all(e.score == 1.0 for e in eps)


# ------------------------------------------------------------------------------------------------
# Smoke: the command line, end to end


def _run(*flags, timeout=300):
    cmd = [sys.executable, os.path.join(ROOT, "train_arpo.py"), "--model", "tiny", "--max-pixels", str(SMALL),
           "--max-new-tokens", "12", "--task-ids", "calc-open,clock-open,terminal-open,infeasible-email", *flags]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p.stdout


def _metrics(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("flags, says", [
    (["--lr", "abc"], "argument --lr: invalid float value: 'abc'"),
    (["--model", "/no/such/model"], "No model folder at '/no/such/model'"),
    (["--task-ids", "nope"], "unknown task id(s) ['nope']"),
    (["--tasks", "/no/such/tasks"], "/no/such/tasks: no such task file"),
    (["--model", "tiny", "--vms", "http://127.0.0.1:{port}"], "None of the 1 VM(s) answered /health"),
    # vLLM's context length comes from the flags: 15 ARPO-sized screenshots exceed the tiny model's 8192
    (["--model", "tiny", "--engine", "vllm"], "more than this model's 8192; lower --max-images or --max-pixels"),
    (["--dual-clip", "0.5"], "--dual-clip must be above 1"),
    (["--format-penalty-on", "Advantages"], "--format-penalty-on must be reward or advantage"),
])
def test_user_errors_end_in_one_sentence(flags, says, tmp_path):
    flags = [f.format(port=free_port()) for f in flags]
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_arpo.py"), "--vms", "1", *flags,
                        "--runs-dir", str(tmp_path), "--run-name", "x"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode != 0 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "x").exists()  # no half-made run folder left behind


def test_smoke_train_resume_eval(tmp_path):
    runs = str(tmp_path)
    run = os.path.join(runs, "smoke")
    # Multi-turn: unparseable answers do not end the episode here, so every episode runs 3 steps.
    out = _run("--vms", "4", "--group-size", "2", "--iterations", "2", "--max-steps", "3", "--runs-dir", runs,
               "--run-name", "smoke", "--no-stop-on-format-error")
    assert len([line for line in out.splitlines() if line.startswith("it ")]) == 2
    ms = _metrics(run)
    assert [m["iteration"] for m in ms] == [0, 1]
    for m in ms:
        assert len(m["tasks"]) == 2 and m["episodes"] + m["dropped"] == 4
        assert m["time/generation"] > 0 and m["time/update"] > 0 and m["time/env"] > 0
        assert all(b["steps"] <= 3 and b["target_tokens"] > 0 for b in m["batch"])
    assert max(b["steps"] for b in ms[0]["batch"]) == 3
    with open(os.path.join(run, "trajectories", "it000000", "vm00.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert lines[-1]["final"] and "score" in lines[-1] and "reward" in lines[-1]
    assert all(os.path.exists(os.path.join(run, "trajectories", "it000000", s["screenshot"])) for s in lines[:-1])
    assert os.path.exists(os.path.join(run, "ckpt", "COMPLETE"))

    out = _run("--resume", run, "--vms", "4", "--iterations", "3")
    assert "resumed" in out
    assert [m["iteration"] for m in _metrics(run)] == [0, 1, 2]

    out = _run("--resume", run, "--vms", "2", "--eval-only", "--max-steps", "2")
    with open(os.path.join(run, "eval_it000003.json")) as f:
        res = json.load(f)
    assert len(res["details"]) == res["episodes"] == 4 * res["episodes_per_task"] - res["lost"]
    # every rate is the mean of the episode scores saved beside it (OSWorld's success rate)
    for proto, key in (("standard", "score_standard"), ("hard", "score_hard")):
        assert set(res[proto]["per_task"]) == {"calc-open", "clock-open", "terminal-open", "infeasible-email"}
        scores = [d[key] for d in res["details"]]
        assert res[proto]["overall"] == pytest.approx(sum(scores) / len(scores))
        for task, rate in res[proto]["per_task"].items():
            mine = [d[key] for d in res["details"] if d["task"] == task]
            assert rate == pytest.approx(sum(mine) / len(mine)), (proto, task)
    # The random policy never writes call_user(), so the infeasible task passes only by timing out.
    assert res["standard"]["per_task"]["infeasible-email"] == 1.0
    assert res["hard"]["per_task"]["infeasible-email"] == 0.0
    assert "overall" in out and "standard" in out

    # This run handed to train_explore.py's --resume: one sentence (not a KeyError), the run untouched.
    saved = open(os.path.join(run, "args.json")).read()
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_explore.py"), "--resume", run], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "not a train_explore.py run" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and open(os.path.join(run, "args.json")).read() == saved


def test_the_console_says_kl_n_a_when_no_kl_is_computed():
    """--beta 0 computes no KL: `kl n/a`, not a measured-looking 0.0000; with a beta, the number."""
    m = {"iteration": 3, "tasks": ["calc-open"], "reward_mean": 0.5, "reward_std": 0.5, "success_rate": 0.5,
         "format_rate": 1.0, "n_injections": 0, "replay_injections": [], "replay_size": 0, "flat_groups": 0,
         "groups": [0], "actor/kl": 0.0123, "actor/clip_low": 0.0, "actor/clip_high": 0.0, "actor/clip_dual": 0.0,
         "actor/steps": 2, "time/iteration": 1.0, "time/generation": 0.2, "rollout/batches": 3, "time/update": 0.1,
         "vm_wait_share": 0.3, "time/reset": 0.3, "time/env": 0.4, "time/evaluate": 0.0, "env_failures": 0}
    assert "| kl n/a clip" in arpo_log.summary_line(m, beta=0.0)
    assert "| kl 0.0123 clip" in arpo_log.summary_line(m, beta=0.04)
    assert "env failures" not in arpo_log.summary_line(m) and "env failures 2" in arpo_log.summary_line({**m, "env_failures": 2})
