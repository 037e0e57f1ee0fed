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
  feasible one under standard only;
- a lone desktop plays its group in turns and learns.
The rules with hand-computed numbers (scores for every ending, advantages, the lr schedule, task
order and groups, flags) are tests/test_arpo_rules.py.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import grpo  # noqa: E402
from plumbing import ckpt, logs, rundir  # noqa: E402
import train_arpo as T  # noqa: E402
from grpo import ReplayBuffer  # noqa: E402
from conftest import free_port, kill_x_server  # noqa: E402
from env import VMPool  # noqa: E402
from model import load_policy  # noqa: E402
from test_arpo_rules import SMALL, TASKS, small_args  # noqa: E402

SOLUTIONS = {i: t.solution for i, t in TASKS.items()}  # each task file's scripted solution


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


def test_the_last_action_settles_and_is_scored_without_a_screen(pool):
    """An episode that runs out of steps on an action: that action's screen is never shown to the
    model, so the desktop settles and answers none (rollout.Desktop.act), and the task is still
    scored on the settled desktop: the folder the last key opened is there when it is evaluated."""
    task = TASKS["files-open-documents"]
    args = small_args(max_steps=len(SOLUTIONS[task.id]), settle="watch")  # no finished(): the last step acts
    eps, out = T.play_tasks(pool, [task], scripted(lambda tid, n: SOLUTIONS[tid]), args)
    e = eps[0]
    assert (e.end, e.score) == ("max_steps", 1.0)
    assert len(e.screenshots) == len(e.actions) == 4  # a screen before each action, none after the last
    assert len(out.settles) == 4 and out.settles[-1]["until"] in ("quiet", "nochange", "cap")  # it settled


# ------------------------------------------------------------------------------------------------
# Replay in a real iteration


def test_replay_injects_a_stored_success_into_a_failed_group(pool, tiny, tmp_path):
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1)  # the solution, then finished()
    # A stored success of calc-open, from an "earlier iteration": the scripted solution on a desktop.
    eps, _ = T.play_tasks(pool, [task], scripted(lambda tid, n: SOLUTIONS[tid]), args)
    assert eps[0].score == 1.0
    stored = T.to_dict(eps[0])
    replay_buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    assert replay_buffer.add(task.id, stored, eps[0].score)
    # Its tokens as a training sample: what the update must see for the replayed member.
    want_tokens = sum(sum(p.target_mask) for p in T.episode_samples(tiny, T.from_dict(stored), args))

    # No weight decay: any change of the weights below comes from the GRPO gradient.
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)
    tr = T.Trainer(args, pool, tiny, opt, replay_buffer, T.model_policy(tiny, args, 1.0), str(tmp_path), [task])
    before = tiny.model.lm_head.weight.detach().clone()
    m, fresh = T.iteration(tr, 1, lambda n: [task.id] * n)
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
    assert len(replay_buffer) == 1  # failures are never stored

    # The replay buffer survives a checkpoint (ARPO's own code loses it on resume).
    tr.picker = {"epoch": 0, "pos": 1}
    T.checkpoint(tr, 2)
    state, _ = ckpt.load_checkpoint(str(tmp_path))
    back = ReplayBuffer()
    back.load_state_dict(state["replay"])
    again = T.from_dict(back.sample(task.id))
    assert sum(sum(p.target_mask) for p in T.episode_samples(tiny, again, args)) == want_tokens

    # --no-replay: the same all-failed group trains as it is, with zero advantages.
    tr.replay_buffer = None
    m, _ = T.iteration(tr, 2, lambda n: [task.id] * n)
    assert m["n_injections"] == 0 and not any(b["replayed"] for b in m["batch"])
    assert [b["advantage"] for b in m["batch"]] == [0.0, 0.0] and m["actor/grad_norm"] == 0.0
    assert len(replay_buffer) == 1


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
    m, _ = T.iteration(tr, 1, lambda n: [task.id] * n)
    assert m["groups"][0]["scores"] == [1.0, 0.0]
    assert m["actor/steps"] == 6 and m["actor/lr"] == 5e-4 and opt.param_groups[0]["lr"] == 5e-4


def test_beta_with_full_fine_tuning_pulls_towards_a_frozen_copy_of_the_start(pool, tmp_path):
    """--beta 0.04 without LoRA: the reference is a frozen copy of --model (grpo.reference_fn). ARPO's two
    optimizer steps: the first starts at the reference (KL 0), the second after a step away from
    it, so the run's KL is above 0, and the copy's weights never move."""
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1, beta=0.04, seed=1)
    policy = load_policy("tiny", seed=1, max_pixels=SMALL)  # the start = the reference's weights
    def load():
        return load_policy("tiny", seed=1, max_pixels=SMALL)
    ref_fn = grpo.reference_fn(args.beta, args.lora_rank, load)  # what train_arpo.setup builds
    assert grpo.reference_fn(0.0, 0, load) is None and grpo.reference_fn(0.04, 4, load) is None
    ref_model = ref_fn.args[0]  # partial(per_token_logps, the copy)
    assert not any(p.requires_grad for p in ref_model.parameters())
    frozen = ref_model.lm_head.weight.detach().clone()
    assert torch.equal(frozen, policy.model.lm_head.weight)
    fn = scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else [])  # rewards 1 and 0
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, policy, opt, None, fn, str(tmp_path), [task], ref_fn=ref_fn)
    m, _ = T.iteration(tr, 1, lambda n: [task.id] * n)
    assert m["groups"][0]["scores"] == [1.0, 0.0] and m["actor/steps"] == 2
    assert m["actor/kl"] > 0, m["actor/kl"]
    assert torch.equal(frozen, ref_model.lm_head.weight) and not torch.equal(frozen, policy.model.lm_head.weight)
    assert "kl n/a" not in logs.arpo_line(m, args.beta)


def test_every_answer_is_trained_in_the_context_and_at_the_temperature_it_was_sampled(pool, tmp_path):
    # 3 steps with --max-images 1 at temperature 0.7: answer i saw only screenshot i. The trainer's
    # log-probs of every sampled token (old, before the update) must be the sampler's, and ARPO's
    # schedule makes two optimizer steps of the batch (lr 0 here: the weights stay as sampled).
    policy = load_policy("tiny", seed=0, max_pixels=SMALL)
    task = TASKS["calc-open"]
    # lr 0 in the args: iteration sets the optimizer's lr from them (lr_at) every iteration
    args = small_args(max_steps=3, max_images=1, temperature=0.7, stop_on_format_error=False, lr=0.0)
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=0.0)
    tr = T.Trainer(args, pool, policy, opt, None, T.model_policy(policy, args, args.temperature), str(tmp_path), [task])
    torch.manual_seed(0)
    m, eps = T.iteration(tr, 0, lambda n: [task.id] * n)
    assert [b["steps"] for b in m["batch"]] == [3, 3]
    # The first K = 1 answers share a sequence, each later answer is its own: 3 sequences each.
    assert [b["sequences"] for b in m["batch"]] == [3, 3]
    assert m["actor/logp_gap"] < 1e-4, m["actor/logp_gap"]
    assert m["actor/steps"] == 2 and "actor/clip_dual" in m

    # The trajectory re-encoded once with its last screenshot only trains answers 0 and 1 in a
    # context they never saw: nats away from what was sampled.
    from model import encode_chat, uitars_messages
    from grpo import collate, per_token_logps, trajectory_sample
    ep = eps[0]
    pieces = T.episode_samples(policy, ep, args)
    assert [sum(p.target_mask) for p in pieces] == [len(a) for a in ep.answers]
    assert sum(p.weight for p in pieces) == pytest.approx(1.0)
    whole = encode_chat(policy, uitars_messages(task.instruction, ep.screenshots, ep.answers, max_images=1),
                          add_generation_prompt=False)
    one = trajectory_sample(whole, old_logps=[x for lp in ep.logprobs for x in lp])
    gaps = []
    for samples in (pieces, [one]):
        b = {**collate(samples), "temperature": 0.7, "suppressed": policy.suppressed_ids()}
        with torch.no_grad():
            lp = per_token_logps(policy.model, b)  # (B, T)
        on = b["target_mask"].bool()
        gaps.append(float((lp[on] - b["old_logps"][on]).abs().mean()))
    assert gaps[0] < 1e-4 and gaps[1] > 0.1, gaps


def test_a_success_is_not_replayed_into_a_group_of_the_same_iteration(pool, tiny, tmp_path):
    """Two one-VM groups of the SAME task: group A solves it, group B fails (all-failed). B must not
    get A's success (stored only after this iteration's injections); the next iteration it may."""
    task = TASKS["calc-open"]
    args = small_args(group_size=1, max_steps=len(SOLUTIONS["calc-open"]) + 1)
    # iteration 1: job 0 (VM 0) solves, job 1 (VM 1) says finished() at once and fails
    fn = scripted(lambda tid, job: SOLUTIONS[tid] if job == 0 else [])
    replay_buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    tr = T.Trainer(args, pool, tiny, opt, replay_buffer, fn, str(tmp_path), [task])
    m, _ = T.iteration(tr, 1, lambda n: [task.id] * n)
    assert [(g["task"], g["scores"]) for g in m["groups"]] == [("calc-open", [1.0]), ("calc-open", [0.0])]
    assert m["n_injections"] == 0 and not any(b["replayed"] for b in m["batch"])
    assert len(replay_buffer) == 1  # A's success is stored, after the injections
    # Iteration 2: both groups fail; each now gets the success of iteration 1.
    tr.policy_fn = scripted(lambda tid, job: [])
    m, _ = T.iteration(tr, 2, lambda n: [task.id] * n)
    assert m["n_injections"] == 2
    assert [(i["group"], i["from_iteration"], i["from_vm"]) for i in m["replay_injections"]] == [(0, 1, 0), (1, 1, 0)]


def test_replay_buffer_survives_a_real_resume(pool, tiny, tmp_path):
    """A checkpoint holding one stored success (written by T.checkpoint, as the loop does), then
    `train_arpo.py --resume` as a subprocess: the resumed run injects that success into its
    all-failed group, and its own checkpoint holds the very same replay buffer."""
    task = TASKS["calc-open"]
    args = small_args(max_steps=len(SOLUTIONS["calc-open"]) + 1, iterations=2)
    eps, _ = T.play_tasks(pool, [task], scripted(lambda tid, n: SOLUTIONS[tid]), args)
    assert eps[0].score == 1.0
    replay_buffer = ReplayBuffer(capacity_per_task=8, success_threshold=0.1, seed=0)
    replay_buffer.add(task.id, T.to_dict(eps[0]), eps[0].score)
    run = rundir.make_run_dir(str(tmp_path / "run"), args)
    opt = torch.optim.AdamW([p for p in tiny.model.parameters() if p.requires_grad], lr=args.lr)
    T.checkpoint(T.Trainer(args, pool, tiny, opt, replay_buffer, None, run, [task], {"epoch": 0, "pos": 1}), 1)
    saved = replay_buffer.state_dict()["data"]

    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_arpo.py"), "--resume", run, "--max-steps", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "(1 stored successes)" in p.stdout
    (m,) = _metrics(run)
    assert m["iteration"] == 1 and m["tasks"] == ["calc-open"]
    # the random tiny policy failed both rollouts: the restored success was injected
    assert [(i["task"], i["from_iteration"], i["score"]) for i in m["replay_injections"]] == [("calc-open", 0, 1.0)]
    state, _ = ckpt.load_checkpoint(run)
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
    kept = T.selected_tasks(pool, tasks, scripted(plans), args, str(tmp_path))
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
    res = T.evaluate(pool, tasks, scripted(lambda tid, n: plans[tid]), small_args(max_steps=steps),
                            save_to=str(tmp_path / "eval"))
    assert res["standard"]["per_task"] == {"infeasible-browser": 1.0, "infeasible-email": 1.0, "calc-open": 0.0}
    assert res["hard"]["per_task"] == {"infeasible-browser": 0.0, "infeasible-email": 1.0, "calc-open": 1.0}
    assert (res["standard"]["overall"], res["hard"]["overall"]) == (2 / 3, 2 / 3)
    ends = {d["task"]: (d["end"], d["steps"]) for d in res["details"]}
    assert ends == {"infeasible-browser": ("max_steps", steps), "infeasible-email": ("fail", 1),
                    "calc-open": ("max_steps", steps)}
    assert "overall" in logs.eval_table(res) and json.dumps(res)
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
        m, eps = T.iteration(tr, 1, lambda n: [task.id] * n)
    finally:
        lone.close()
    assert [(e.vm, e.job, e.score) for e in eps] == [(0, 0, 1.0), (0, 1, 0.0)]
    assert m["groups"][0]["scores"] == [1.0, 0.0] and m["flat_groups"] == 0
    assert [b["advantage"] for b in m["batch"]] == pytest.approx([0.70711, -0.70711], abs=1e-4)
    assert m["actor/grad_norm"] > 0
    logs.save_episodes(str(tmp_path), 1, eps)
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
    m, eps = T.iteration(tr, 0, lambda n: [task.id] * n)
    assert eps[1].end == "dropped" and eps[0].end == "done" and eps[0].score == 1.0
    assert (m["episodes"], m["dropped"]) == (1, 1)
    assert m["groups"] == [{"group": 0, "task": "calc-open", "n": 1, "scores": [1.0], "replayed_scores": [],
                            "rewards": [1.0], "members": ["fresh"], "mean": 1.0, "std": 0.0, "replayed": False}]
    assert [b["vm"] for b in m["batch"]] == [0]  # the lost trajectory is not trained on
    # The next iteration's reset restarts the dead desktop: both VMs play again.
    m, eps = T.iteration(tr, 1, lambda n: [task.id] * n)
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
    m, eps = T.iteration(tr, 0, lambda n: [task.id] * n)
    assert killed and eps[1].end == "dropped" and "503" in eps[1].error and eps[1].format_ok == [True]
    assert eps[0].end == "done" and eps[0].score == 1.0
    assert (m["episodes"], m["dropped"], m["env_failures"]) == (1, 1, 1) and "503" in m["env_errors"]["1"]
    assert m["format_rate"] == 1.0 and [b["vm"] for b in m["batch"]] == [0]
    # The next iteration restarts it (its health check fails) in its own thread: both play again.
    m, eps = T.iteration(tr, 1, lambda n: [task.id] * n)
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
    (["--threads", "0"], "--threads must be at least 1"),
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
