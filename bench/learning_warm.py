"""The warm starts of bench/learning.py: the tiny model taught the UI-TARS answer format on real
desktop screenshots, with NO task knowledge (every prompt answered with every icon, uniformly).

    python bench/learning.py --warm-start-only runs/warm      # the one-step warm start, seed 0

warm_start: one step a task (--method arpo): each task prompt x each desktop icon, once an epoch.
warm_start_multi: two steps (--method arpo-multi): the first answer each icon equally often, the
second each thing the screen that icon opened affords equally often (`affordances`).
warm_start_repair: up to four steps (--method arpo-repair, the self-correction claim): on every
screen each thing it affords equally often, closing a window and finishing included.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pcmanfm opens HOME in a window openbox centres on the 1280x720 screen, its items in name order
# along the first row (measured on pcmanfm 1.3.2; tests/test_learning.py replays them).
FM_ITEMS = {"Desktop": (528, 215), "Documents": (621, 215), "Downloads": (715, 215), "Pictures": (810, 215),
            "notes.txt": (903, 215)}
FM_ICON = "File Manager"
MAX_PIXELS = 12544  # 1280x720 -> 140x84: 15 visual tokens a screenshot


def icon_points(image_size: tuple[int, int], screen: tuple[int, int]) -> list[tuple[int, int]]:
    """The desktop icons' centres in the image the model sees (its coordinates live there)."""
    from vm.desktop import desktop_icons
    return [(round(x * image_size[0] / screen[0]), round(y * image_size[1] / screen[1]))
            for x, y in desktop_icons(screen).values()]


def warm_start(out: str, seed: int, task_ids: list[str], epochs: int, lr: float, vms_screen=(1280, 720)) -> dict:
    """SFT the tiny model on (task prompt, real desktop screenshot) -> left_double on an icon, each
    prompt with each icon once per epoch, in a seeded order. Saved to `out` (save_policy)."""
    import torch
    import transformers

    from actions import smart_resize
    from model import encode_chat, uitars_messages
    from env import VMPool
    from grpo import distill_step, trajectory_sample
    from model import load_policy, save_policy
    from env import load_tasks

    t0 = time.perf_counter()
    tasks = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
    pool = VMPool(1, timeout=60, screen=vms_screen)
    try:  # the desktop as every episode starts: after a reset
        pool.reset()
        shot = pool.screenshots()[0]
        if not shot.ok:
            raise SystemExit(f"the desktop did not give a screenshot ({shot.error}); run `bash setup.sh` first.")
        img = shot.value
    finally:
        pool.close()
    policy = load_policy("tiny", seed=seed, max_pixels=MAX_PIXELS)
    h, w = smart_resize(img.height, img.width, max_pixels=MAX_PIXELS)
    points = icon_points((w, h), img.size)
    pairs = [(tid, p) for tid in task_ids for p in points]  # every prompt x every icon
    samples = {}
    for tid, (x, y) in pairs:
        # The thought restates the instruction, as UI-TARS's thoughts restate the goal: it says
        # nothing about which icon, but it puts the task right before the action tokens, where a
        # 2-layer model can condition on it (with a fixed thought it learns to ignore the prompt,
        # and RL then moves every prompt towards whichever icon succeeded first).
        msgs = uitars_messages(tasks[tid].instruction, [img], [answer(tasks[tid].instruction, (x, y))], max_images=1)
        samples[(tid, (x, y))] = trajectory_sample(encode_chat(policy, msgs, add_generation_prompt=False))
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    nll = []
    for _ in range(epochs):
        order = list(pairs)
        rng.shuffle(order)
        for i in range(0, len(order), len(points)):  # one optimizer step per 7 pairs
            batch = [samples[k] for k in order[i:i + len(points)]]
            m = distill_step(policy, opt, batch, micro_batch_size=len(points))
            nll.append(m["nll"] * m["tokens"] / len(batch))  # per answer, not per token
    transformers.utils.logging.disable_progress_bar()  # the save's shard bar would land in the table
    save_policy(policy, out)
    return {"seconds": time.perf_counter() - t0, "nll_first": nll[0], "nll_last": sum(nll[-4:]) / len(nll[-4:]),
            "pairs": len(pairs), "epochs": epochs, "image": [w, h]}


def first_screens(screen=(1280, 720)) -> tuple:
    """The reset desktop, and the screen after double-clicking each desktop icon on it (the app's
    window up, settled by the server's watch), from one real local desktop. -> (desktop image,
    {icon label: image})."""
    from env import VMPool
    from vm.desktop import desktop_icons
    pool = VMPool(1, timeout=60, screen=screen)
    try:
        pool.reset()
        shot = pool.screenshots()[0]
        if not shot.ok:
            raise SystemExit(f"the desktop did not give a screenshot ({shot.error}); run `bash setup.sh` first.")
        after = {}
        for label, (x, y) in desktop_icons(screen).items():
            pool.reset()
            after[label] = pool.clients[0].act({"type": "double_click", "x": x, "y": y}, settle="watch",
                                                screenshot="png").image
        return shot.value, after
    finally:
        pool.close()


def affordances(label: str, screen=(1280, 720)) -> list[tuple[int, int]]:
    """What the warm start double-clicks on the screen after double-clicking icon `label`, in screen
    pixels: the items of the window that opened when it shows any (the file manager: its folders
    and its file), else the desktop icons (every other app's window shows none of its own). The
    same list for every task: a prior over what the screen affords, not over what a task wants."""
    from vm.desktop import desktop_icons
    return list(FM_ITEMS.values()) if label == FM_ICON else list(desktop_icons(screen).values())


def answer(instruction: str, point: tuple[int, int]) -> str:
    """UI-TARS answer: the thought restates the instruction (see warm_start), then the double-click."""
    return f"Thought: {instruction}\nAction: left_double(start_box='({point[0]},{point[1]})')"


def second_answers(label: str, epoch: int, screen=(1280, 720), per_icon: int = len(FM_ITEMS)) -> list:
    """The step-2 points the warm start trains after icon `label` in this epoch: `per_icon` of the
    screen's affordances, the same number after every icon, so the step-1 answers stay uniform over
    the icons. A screen with more (the 7 desktop icons) takes them in turn: over 7 epochs each of
    them equally often (5 times)."""
    points = affordances(label, screen)
    start = epoch * per_icon
    return [points[(start + k) % len(points)] for k in range(per_icon)]


def last_turn_only(sample):
    """The sample with only its last assistant turn as a target (the earlier turns are history)."""
    mask, start, prev = list(sample.target_mask), 0, 0
    for i, m in enumerate(mask):
        if m and not prev:
            start = i
        prev = m
    return dataclasses.replace(sample, target_mask=[0] * start + mask[start:])


def decaying_sft(policy, per_epoch: list[list], sample, lr: float, batch: int, out: str) -> tuple[list[float], int]:
    """The multi-step warm starts' SFT: the keys of each epoch in their order, `batch` samples
    (sample(key)) an optimizer step, the lr decaying linearly to 10% so the last steps settle on
    the prior; saved to `out` (save_policy). -> (the NLL per token of each step, the steps)."""
    import torch
    import transformers

    from grpo import distill_step
    from model import save_policy
    opt = torch.optim.AdamW([p for p in policy.model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    steps = sum(math.ceil(len(x) / batch) for x in per_epoch)
    nll, step = [], 0
    for keys in per_epoch:
        for i in range(0, len(keys), batch):
            for g in opt.param_groups:
                g["lr"] = lr * (1 - 0.9 * step / max(1, steps - 1))
            nll.append(distill_step(policy, opt, [sample(k) for k in keys[i:i + batch]], micro_batch_size=batch)["nll"])
            step += 1
    transformers.utils.logging.disable_progress_bar()  # the save's shard bar would land in the table
    save_policy(policy, out)
    return nll, steps


def warm_start_multi(out: str, seed: int, task_ids: list[str], epochs: int, lr: float, screen=(1280, 720),
                     screens: tuple | None = None, batch: int = 16, fm_extra: int = 4) -> dict:
    """SFT the tiny model on two-step episodes in the UI-TARS format with 2 screenshots of history,
    with NO task knowledge. Per task prompt and epoch: step 1 (the reset desktop) answered with a
    double-click on each of the 7 icons, each 5 times; step 2 (the screen that click opened) with a
    double-click on 5 of what that screen affords (`affordances`, `second_answers`: the file
    manager's 5 items, or the desktop icons in turn). Both answers of an episode are targets, as in
    ARPO's trajectories. The file manager's screen is 1 of the 7 that step 2 sees but the only one
    whose affordances differ from the desktop's, and the 2-layer model learned to answer it with
    desktop icons; so each of its 5 items also comes `fm_extra` more times per epoch with only the
    step-2 answer as a target (step 1 stays uniform, every item and every task equally often).
    Every prompt gets the same uniform prior on every screen; the learning rate
    decays linearly to 10%, so the last steps settle on that prior. Saved to `out` (save_policy)."""
    from actions import smart_resize
    from model import encode_chat, uitars_messages
    from vm.desktop import desktop_icons
    from env import load_tasks
    from grpo import trajectory_sample
    from model import load_policy

    t0 = time.perf_counter()
    tasks = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
    desk, after = screens or first_screens(screen)
    policy = load_policy("tiny", seed=seed, max_pixels=MAX_PIXELS)
    h, w = smart_resize(desk.height, desk.width, max_pixels=MAX_PIXELS)

    def seen(p):  # screen pixels -> the image the model sees (its coordinates live there)
        return round(p[0] * w / screen[0]), round(p[1] * h / screen[1])
    cache = {}

    def sample(tid, label, q, last_only=False):
        if (tid, label, q, last_only) not in cache:
            ins = tasks[tid].instruction
            msgs = uitars_messages(ins, [desk, after[label]], [answer(ins, seen(icons[label])), answer(ins, seen(q))],
                                   max_images=2)
            s = trajectory_sample(encode_chat(policy, msgs, add_generation_prompt=False))
            cache[(tid, label, q, last_only)] = last_turn_only(s) if last_only else s
        return cache[(tid, label, q, last_only)]
    rng = random.Random(seed)
    icons = desktop_icons(screen)
    per_epoch = [[(tid, label, q, False) for tid in task_ids for label in icons for q in second_answers(label, e, screen)]
                 + [(tid, FM_ICON, q, True) for tid in task_ids for q in FM_ITEMS.values() for _ in range(fm_extra)]
                 for e in range(epochs)]
    for keys in per_epoch:
        rng.shuffle(keys)
    nll, steps = decaying_sft(policy, per_epoch, lambda k: sample(*k), lr, batch, out)
    return {"seconds": time.perf_counter() - t0, "samples": len(per_epoch[0]), "epochs": epochs, "image": [w, h],
            "steps": steps, "nll_first": nll[0], "nll_last": sum(nll[-5:]) / len(nll[-5:])}


# The self-correction claim (bench/claims.py arpo-self-correction): episodes of up to 4 steps where a
# wrong app can be opened and closed again. Two more affordances where a window is open: openbox's
# close-window key and finishing (on the bare desktop neither does anything).
CLOSE, FINISH = "hotkey(key='alt f4')", "finished()"


def repair_walk(rng: random.Random, labels: list[str], spoiled: bool, steps: int = 4) -> tuple[list, list]:
    """One episode of the uniform prior, on a desktop reduced to its stack of open windows (icon
    labels): every step picks uniformly among what the screen affords (the 7 icons, plus "close"
    and "finish" when a window is open); a spoiled start begins with a window of a random app open
    (a wrong one, for most tasks: the prior knows no task). -> (what each step saw: None = the bare
    desktop, else the label of the window on top; what each step did: a label, "close", "finish")."""
    stack = [rng.choice(labels)] if spoiled else []
    seen, did = [], []
    for _ in range(steps):
        seen.append(stack[-1] if stack else None)
        did.append(rng.choice(labels + (["close", "finish"] if stack else [])))
        if did[-1] == "finish":
            break
        if did[-1] == "close":
            stack.pop()
        else:
            stack.append(did[-1])
    return seen, did


def warm_start_repair(out: str, seed: int, task_ids: list[str], epochs: int, lr: float, screen=(1280, 720),
                      screens: tuple | None = None, batch: int = 16, walks: int = 28, max_images: int = 2) -> dict:
    """SFT the tiny model on episodes of up to 4 steps in the UI-TARS format (the last `max_images`
    screenshots in each prompt, the earlier answers as text), with NO task knowledge: per task prompt
    and epoch, `walks` random walks of the uniform prior (`repair_walk`), half of them from a
    spoiled start; each step of a walk is one sample, its prompt as the rollout builds it and only
    its own answer as the target. A screen is the real screenshot of the window on top (the
    desktop after double-clicking that icon, `first_screens`; a window under it is not drawn: an
    approximation the prior can afford). The lr decays linearly to 10%, as warm_start_multi's.
    Saved to `out` (save_policy)."""
    from actions import smart_resize
    from env import load_tasks
    from grpo import trajectory_sample
    from model import encode_chat, load_policy, uitars_messages
    from vm.desktop import desktop_icons

    t0 = time.perf_counter()
    tasks = {t.id: t for t in load_tasks(os.path.join(ROOT, "tasks"))}
    desk, after = screens or first_screens(screen)
    policy = load_policy("tiny", seed=seed, max_pixels=MAX_PIXELS)
    h, w = smart_resize(desk.height, desk.width, max_pixels=MAX_PIXELS)
    icons = desktop_icons(screen)
    labels = list(icons)

    def reply(ins: str, act: str) -> str:
        if act in ("close", "finish"):
            return f"Thought: {ins}\nAction: {CLOSE if act == 'close' else FINISH}"
        x, y = icons[act]
        return answer(ins, (round(x * w / screen[0]), round(y * h / screen[1])))
    cache = {}

    def sample(tid: str, seen: tuple, did: tuple):
        if (tid, seen, did) not in cache:
            ins = tasks[tid].instruction
            msgs = uitars_messages(ins, [desk if s is None else after[s] for s in seen], [reply(ins, d) for d in did],
                                   max_images=max_images)
            cache[(tid, seen, did)] = last_turn_only(trajectory_sample(encode_chat(policy, msgs,
                                                                                   add_generation_prompt=False)))
        return cache[(tid, seen, did)]
    rng = random.Random(seed)
    per_epoch = []
    for _ in range(epochs):
        keys = []
        for tid in task_ids:
            for k in range(walks):
                seen, did = repair_walk(rng, labels, spoiled=k % 2 == 1)
                keys += [(tid, tuple(seen[:i + 1]), tuple(did[:i + 1])) for i in range(len(did))]
        rng.shuffle(keys)
        per_epoch.append(keys)
    nll, steps = decaying_sft(policy, per_epoch, lambda k: sample(*k), lr, batch, out)
    return {"seconds": time.perf_counter() - t0, "samples": sum(map(len, per_epoch)) // max(1, epochs),
            "epochs": epochs, "image": [w, h], "steps": steps, "nll_first": nll[0],
            "nll_last": sum(nll[-5:]) / len(nll[-5:])}
