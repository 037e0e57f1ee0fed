"""plumbing/warm_start.py: how `--model tiny-uitars` and `--model tiny-explore` were made: the tiny
Qwen2.5-VL taught an answer FORMAT, shipped as checkpoint folders in models/.

    python -m plumbing.warm_start                       # rebuild both into models/ (a few minutes on 2 cores)
    python -m plumbing.warm_start tiny-explore --seed 1 --out /tmp/te   # another build; --model /tmp/te
    python -m pytest -q tests/test_warm_start.py        # the shipped ones load and answer in format
    python bench/warm_start.py                          # their format rate and click spread on a desktop

Why: the random tiny model (`--model tiny`) never writes a parseable answer, so a CPU run's format
rate is 0.00 and ScreenExplorer scores no step: rewards, advantages and updates are all zero, and a
forker's 30-second run shows nothing of the algorithm. These two are the tiny Qwen2.5-VL of a seed
after a short supervised warm start (the token-mean NLL of grpo.distill_step) on answers that teach
the format and nothing else:
  - tiny-explore: the ScreenExplorer prompt (model.explore_messages) answered
    {"intent": <one of 5 neutral intents>, "action": "<Kind>(x, y)"} with its six pointer actions;
  - tiny-uitars: the UI-TARS-1.5 prompt (model.uitars_messages) with a made-up instruction and one
    to three screenshots of history, each answered "Thought: <a sentence naming the action>\nAction:
    <call>" with UI-TARS's action space (click, left_double, right_single, scroll, hotkey, type,
    wait, finished, call_user; the pointer ones most often).
Every coordinate is drawn uniformly over the image the model sees: a flat prior over the screen,
no task knowledge. The screenshots are synthetic desktops drawn here with PIL (a wallpaper, icons
with labels, windows, a panel), encoded at three pixel caps (140x84, 588x336 and full size: 15,
~250 and ~1,200 image tokens), so building needs no desktop and the format holds at the resolution a
run uses.

Why they are shipped rather than built on first use: a build takes minutes on a CPU (the steps are
what makes the format hold at temperature 1), which a newcomer's first command should not wait
for, and two builds of the same recipe are not bit-identical, so the models a test measures are
the models everyone runs. The folders are a few MB (the model has ~0.3M parameters).

What it cost to get there, on a 2-layer model of width 64 (docs/log.md has the measurements):
  - the format broke mostly in the argument count of a call (`Click(12)`, `Click(3, 7, 199)`,
    `(8370)` for `(83, 70)`: the digits are one token each, and a 2-layer model loses count of
    where a number ends); more steps of the same recipe fixed it (tiny-uitars 1000, tiny-explore
    400), a higher lr did not;
  - full-size screenshots must be in the mix, or the numbers keep the size of the small images
    (every click in the left half of the screen); they cost far more than a small one, so the vision tower
    is frozen and its output remembered per screenshot (_frozen_vision), and a long sample is
    never padded together with short ones (_sft_step);
  - no typed text or keys in the explore answers and no copied instruction in the UI-TARS thought:
    a model that must also spell free text mixes it into the coordinates; no UI-TARS drag, the one
    call with four numbers;
  - the saved weights average the last ~10 steps (EMA 0.9) with the learning rate decayed to 1%:
    with the last step's weights the format rate varied from one build to the next.

Where this departs from the papers: neither trains a warm start like this; it exists only so the
tiny CPU model produces parseable answers. A real run starts from a real checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, replace

import torch
from PIL import Image, ImageDraw

import grpo
import qwen_vl
from model import WARM_STARTED, encode_chat, explore_messages, load_policy, save_policy, uitars_messages
from plumbing import progress


@dataclass(frozen=True)
class Recipe:
    style: str                     # "uitars" or "explore": the prompt and answer format
    steps: int                     # optimizer steps of grpo.distill_step
    batch: int                     # samples per step; sample j at max_pixels caps[j % len(caps)]
    pool: int                      # synthetic screenshots (or histories) per cap; answers are new each step
    lr: float                      # AdamW, linear decay to 1% over the steps
    caps: tuple                    # the max_pixels the samples are encoded at (run-time sizes vary)
    screens: tuple = ((1280, 720), (1280, 720), (1280, 720), (1024, 768), (1920, 1080))
    max_history: int = 1           # uitars: screenshots per sample, 1..max_history


RECIPES = {
    # Most samples at 140x84 (15 image tokens, cheap), a few at full size (1,196 tokens): the
    # format and the size of the numbers must hold at the resolution a run uses. The steps are what
    # makes the format hold at T=1 (the module docstring has the measurements).
    "tiny-explore": Recipe("explore", steps=400, batch=32, pool=8, lr=1e-2,
                           caps=(12544,) * 22 + (200704,) * 4 + (1003520,) * 6),
    "tiny-uitars": Recipe("uitars", steps=1000, batch=16, pool=8, lr=1e-2, max_history=3,
                          caps=(12544,) * 12 + (200704,) + (1003520,) * 3),
}


# ------------------------------------------------------------------------------------------------
# Synthetic screenshots: something desktop-like to look at, no desktop needed

WORDS = ("file", "edit", "view", "help", "notes", "report", "music", "photos", "settings", "terminal",
         "calculator", "clock", "editor", "browser", "mail", "home", "trash", "documents", "save",
         "open", "close", "new", "search", "tools", "window", "project", "data", "backup", "system")


def _colour(rng: random.Random, lo: int = 0, hi: int = 255) -> tuple:
    return tuple(rng.randint(lo, hi) for _ in range(3))


def synthetic_screen(rng: random.Random, size: tuple[int, int]) -> Image.Image:
    """A made-up desktop of `size` (w, h): a wallpaper (mostly one colour, as our desktop's), a
    panel with buttons and a clock, columns of labelled icons, and up to four windows (a title
    bar over text lines, a terminal, or a grid of buttons), colours and layout drawn from `rng`."""
    w, h = size
    img = Image.new("RGB", size, _colour(rng, 20, 200))
    d = ImageDraw.Draw(img)
    if rng.random() < 0.3:  # a vertical gradient wallpaper
        top, bottom = _colour(rng), _colour(rng)
        for y in range(0, h, 4):
            t = y / h
            d.rectangle([0, y, w, y + 4], fill=tuple(int(a + (b - a) * t) for a, b in zip(top, bottom)))
    for i in range(rng.randint(3, 12)):  # desktop icons in columns
        x, y = 30 + (i // 5) * 120, 20 + (i % 5) * 100
        d.rounded_rectangle([x + 20, y, x + 68, y + 48], radius=6, fill=_colour(rng))
        d.text((x + 10, y + 56), rng.choice(WORDS).title(), fill=(255, 255, 255))
    for _ in range(rng.randint(0, 4)):  # windows
        ww, wh = rng.randint(w // 6, w // 2), rng.randint(h // 5, h // 2)
        x, y = rng.randint(0, w - ww), rng.randint(0, max(1, h - wh - 30))
        kind = rng.choice(("text", "terminal", "buttons"))
        body = (20, 20, 20) if kind == "terminal" else _colour(rng, 200, 255)
        d.rectangle([x, y, x + ww, y + wh], fill=body, outline=(40, 40, 40))
        d.rectangle([x, y, x + ww, y + 22], fill=_colour(rng, 120, 230))
        d.text((x + ww // 2 - 30, y + 5), " ".join(rng.choice(WORDS) for _ in range(2)), fill=(0, 0, 0))
        for k in range(3):  # the title bar's buttons
            d.rectangle([x + ww - 18 * (k + 1), y + 4, x + ww - 18 * k - 4, y + 18], outline=(60, 60, 60))
        rows = (wh - 34) // 30
        for r in range(max(0, rows)):
            if kind == "buttons":
                for c in range(min(5, ww // 45)):
                    d.rectangle([x + 6 + c * 44, y + 30 + r * 30, x + 46 + c * 44, y + 56 + r * 30],
                                fill=(250, 250, 250), outline=(30, 30, 30))
                    d.text((x + 16 + c * 44, y + 36 + r * 30), rng.choice("0123456789+-*/=%"), fill=(0, 0, 0))
            else:
                line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))
                d.text((x + 6, y + 30 + r * 18), line, fill=(230, 230, 230) if kind == "terminal" else (20, 20, 20))
    panel = rng.choice((0, h - 30))  # a panel at the top or the bottom, with buttons and a clock
    d.rectangle([0, panel, w, panel + 30], fill=_colour(rng, 0, 90))
    for i in range(rng.randint(1, 5)):
        d.rectangle([120 + i * 150, panel + 3, 265 + i * 150, panel + 27], fill=_colour(rng, 30, 120))
        d.text((150 + i * 150, panel + 9), rng.choice(WORDS), fill=(255, 255, 255))
    d.text((w - 60, panel + 9), f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}", fill=(255, 255, 255))
    return img


# ------------------------------------------------------------------------------------------------
# Answers: the format, coordinates uniform over the image the model sees

VERBS = ("Open", "Close", "Find", "Start", "Check", "Use", "Show", "Save", "Rename", "Delete", "Create")
INTENTS = ("See what happens here", "Try something new", "Look at this part of the screen",
           "Find out what this does", "Explore the screen")
# UI-TARS's action space, (call, weight, the thought that goes with it): the pointer calls most
# often, as in a GUI agent's answers. The thought names the action, not the task, and typed text
# and keys come from short fixed lists: a 2-layer model that must also copy the instruction or
# spell random words mixes those into the call's arguments (the format broke).
UITARS_CALLS = (("click", 4, "I click it."), ("left_double", 3, "I open it."),
                ("right_single", 1, "I open its menu."), ("scroll", 1, "I scroll to see more."),
                ("hotkey", 0.5, "I press keys."), ("type", 0.5, "I type it."), ("wait", 0.25, "I wait for it."),
                ("finished", 0.25, "The task is done."), ("call_user", 0.25, "I need help."))
KEYS = ("ctrl c", "ctrl v", "ctrl s", "enter", "esc", "alt tab")
TEXTS = ("hello", "notes.txt", "hello world\\n", "1+2=")
# ScreenExplorer's pointer actions (its random baseline's). Not Text(x, y, "...") and Key("..."): a
# 2-layer model mixes their argument lists up with the pointer ones (with them at a quarter of the
# weight each, the format suffered at the same budget).
EXPLORE_CALLS = ("Click", "DoubleClick", "RightClick", "Move", "ScrollUp", "ScrollDown")


def instruction(rng: random.Random) -> str:
    """A made-up task: "Open the notes." & co., sometimes a longer one of random words."""
    if rng.random() < 0.7:
        return f"{rng.choice(VERBS)} the {rng.choice(WORDS)}{rng.choice(('', ' ' + rng.choice(WORDS)))}."
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."


def _xy(rng: random.Random, size: tuple[int, int]) -> tuple[int, int]:
    return rng.randrange(size[0]), rng.randrange(size[1])


def uitars_answer(rng: random.Random, size: tuple[int, int]) -> str:
    """One UI-TARS-1.5 answer in the (w, h) image the model sees."""
    call, _, thought = rng.choices(UITARS_CALLS, [w for _, w, _ in UITARS_CALLS])[0]
    x, y = _xy(rng, size)
    # "(x, y)" with a space, which UI-TARS's parser (and ours) reads like the released "(x,y)": with
    # the comma alone the 2-layer model often dropped it ("(14265)"), as if the
    # two numbers were one (digits are one token each); the explore answers, "Click(x, y)", kept it.
    xy = f"({x}, {y})"
    action = {
        "click": f"click(start_box='{xy}')", "left_double": f"left_double(start_box='{xy}')",
        "right_single": f"right_single(start_box='{xy}')",
        "scroll": f"scroll(start_box='{xy}', direction='{rng.choice(('down', 'up'))}')",
        "hotkey": f"hotkey(key='{rng.choice(KEYS)}')", "type": f"type(content='{rng.choice(TEXTS)}')",
        "wait": "wait()", "finished": "finished(content='done')", "call_user": "call_user()"}[call]
    return f"Thought: {thought}\nAction: {action}"


def explore_answer(rng: random.Random, size: tuple[int, int]) -> str:
    """One ScreenExplorer answer in the (w, h) image the model sees."""
    x, y = _xy(rng, size)
    action = f"{rng.choice(EXPLORE_CALLS)}({x}, {y})"
    return f'{{"intent": "{rng.choice(INTENTS)}", "action": "{action}"}}'


# ------------------------------------------------------------------------------------------------
# Training


def _prompts(policy, recipe: Recipe, rng: random.Random) -> dict:
    """cap -> recipe.pool prompts at that cap: (policy at that cap, screenshots, task, (w, h) seen)."""
    out = {}
    for cap in sorted(set(recipe.caps)):
        p = replace(policy, image_processor=qwen_vl.image_processor(policy.family, 56 * 56, cap), pixels={})
        out[cap] = []
        for _ in range(recipe.pool):
            # several screenshots (history) at the small caps only: several full-size ones train slowly
            n = rng.randint(1, recipe.max_history) if cap <= 50176 else 1
            screen = rng.choice(recipe.screens)
            shots = [synthetic_screen(rng, screen) for _ in range(n)]
            size = encode_chat(p, explore_messages(shots[0])).image_sizes[0]  # (w, h) the model sees
            out[cap].append((p, shots, instruction(rng), size))
    return out


def _sample(prompt, recipe: Recipe, rng: random.Random):
    """A fresh answer (or history of answers) to one prompt, as a grpo.Sample: every answer a target."""
    p, shots, task, size = prompt
    if recipe.style == "explore":
        msgs = explore_messages(shots[0]) + [{"role": "assistant", "content": explore_answer(rng, size)}]
    else:
        msgs = uitars_messages(task, shots, [uitars_answer(rng, size) for _ in shots])
    return grpo.trajectory_sample(encode_chat(p, msgs, add_generation_prompt=False))


@contextlib.contextmanager
def _frozen_vision(model):
    """The vision tower frozen and its output remembered per image, for the warm start only: the
    same few screenshots come back every step, and a full-size one spends most of its sample's
    time in the tower (a full attention over 4,784 patches). The tower's forward is replaced on
    this one instance, by one that runs the stock forward once per distinct image (keyed by its
    pixels) and hands back the merged tokens of the batch's images in order; put back after."""
    visual = model.model.visual
    params = [q for q in visual.parameters() if q.requires_grad]
    for q in params:
        q.requires_grad_(False)
    stock, memo, kind = visual.forward, {}, []

    def forward(pixel_values, grid_thw=None, **kwargs):
        tokens = []
        for chunk, grid in zip(torch.split(pixel_values, grid_thw.prod(-1).tolist()), grid_thw):  # per image
            # keyed by the image's grid and a sample of its pixels (every 61st patch: ~2% of a full
            # screenshot's 22 MB, and no two screenshots of the warm start share it)
            key = (tuple(grid.tolist()), hashlib.blake2b(chunk[::61].detach().cpu().numpy().tobytes()).hexdigest())
            if key not in memo:
                out = stock(chunk, grid_thw=grid[None], **kwargs)
                kind[:] = [type(out)]
                memo[key] = getattr(out, "pooler_output", out)  # (n_tokens, D): transformers 5.x wraps it
            tokens.append(memo[key])
        merged = torch.cat(tokens)  # (sum n_tokens, D), the batch's images in order
        return merged if kind[0] is torch.Tensor else kind[0](pooler_output=merged)

    visual.forward = forward
    try:
        yield
    finally:
        del visual.forward  # the class's forward again
        for q in params:
            q.requires_grad_(True)


def _sft_step(policy, opt, samples: list, short: int = 800) -> float:
    """One supervised step on the token-mean NLL of every target token (grpo.distill_step's loss),
    with micro-batches chosen by length: short samples of similar lengths together, every long one
    alone. A
    full-size screenshot's 1,400 tokens in a micro-batch would pad the 200-token ones to its
    length, and two long ones of unequal length together take a padded attention far slower than
    each alone (CPU). -> the step's NLL per target token."""
    groups = []
    for s in sorted(samples, key=lambda s: len(s.input_ids)):
        n = len(s.input_ids)
        if not groups or n > short or n > 1.5 * len(groups[-1][0].input_ids):
            groups.append([])  # a new micro-batch: a long sample, or the lengths have grown by half
        groups[-1].append(s)
    batches = [grpo.collate(mb, policy.tokenizer.pad_token_id) for mb in groups]
    total = sum(float(b["target_mask"][:, 1:].sum()) for b in batches)
    opt.zero_grad(set_to_none=True)
    nll = 0.0
    for b in batches:
        loss = -grpo.per_token_logps(policy.model, b).sum() / total  # ALGO: token-mean NLL, (B, T) summed
        loss.backward()
        nll += loss.item()
    torch.nn.utils.clip_grad_norm_([q for q in policy.model.parameters() if q.grad is not None], 1.0)
    opt.step()
    return nll


def train(policy, recipe: Recipe, seed: int, desc: str = "warm start") -> dict:
    """The warm start itself, in place on `policy` (fp32, CPU), with a progress bar (step, loss, time
    left). -> {"nll_first", "nll_last", "seconds"}."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    prompts = _prompts(policy, recipe, rng)
    nll = []
    # The vision tower stays as it is (the format is the language model's to learn), and a frozen
    # tower's output can be remembered: most of the time a full-size screenshot costs is in it.
    with _frozen_vision(policy.model):
        params = [q for q in policy.model.parameters() if q.requires_grad]
        opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
        # The saved weights are an average over the last ~10 steps (EMA 0.9), not the last step's:
        # how often a tiny model's samples break the format at T=1 varied from one build
        # to the next with the last step's weights.
        average = [q.detach().clone() for q in params]
        bar = progress.bar(recipe.steps, desc)  # on a terminal: step, NLL, time left
        for step in range(recipe.steps):
            for g in opt.param_groups:  # linear decay to 1%: the last steps settle the format
                g["lr"] = recipe.lr * (1 - 0.99 * step / max(1, recipe.steps - 1))
            # slot j of every batch at cap caps[j], a random prompt, new answers every time (a fixed
            # set of answers would be memorised, not generalised)
            batch = [_sample(rng.choice(prompts[recipe.caps[j % len(recipe.caps)]]), recipe, rng)
                     for j in range(recipe.batch)]
            nll.append(_sft_step(policy, opt, batch))
            bar.update(1)
            bar.set_postfix_str(f"NLL per token {nll[-1]:.2f}")
            with torch.no_grad():
                for a, q in zip(average, params):
                    a.mul_(0.9).add_(q, alpha=0.1)
        bar.close()
        with torch.no_grad():
            for a, q in zip(average, params):
                q.copy_(a)
    return {"nll_first": nll[0], "nll_last": sum(nll[-5:]) / len(nll[-5:]), "seconds": time.perf_counter() - t0}


# ------------------------------------------------------------------------------------------------
# A build: the tiny model of `seed`, trained, saved atomically


def build(name: str, out: str, seed: int = 0) -> dict:
    """Warm-start the tiny Qwen2.5-VL of `seed` with RECIPES[name] and save it to `out` (a checkpoint
    folder, written into a temporary one and renamed: complete or absent). -> its warm_start.json."""
    policy = load_policy("tiny", seed=seed, device="cpu")
    stats = train(policy, RECIPES[name], seed, desc=name)
    tmp = out.rstrip("/") + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    save_policy(policy, tmp)
    record = {"name": name, "seed": seed, "recipe": RECIPES[name].__dict__, **stats}
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump(record, f, indent=1, default=str)
    shutil.rmtree(out, ignore_errors=True)
    os.rename(tmp, out)
    return record


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m plumbing.warm_start", description=__doc__.split("\n")[0])
    p.add_argument("names", nargs="*", default=list(RECIPES), help=f"which to build (default: {' and '.join(RECIPES)})")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's seed (the shipped ones: 0)")
    p.add_argument("--out", default="", help="the folder to write (one name only; default: models/<name>, the shipped one)")
    p.add_argument("--steps", type=int, default=0, help="optimizer steps instead of the recipe's (a quick check of the builder)")
    a = p.parse_args(argv)
    if a.steps:
        RECIPES.update({n: replace(r, steps=a.steps) for n, r in RECIPES.items()})
    if a.out and len(a.names) != 1 or set(a.names) - set(RECIPES):
        p.error(f"name one of {list(RECIPES)} with --out, or any of them without it")
    for name in a.names:
        out = a.out or WARM_STARTED[name]
        r = build(name, out, a.seed)
        print(f"warm_start: {name} in {r['seconds']:.0f} s, NLL per token {r['nll_first']:.2f} -> {r['nll_last']:.2f}: {out}")


if __name__ == "__main__":
    main()
