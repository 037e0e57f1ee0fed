"""A replica of `bench/learning.py --method arpo-multi` for trying recipes: a seed in minutes.

    python bench/learning_replica.py --seeds 4 --first-seed 10                  # the bench's recipe
    python bench/learning_replica.py --seeds 4 --first-seed 10 --lr-schedule linear --iterations 200
    python bench/learning_replica.py --seeds 8 --first-seed 0 --no-replay       # replay's ablation (arpo-replay)

The screens an arpo-multi episode sees are real screenshots, taken once from a local desktop
(learning_warm.first_screens: the reset desktop, and the screen after double-clicking each icon);
an episode then looks its next screen up instead of playing it: a double-click on an icon's
picture or label opens that icon's screen, and on the file manager's screen a double-click on the
task's folder is the success (where a double-click opens something was probed on a real desktop). Everything else is train_arpo.py's own: the prompt, the parse, the score
and the format penalty, replay, advantages, the training sequences and the update, with the flags
bench/learning.py passes, and the same warm start; it trains exactly --iterations (the bench:
those its --minutes leave room for). What it leaves out: whatever else an action
does on a real desktop (a click elsewhere changes nothing here), what changes between screenshots
(the clock, the HOME path in the file manager's location bar), the evaluator, and the desktops'
waits (each step is one batched generate over every episode). So it answers "does this recipe
learn the second step, and on how many seeds" in minutes; the real bench decides (docs/log.md
has its runs beside the bench's, 2026-12-06).

Per seed: the success of an eval at T=1 before and after training (--eval-episodes a task); the
parse rate, the lowest over both evals and each quarter of training, as the bench's; and after
training, per task: success, first step right, second step right when the first was; the fresh
episodes' success in each quarter of training (replayed ones excluded) and how many stored
successes replay put into failed groups (0 with --no-replay). Last line:
    learning_replica: seeds <n> gain min <g> median <m>, below 0.25: <k>, parse below 0.85: <j>
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import grpo  # noqa: E402
import train_arpo as T  # noqa: E402
from env import load_tasks  # noqa: E402
from learning import MULTI_TASK_IDS, SUCCESS  # noqa: E402
from learning_warm import FM_ICON, MAX_PIXELS, first_screens, warm_start_multi  # noqa: E402
from model import generate, load_policy  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402

SCREEN = (1280, 720)
# Where a double-click opens something, in screen pixels, probed on a real desktop (pcmanfm 1.3.2,
# one pixel at a time; tests/test_learning.py re-checks the edges). A desktop icon: its picture,
# 48 x 50 px about the icon's centre, and its label under it, as wide as its text.
ICON_PICTURE, LABEL_ROWS = (-24, -24, 23, 25), (26, 48)  # (dx0, dy0, dx1, dy1) from the centre; label's dy
ICON_LABEL = {"Terminal": (-34, 33), "Text Editor": (-43, 41), "Calculator": (-40, 39), "File Manager": (-50, 49),
              "Clock": (-23, 21), "Eyes": (-20, 19), "XCalc": (-23, 21)}  # the label's dx0, dx1
# A folder in the file manager's window: cells 94 px apart from x = 574; a cell's picture spans
# x + 22 .. x + 70 and y 184 .. 231, its label the whole cell, x .. x + 88, and y 232 .. 249.
CELL_LEFT = {"Documents": 574, "Downloads": 668, "Pictures": 762}
FOLDER_PICTURE, FOLDER_LABEL = (22, 184, 70, 231), (0, 232, 88, 249)  # (dx0, y0, dx1, y1), inclusive
FOLDER = {"files-open-documents": "Documents", "files-open-downloads": "Downloads",
          "files-open-pictures": "Pictures"}


def icon_hit(action: dict | None) -> str | None:
    """The desktop icon a double-click opened (on its picture or its label), or None."""
    if not action or action.get("type") != "double_click":
        return None
    for label, (cx, cy) in desktop_icons(SCREEN).items():
        dx, dy = action["x"] - cx, action["y"] - cy
        (x0, y0, x1, y1), (l, r) = ICON_PICTURE, ICON_LABEL[label]
        if (x0 <= dx <= x1 and y0 <= dy <= y1) or (l <= dx <= r and LABEL_ROWS[0] <= dy <= LABEL_ROWS[1]):
            return label
    return None


def item_hit(action: dict | None) -> str | None:
    """The task folder a double-click in the file manager opened, or None."""
    if not action or action.get("type") != "double_click":
        return None
    for name, left in CELL_LEFT.items():
        for dx0, y0, dx1, y1 in (FOLDER_PICTURE, FOLDER_LABEL):
            if left + dx0 <= action["x"] <= left + dx1 and y0 <= action["y"] <= y1:
                return name
    return None


def solved(opened: str | None, actions: list, task_id: str) -> bool:
    """The replica's evaluator: the first action opened the file manager (`opened`: what icon_hit
    said of it) and the second double-clicked the task's folder in its window."""
    return opened == FM_ICON and len(actions) == 2 and item_hit(actions[1]) == FOLDER[task_id]


def play(policy, args, screens, tasks: list, groups: list, iteration: int = 0, temperature: float = 1.0):
    """Episodes of tasks[k] (group groups[k]), step by step, every live episode in one generate.
    -> scored train_arpo.Episodes."""
    desk, after = screens
    eps = [T.Episode(t, k, g, iteration) for k, (t, g) in enumerate(zip(tasks, groups))]
    shown = [desk] * len(eps)
    opened = [None] * len(eps)  # the icon each episode's first action opened
    for step in range(args.max_steps):
        live = [k for k, e in enumerate(eps) if e.end is None]
        if not live:
            break
        obs = []
        for k in live:
            eps[k].screenshots.append(shown[k])
            obs.append(T.observe(eps[k], shown[k], args))
        answers = generate(policy, [o.messages for o in obs], max_new_tokens=args.max_new_tokens, temperature=temperature)
        for k, o, answer in zip(live, obs, answers):
            action = T.add_answer(eps[k], o, answer, args)
            label = icon_hit(action.to_dict() if action is not None else None)
            if step == 0 and label:  # the replica's desktop: the icon's window opens
                shown[k], opened[k] = after[label], label
            if eps[k].end is None and len(eps[k].answers) >= args.max_steps:
                eps[k].end = "max_steps"
    for e, first in zip(eps, opened):
        e.end = e.end or "max_steps"
        T.score_episode(e, 1.0 if solved(first, e.actions, e.task.id) else 0.0, args)
    return eps


def evaluate(policy, args, screens, tasks: list, n: int, seed: int) -> dict:
    """n episodes a task at T=1 -> success, parse and per task (success, first right, second | first)."""
    torch.manual_seed(seed)
    eps = []
    for t in tasks:
        eps += play(policy, args, screens, [t] * n, [0] * n)
    oks = [ok for e in eps for ok in e.format_ok]
    per = {}
    for t in tasks:
        es = [e for e in eps if e.task.id == t.id]
        first = [e for e in es if e.actions and icon_hit(e.actions[0]) == FM_ICON]
        per[t.id] = (sum(e.score > SUCCESS for e in es) / len(es), len(first) / len(es),
                     sum(e.score > SUCCESS for e in first) / max(1, len(first)))
    return {"success": sum(e.score > SUCCESS for e in eps) / len(eps), "parse": sum(oks) / max(1, len(oks)), "per_task": per}


def run_seed(c, seed: int, screens) -> dict:
    """Warm start (the bench's), eval, train as train_arpo.iteration does, eval. -> the numbers."""
    t0 = time.perf_counter()
    ids = MULTI_TASK_IDS.split(",")
    # the warm start is kept for the next run of the same seed and recipe (its folder names both)
    warm = os.path.join(c.out, f"seed{seed}", f"warm_start-{c.warm_epochs}x{c.warm_lr:g}")
    if not os.path.exists(os.path.join(warm, "config.json")):
        warm_start_multi(warm, seed, ids, c.warm_epochs, c.warm_lr, screens=screens)
    # The flags bench/learning.py gives train_arpo.py (common_flags and run_seed), as train_arpo parses them.
    args, _, _ = T.resolve_args([
        "--model", warm, "--task-ids", MULTI_TASK_IDS, "--group-size", str(c.group_size), "--groups", str(c.groups),
        "--max-steps", "2", "--max-images", "2", "--max-new-tokens", "48", "--max-pixels", str(MAX_PIXELS),
        "--temperature", "1.0", "--iterations", str(c.iterations), "--lr", str(c.lr),
        "--lr-warmup", str(max(1, c.iterations // 10)), "--lr-schedule", c.lr_schedule, "--beta", str(c.beta),
        "--format-penalty", str(c.format_penalty), "--format-penalty-on", c.format_penalty_on,
        "--scale-rewards" if c.scale_rewards else "--no-scale-rewards",
        "--optimizer-steps", str(c.optimizer_steps), "--replay" if c.replay else "--no-replay",
        "--seed", str(seed)])
    torch.manual_seed(seed)
    by_id = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
    tasks = [by_id[i] for i in ids]
    policy = load_policy(warm, seed=seed, max_pixels=MAX_PIXELS)
    optimizer = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    replay_buffer = grpo.ReplayBuffer(args.replay_capacity, args.success_threshold, seed=seed) if args.replay else None
    tr = T.Trainer(args, None, policy, optimizer, replay_buffer, None)
    tr.ref_fn = grpo.reference_fn(args.beta, 0, lambda: load_policy(warm, seed=seed, max_pixels=MAX_PIXELS))
    before = evaluate(policy, args, screens, tasks, c.eval_episodes, 1000 + seed)
    picker = {"epoch": 0, "pos": 0}
    parsed = [[] for _ in range(4)]  # each quarter of training: did each fresh answer parse
    won = [[] for _ in range(4)]     # ... and did each fresh episode succeed (replayed ones excluded)
    injected = 0
    for it in range(args.iterations):  # train_arpo.iteration, with the replica's rollout
        grpo.set_lr(optimizer, T.lr_at(it, args))
        task_ids = T.pick_tasks(ids, picker, args.groups, seed)
        jobs = [by_id[t] for t in task_ids for _ in range(args.group_size)]
        fresh = play(policy, args, screens, jobs, [g for g in range(args.groups) for _ in range(args.group_size)], it)
        quarter = 4 * it // args.iterations
        parsed[quarter] += [ok for e in fresh for ok in e.format_ok]
        won[quarter] += [e.score > SUCCESS for e in fresh]
        to_train, injections = T.replay(replay_buffer, fresh, task_ids, [(e.group, e.score) for e in fresh])
        injected += len(injections)
        if replay_buffer is not None:  # --no-replay: no buffer, nothing stored
            for e in fresh:
                if e.score > replay_buffer.success_threshold:
                    replay_buffer.add(e.task.id, T.to_dict(e), e.score)
        adv = T.advantages(to_train, args)  # (N,)
        T.update(tr, [s for e, x in zip(to_train, adv) for s in T.episode_samples(policy, e, args, x)], it)
    after = evaluate(policy, args, screens, tasks, c.eval_episodes, 2000 + seed)
    parse = min([before["parse"], after["parse"]] + [sum(q) / len(q) for q in parsed if q])
    return {"seed": seed, "before": before, "after": after, "parse": parse, "injected": injected,
            "fresh": [sum(q) / len(q) if q else float("nan") for q in won], "minutes": (time.perf_counter() - t0) / 60}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, default=4, help="independent runs (warm start, train, evals)")
    p.add_argument("--first-seed", type=int, default=10, help="seeds --first-seed .. + --seeds - 1")
    p.add_argument("--iterations", type=int, default=400, help="training iterations (the bench's: 400)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak lr after a 10%% warm-up (the bench's: 3e-4)")
    p.add_argument("--lr-schedule", choices=["constant", "linear", "cosine"], default="constant",
                   help="after the warm-up (the bench's: constant)")
    p.add_argument("--format-penalty-on", choices=["reward", "advantage"], default="reward",
                   help="train_arpo.py --format-penalty-on (the bench's: reward)")
    p.add_argument("--group-size", type=int, default=4, help="rollouts a group (the bench's: 4)")
    p.add_argument("--groups", type=int, default=1, help="groups (tasks) an iteration (the bench's: 1)")
    p.add_argument("--beta", type=float, default=0.0, help="KL to the warm start (the bench's: 0)")
    p.add_argument("--format-penalty", type=float, default=1.0, help="train_arpo.py --format-penalty (the bench's: 1.0)")
    p.add_argument("--scale-rewards", action=argparse.BooleanOptionalAction, default=True,
                   help="train_arpo.py --scale-rewards: divide by the group's std (the bench's: yes)")
    p.add_argument("--optimizer-steps", type=int, default=2,
                   help="train_arpo.py --optimizer-steps: each iteration's batch cut into that many steps (the bench's: 2)")
    p.add_argument("--replay", action=argparse.BooleanOptionalAction, default=True,
                   help="train_arpo.py --replay: ARPO's replay buffer (--no-replay: its ablation, as arpo-replay's other arm)")
    p.add_argument("--eval-episodes", type=int, default=24, help="episodes a task in each eval (T=1)")
    p.add_argument("--warm-epochs", type=int, default=32, help="the warm start's epochs (the bench's: 32)")
    p.add_argument("--warm-lr", type=float, default=6e-3, help="the warm start's lr (the bench's)")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "learning", "replica"), help="where warm starts go")
    c = p.parse_args(argv)
    os.makedirs(c.out, exist_ok=True)
    screens = first_screens(SCREEN)  # the real screens, once
    gains, parses = [], []
    for seed in range(c.first_seed, c.first_seed + c.seeds):
        r = run_seed(c, seed, screens)
        b, a = r["before"], r["after"]
        gains.append(a["success"] - b["success"])
        parses.append(r["parse"])
        per = ", ".join(f"{t[11:]} {s:.2f} (first {f:.2f}, second | first {x:.2f})" for t, (s, f, x) in a["per_task"].items())
        print(f"seed {seed}: before {b['success']:.2f} after {a['success']:.2f} gain {gains[-1]:+.2f} parse "
              f"{r['parse']:.2f} | after: {per} | fresh success by quarter {' '.join(f'{x:.2f}' for x in r['fresh'])}, "
              f"replayed {r['injected']} | {r['minutes']:.1f} min", flush=True)
    print(f"learning_replica: seeds {c.seeds} gain min {min(gains):+.2f} median {statistics.median(gains):+.2f}, "
          f"below 0.25: {sum(g < 0.25 for g in gains)}, parse below 0.85: {sum(x < 0.85 for x in parses)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
